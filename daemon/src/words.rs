//! The words people read: one vocabulary for a node's state, relative times and cut ids.
//!
//! `up`'s live table, `status`, `watch`, `describe` and `plan` all describe a
//! node through [`state_word`] and [`state_text`], so the same node is never
//! `Dormant` in one place and `ready` in another.

use swactor_actors::{AgentLink, ClusterSnapshot, NodeSummary};
use swactor_provisioning::{
    BootstrapStage, Change, EffectKind, Intent, NextStep, NodeStage, ShutdownMode, Timestamp,
};

/// Where a node is, in one word.
///
/// `creating` (a machine is being leased), `booting` (the agent starts and
/// runs its boot check), `joining` (waiting for the agent to join this
/// daemon), `ready`, `disconnected` (a joined agent went silent; it has a
/// grace period to come back), `failed` (the attempt failed; it is cleaned
/// up, then retried), `restarting` (waiting to start the next attempt),
/// `deleting` and `deleted` (the node is being removed or replaced).
pub fn state_word(n: &NodeSummary) -> &'static str {
    if n.intent == Intent::Deleting {
        // A failed attempt is cleaned up like any deleted one; its failure,
        // counted until the slot is next ready, is what people need to see.
        return match n.stage {
            NodeStage::Failed => "failed",
            NodeStage::Destroyed if n.failures > 0 => "failed",
            NodeStage::Destroyed => "deleted",
            _ => "deleting",
        };
    }
    if matches!(n.agent, AgentLink::Away { .. }) {
        return "disconnected";
    }
    if n.ready {
        return "ready";
    }
    stage_word(n.stage)
}

/// The word for a stage of an attempt that is not (or no longer) ready.
pub fn stage_word(stage: NodeStage) -> &'static str {
    match stage {
        NodeStage::New | NodeStage::LeaseRequested | NodeStage::LeaseCreated => "creating",
        NodeStage::EndpointKnown | NodeStage::BootstrapRunning => "booting",
        // Joined once, but not (yet) joined to this daemon: an adopted node
        // waits for its agent to connect again.
        NodeStage::SwactorJoined | NodeStage::HandedOff | NodeStage::Dormant => "joining",
        NodeStage::Failed => "failed",
        NodeStage::Destroyed => "restarting",
    }
}

/// [`state_word`] with what happens next, as the daemon's core says it
/// ([`NextStep`]): `failed, retrying in 12 s`, `restarting in 3 s`,
/// `disconnected (grace for 4 s more)`, `failed, held: paused`.
pub fn state_text(n: &NodeSummary, now: Timestamp) -> String {
    let word = state_word(n);
    match n.next {
        NextStep::LostAt { at, replaced } => {
            let then = if replaced {
                ""
            } else {
                "; not replaced while paused"
            };
            if at > now {
                format!(
                    "{word} (grace for {} more{then})",
                    span_up(at.saturating_since(now))
                )
            } else {
                format!("{word} (grace over{then})")
            }
        }
        NextStep::RetryAt(at) if word == "restarting" => format!("restarting {}", until(at, now)),
        NextStep::RetryAt(at) => format!("{word}, retrying {}", until(at, now)),
        NextStep::Held(by) => format!("{word}, held: {by}"),
        NextStep::Nothing | NextStep::Working | NextStep::Leaving => word.to_owned(),
    }
}

/// What comes next, for one column or one fact: `in 12 s`, `now`, `held:
/// paused`, or `-` when nothing is waited for.
pub fn next_words(next: NextStep, now: Timestamp) -> String {
    match next {
        NextStep::RetryAt(at) => until(at, now),
        NextStep::Held(by) => format!("held: {by}"),
        NextStep::LostAt { at, replaced } => match (replaced, at > now) {
            (true, true) => format!("replaced unless back {}", until(at, now)),
            (true, false) => "replaced: its grace is over".to_owned(),
            (false, true) => format!(
                "lost unless back {} (not replaced while paused)",
                until(at, now)
            ),
            (false, false) => "lost; not replaced while paused".to_owned(),
        },
        NextStep::Nothing | NextStep::Working | NextStep::Leaving => "-".to_owned(),
    }
}

/// The STATE column, next to a RETRY column: the word, and for a
/// disconnected agent the grace it has left.
pub fn state_cell(n: &NodeSummary, now: Timestamp) -> String {
    match state_word(n) {
        "disconnected" => state_text(n, now),
        word => word.to_owned(),
    }
}

/// The RETRY column: `in 12 s`, `now`, `held: paused`, or `-`.
pub fn retry_cell(n: &NodeSummary, now: Timestamp) -> String {
    match n.next {
        NextStep::RetryAt(_) | NextStep::Held(_) => next_words(n.next, now),
        _ => "-".to_owned(),
    }
}

/// `in 12 s` for a moment ahead of `now`, `now` for one already due.
pub fn until(at: Timestamp, now: Timestamp) -> String {
    if at <= now {
        "now".to_owned()
    } else {
        format!("in {}", span_up(at.saturating_since(now)))
    }
}

/// `3 min ago` for a moment before `now`.
pub fn ago(at: Timestamp, now: Timestamp) -> String {
    let ms = now.saturating_since(at);
    if ms < 1_000 {
        "just now".to_owned()
    } else {
        format!("{} ago", span_down(ms))
    }
}

/// A span rounded up to whole units (a wait of 0.2 s is "1 s", never "0 s").
pub fn span_up(ms: u64) -> String {
    span(ms.div_ceil(1_000))
}

/// What a node's agent does if its daemon goes for good (its group's
/// `orphan_after_s`), after when its lease was last renewed:
/// `renewed 2 s ago · ends itself 60 min after its daemon stops renewing
/// its lease`.
pub fn orphan_words(n: &NodeSummary) -> String {
    if n.orphan_after_s == 0 {
        return "never ends itself (orphan_after_s = 0)".to_owned();
    }
    let after = span(u64::from(n.orphan_after_s));
    format!(
        "{} · ends itself {after} after its daemon stops renewing its lease",
        lease_words(n)
    )
}

/// When a node's lease was last renewed, as the daemon that renews it
/// sees it: `renewed 2 s ago`, `last renewed 40 s ago (its agent is
/// away)`, `given when its agent joins`.
pub fn lease_words(n: &NodeSummary) -> String {
    let ago = |ms: u64| {
        if ms < 1_000 {
            "just now".to_owned()
        } else {
            format!("{} ago", span_down(ms))
        }
    };
    match (n.agent, n.lease_renewed_ms_ago) {
        (AgentLink::Connected, Some(ms)) => format!("renewed {}", ago(ms)),
        (AgentLink::Connected, None) => "renewed while connected".to_owned(),
        (AgentLink::Away { .. }, Some(ms)) => {
            format!("last renewed {} (its agent is away)", ago(ms))
        }
        (AgentLink::Away { .. }, None) => "not renewed while its agent is away".to_owned(),
        (AgentLink::NotJoined, _) => "given when its agent joins".to_owned(),
    }
}

/// A span rounded down to whole units.
fn span_down(ms: u64) -> String {
    span(ms / 1_000)
}

/// A span of whole seconds in the largest unit it fills (`90 s`, `5 min`, `3 h`, `2 d`), rounded down.
pub fn span(secs: u64) -> String {
    match secs {
        0..120 => format!("{secs} s"),
        120..7_200 => format!("{} min", secs / 60),
        7_200..172_800 => format!("{} h", secs / 3_600),
        _ => format!("{} d", secs / 86_400),
    }
}

/// Dollars from millionths, to the tenth of a cent: `1.206`.
pub fn usd(micros: u64) -> String {
    format!("{:.3}", micros as f64 / 1e6)
}

/// Where the run stands against its budget, in one line (`None` when it
/// has no budget and rents nothing by the hour): `budget: 0.012 of 0.050 $
/// spent · 1.206 $/h now · reached in ~2 min, then the run is torn down`.
pub fn budget_line(
    budget: Option<&swactor_provisioning::budget::Budget>,
    spend: Option<&swactor_provisioning::budget::Spend>,
) -> Option<String> {
    use swactor_provisioning::budget::{OnBudget, Verdict, verdict};
    match (budget, spend) {
        (None, None) => None,
        (None, Some(s)) if s.spent_micros == 0 && s.usd_per_hour_micros == 0 => None,
        (None, Some(s)) => Some(format!(
            "spent: {} $ so far · {} $/h now (no budget_usd)",
            usd(s.spent_micros),
            usd(s.usd_per_hour_micros)
        )),
        (Some(b), None) => Some(format!(
            "budget: {} $ (this daemon rents nothing by the hour to count against it)",
            usd(b.usd_micros)
        )),
        (Some(b), Some(s)) => {
            let then = match b.on_reached {
                OnBudget::Down => "the run is torn down",
                OnBudget::Pause => "the run is paused",
            };
            let head = format!(
                "budget: {} of {} $ spent · {} $/h now",
                usd(s.spent_micros),
                usd(b.usd_micros),
                usd(s.usd_per_hour_micros)
            );
            Some(match verdict(b, *s) {
                Verdict::Reached => format!("{head} · reached: {then}"),
                Verdict::Within { left_ms: None } => format!("{head} · nothing rented now"),
                Verdict::Within { left_ms: Some(ms) } => {
                    format!("{head} · reached in ~{}, then {then}", span_up(ms))
                }
            })
        }
    }
}

/// A span in hours and minutes where a lifetime needs them: `45 s`,
/// `12 min`, `2 h 10 min`, `3 d 4 h`; rounded down (`up` rounds up).
fn span_fine(secs: u64, up: bool) -> String {
    let (unit, small) = match secs {
        0..120 => return format!("{secs} s"),
        120..7_200 => (60, 0),
        7_200..172_800 => (3_600, 60),
        _ => (86_400, 3_600),
    };
    let step = if small == 0 { unit } else { small };
    let secs = if up {
        secs.div_ceil(step) * step
    } else {
        secs / step * step
    };
    let (big, rest) = (secs / unit, secs % unit);
    let big_word = match unit {
        60 => "min",
        3_600 => "h",
        _ => "d",
    };
    match (rest, small) {
        (0, _) | (_, 0) => format!("{big} {big_word}"),
        (rest, 60) => format!("{big} {big_word} {} min", rest / 60),
        (rest, _) => format!("{big} {big_word} {} h", rest / 3_600),
    }
}

/// A lifetime as a shape sets it: `max_lifetime_s (2 h)`.
pub fn lifetime_setting(
    lifetime: &swactor_provisioning::lifetime::Lifetime,
    which: swactor_provisioning::lifetime::Which,
) -> String {
    format!(
        "{} ({})",
        which.field(),
        span_fine(lifetime.seconds(which), false)
    )
}

/// When the run tears itself down, in one line: `tears down in 2 h 10 min
/// (max_lifetime_s)`, `tears down in 25 min (idle_teardown_s: idle 5
/// min)`, `no idle teardown while a job runs (idle_teardown_s: 30 min)`,
/// or `tearing down: max_lifetime_s (2 h) reached`.
pub fn lifetime_line(s: &swactor_provisioning::lifetime::Status) -> String {
    use swactor_provisioning::lifetime::{Verdict, Which};
    match s.verdict {
        Verdict::Reached(which) => {
            format!(
                "tearing down: {} reached",
                lifetime_setting(&s.lifetime, which)
            )
        }
        Verdict::Within { left_ms, which } => {
            let idle = match (which, s.idle_ms) {
                (Which::IdleTeardown, Some(ms)) => {
                    format!(": idle {}", span_fine(ms / 1_000, false))
                }
                _ => String::new(),
            };
            format!(
                "tears down in {} ({}{idle})",
                span_fine(left_ms.div_ceil(1_000), true),
                which.field()
            )
        }
        Verdict::Unbounded => format!(
            "no idle teardown while a job runs (idle_teardown_s: {})",
            span_fine(s.lifetime.idle_teardown_s, false)
        ),
    }
}

/// One resource of another deployment, in a few words: `vast instance 12
/// (gpu-0/a3, deployment 0a1b2c3d, 0.420 $/h)`.
pub fn foreign_resource(r: &swactor_providers::ForeignResource) -> String {
    let deployment = r.deployment.as_deref().map_or_else(
        || "made before deployments were recorded".to_owned(),
        |d| format!("deployment {d}"),
    );
    let cost = r
        .usd_per_hour_micros
        .map(|m| format!(", {} $/h", usd(m)))
        .unwrap_or_default();
    format!(
        "{} {} ({}, {deployment}{cost})",
        r.provider, r.resource, r.key
    )
}

/// What the resources of other deployments cost together, in millionths of
/// a dollar per hour; `None` when no provider priced any.
pub fn foreign_cost(foreign: &[swactor_providers::ForeignResource]) -> Option<u64> {
    let mut priced = foreign
        .iter()
        .filter_map(|r| r.usd_per_hour_micros)
        .peekable();
    priced.peek()?;
    Some(priced.sum())
}

/// What a daemon says of its run's resources that another deployment made:
/// how many, what they cost, the first few, and that they are left alone.
pub fn foreign_resources(
    run: &swactor_provisioning::RunId,
    foreign: &[swactor_providers::ForeignResource],
) -> String {
    const SHOWN: usize = 5;
    let mut listed: Vec<String> = foreign.iter().take(SHOWN).map(foreign_resource).collect();
    if foreign.len() > SHOWN {
        listed.push(format!("and {} more", foreign.len() - SHOWN));
    }
    let cost = foreign_cost(foreign)
        .map(|m| format!(", {} $/h together", usd(m)))
        .unwrap_or_default();
    format!(
        "run {run} also has {} resource(s) that another deployment made{cost}: {}. This daemon \
         never adopts, replaces or destroys them: another daemon with the same run holds them, \
         or a state directory that was lost made them (then remove them by hand, or start that \
         directory again with --adopt or --fresh)",
        foreign.len(),
        listed.join("; ")
    )
}

/// A span of milliseconds as a lease is read: to the tenth of a second
/// under a minute (`1.2 s`, `10 s`), in whole units past it.
fn lease_span(ms: u64) -> String {
    match ms {
        0..60_000 if ms.is_multiple_of(1_000) => format!("{} s", ms / 1_000),
        0..60_000 => format!("{:.1} s", ms as f64 / 1e3),
        _ => span_down(ms),
    }
}

/// Who leads a run that several daemons share (`swactor up --etcd`) and
/// who would take over, in one line, as of `now_wall_ms` (milliseconds
/// since the Unix epoch): `leader: ctl-a (pid 4242) since 12:03:04 (5 min
/// ago) · lease 10 s, renewed 1.2 s ago · standbys: 1 (ctl-b (pid 77))`.
///
/// A leader whose last renewal is as old as its lease less its margin has
/// stopped acting (`docs/ha.md`), and the line says so;
/// with no standby, it says that nothing takes over.
pub fn leader_line(ha: &swactor_actors::HaStatus, now_wall_ms: u64) -> String {
    let mut line = format!("leader: {}", cut(&ha.leader));
    if ha.leading_since_wall_ms > 0 {
        let ms = now_wall_ms.saturating_sub(ha.leading_since_wall_ms);
        let ago = if ms < 1_000 {
            "just now".to_owned()
        } else {
            format!("{} ago", span_down(ms))
        };
        line.push_str(&format!(
            " since {} ({ago})",
            clock_at(ha.leading_since_wall_ms)
        ));
    }
    line.push_str(&format!(
        " · lease {}, renewed {} ago",
        lease_span(ha.lease_ttl_ms),
        lease_span(ha.renewed_ms_ago)
    ));
    let bound_ms = ha.lease_ttl_ms.saturating_sub(ha.margin_ms);
    if ha.lease_ttl_ms > 0 && ha.renewed_ms_ago >= bound_ms {
        line.push_str(&format!(
            " (past lease − margin, {}: it acts on nothing until a renewal is answered)",
            lease_span(bound_ms)
        ));
    }
    if ha.standbys.is_empty() {
        line.push_str(" · standbys: none — nothing takes over if the leader's machine is lost");
    } else {
        let standbys: Vec<String> = ha.standbys.iter().map(|s| cut(s)).collect();
        line.push_str(&format!(
            " · standbys: {} ({})",
            ha.standbys.len(),
            names(&standbys)
        ));
    }
    line
}

/// What a provider effect does, for people.
pub fn effect_words(effect: EffectKind) -> &'static str {
    match effect {
        EffectKind::CreateLease => "leasing a machine",
        EffectKind::LookupEndpoint => "looking up its address",
        EffectKind::StartBootstrap => "starting its agent",
        EffectKind::CancelBootstrap => "stopping its agent",
        EffectKind::DestroyLease => "releasing its machine",
    }
}

/// An operation's outcome as the daemon reports it (`lease X`, `Definite
/// failure: …`), in the words of this vocabulary; text it does not know is
/// kept as it is.
pub fn outcome_words(outcome: &str) -> String {
    const KNOWN: &[(&str, &str)] = &[
        ("Definite failure: ", "failed: "),
        (
            "Ambiguous failure: ",
            "no clear outcome, to be checked again: ",
        ),
        ("LeaseGone failure: ", "its machine is gone: "),
        ("lease destroyed", "machine released"),
        ("bootstrap cancelled", "agent stopped"),
        ("endpoint not ready", "not reachable yet"),
        ("lease ", "leased "),
        ("endpoint ", "reachable at "),
        ("session ", "agent started: "),
    ];
    for (from, to) in KNOWN {
        if let Some(rest) = outcome.strip_prefix(from) {
            return format!("{to}{rest}");
        }
    }
    outcome.to_owned()
}

/// The last thing an attempt's bootstrap reported, for people.
pub fn bootstrap_words(stage: BootstrapStage) -> &'static str {
    match stage {
        BootstrapStage::SshConnect => "connecting to the machine",
        BootstrapStage::BootCheck => "running the boot check",
        BootstrapStage::SwactorStart => "starting the agent",
        BootstrapStage::Join => "joining",
        BootstrapStage::Converged => "converged",
        BootstrapStage::SshConnectFailed => "the machine could not be reached",
        BootstrapStage::BootCheckFailed => "the boot check failed",
        BootstrapStage::SwactorStartFailed => "the agent did not start",
        BootstrapStage::JoinFailed => "the agent could not join",
        BootstrapStage::AgentLost => "the agent was lost",
    }
}

/// How a slot changes under a new shape.
pub fn change_word(change: Change) -> &'static str {
    match change {
        Change::Create => "create",
        Change::Replace => "replace",
        Change::Destroy => "destroy",
    }
}

/// Ids longer than this are cut in messages.
const ID_SHOWN_MAX_CHARS: usize = 80;
/// How much of a cut id is shown.
const ID_CUT_TO_CHARS: usize = 40;

/// `id` itself, or for a very long one its first 40 characters and its length:
/// `aaaa… (5000 characters)`. Node ids are at most 74 characters, so no valid
/// id is ever cut.
pub fn cut(id: &str) -> String {
    let count = id.chars().count();
    if count <= ID_SHOWN_MAX_CHARS {
        id.to_owned()
    } else {
        let head: String = id.chars().take(ID_CUT_TO_CHARS).collect();
        format!("{head}… ({count} characters)")
    }
}

/// Any run of more than [`LONG_WORD_MAX_CHARS`] non-blank characters in
/// `text`, cut as [`cut`] does: the last guard before an error reaches the
/// terminal, for values echoed by code this crate does not format.
pub fn cut_long_words(text: &str) -> String {
    let mut out = String::with_capacity(text.len().min(4_096));
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        if word.chars().count() > LONG_WORD_MAX_CHARS {
            out.push_str(&cut(word));
        } else {
            out.push_str(word);
        }
        word.clear();
    };
    for ch in text.chars() {
        if ch.is_whitespace() {
            flush(&mut word, &mut out);
            out.push(ch);
        } else {
            word.push(ch);
        }
    }
    flush(&mut word, &mut out);
    out
}

/// Longer words than this are cut by [`cut_long_words`]: well above any path
/// or ticket a message names, well below what floods a terminal.
const LONG_WORD_MAX_CHARS: usize = 400;

/// The wall-clock time now, as `HH:MM:SS` in local time.
pub fn clock() -> String {
    chrono::Local::now().format("%H:%M:%S").to_string()
}

/// [`clock`] at `at_ms` (milliseconds since the Unix epoch), e.g. an event's stamp.
pub fn clock_at(at_ms: u64) -> String {
    i64::try_from(at_ms)
        .ok()
        .and_then(chrono::DateTime::from_timestamp_millis)
        .map_or_else(clock, |t| {
            t.with_timezone(&chrono::Local)
                .format("%H:%M:%S")
                .to_string()
        })
}

/// How many names a list in a message shows before it says how many more.
const NAMES_SHOWN: usize = 20;

/// `a, b, c` — or for a long list its first names and `… and 99980 more`.
pub fn names<T: std::fmt::Display>(list: &[T]) -> String {
    let mut text = list
        .iter()
        .take(NAMES_SHOWN)
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    if list.len() > NAMES_SHOWN {
        text.push_str(&format!(", … and {} more", list.len() - NAMES_SHOWN));
    }
    text
}

/// `1 node` or `3 nodes`.
pub fn nodes(n: u64) -> String {
    if n == 1 {
        "1 node".to_owned()
    } else {
        format!("{n} nodes")
    }
}

/// The cluster in a word or two, as `status` heads it and `status --json`
/// gives it (`state`): `tearing down`, `stopping` (a daemon leaving its
/// nodes running), `paused`, `converged` or `converging`.
pub fn cluster_state(s: &ClusterSnapshot) -> &'static str {
    match s.shutting_down {
        Some(ShutdownMode::Teardown) => "tearing down",
        Some(ShutdownMode::Keep) => "stopping",
        None if s.paused => "paused",
        None if s.converged => "converged",
        None => "converging",
    }
}

/// The nodes a `down --keep` had no machine of to keep.
pub fn without_machine<T: std::fmt::Display>(list: &[T]) -> String {
    format!(
        "{} node(s) had no machine to keep (failed and cleaned up, or not created yet): {}; \
         the next `swactor up` starts them",
        list.len(),
        names(list)
    )
}

/// A size for people, in decimal units: `1 byte`, `6 bytes`, `1.2 kB`,
/// `3.4 MB`, `5.0 GB`.
pub fn size_words(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["kB", "MB", "GB", "TB", "PB", "EB"];
    match bytes {
        1 => return "1 byte".to_owned(),
        0..1000 => return format!("{bytes} bytes"),
        _ => {}
    }
    #[allow(clippy::cast_precision_loss)] // One decimal is shown.
    let mut value = bytes as f64 / 1000.0;
    let mut unit = 0;
    // 999,960 bytes read `1.0 MB`, not `1000.0 kB`.
    while value >= 999.95 && unit + 1 < UNITS.len() {
        value /= 1000.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// Two sizes a message compares (`2.0 MB, more than the limit of 1.0 MB`):
/// when they would read alike, each with its exact count of bytes, so a
/// size is never said to be past a limit that reads the same.
pub fn sizes_compared(size: u64, limit: u64) -> (String, String) {
    let (a, b) = (size_words(size), size_words(limit));
    if a == b && size != limit {
        (
            format!("{a} ({size} bytes)"),
            format!("{b} ({limit} bytes)"),
        )
    } else {
        (a, b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use swactor_provisioning::{LogicalNodeId, NodeAttemptId};

    fn ha(standbys: &[&str]) -> swactor_actors::HaStatus {
        swactor_actors::HaStatus {
            leader: "ctl-a (pid 4242)".to_owned(),
            leading_since_wall_ms: 1_700_000_000_000,
            standbys: standbys.iter().map(|s| (*s).to_owned()).collect(),
            lease_ttl_ms: 10_000,
            margin_ms: 2_000,
            renewed_ms_ago: 1_234,
            etcd: "http://127.0.0.1:2379".to_owned(),
            terms: 1,
            ..Default::default()
        }
    }

    #[test]
    fn the_leader_line_names_the_leader_its_lease_and_who_takes_over() {
        let since = clock_at(1_700_000_000_000);
        let five_min_later = 1_700_000_000_000 + 5 * 60_000 + 400;
        assert_eq!(
            leader_line(&ha(&["ctl-b (pid 77)"]), five_min_later),
            format!(
                "leader: ctl-a (pid 4242) since {since} (5 min ago) · lease 10 s, renewed 1.2 s \
                 ago · standbys: 1 (ctl-b (pid 77))"
            )
        );
        assert_eq!(
            leader_line(&ha(&["ctl-b (pid 77)", "ctl-c (pid 9)"]), five_min_later),
            format!(
                "leader: ctl-a (pid 4242) since {since} (5 min ago) · lease 10 s, renewed 1.2 s \
                 ago · standbys: 2 (ctl-b (pid 77), ctl-c (pid 9))"
            )
        );
    }

    #[test]
    fn the_leader_line_says_when_nothing_takes_over_or_the_leader_stopped_acting() {
        let alone = leader_line(&ha(&[]), 1_700_000_000_300);
        assert!(
            alone.contains("(just now) · lease 10 s, renewed 1.2 s ago · "),
            "{alone}"
        );
        assert!(
            alone.ends_with(
                " · standbys: none — nothing takes over if the leader's machine is lost"
            ),
            "{alone}"
        );
        let mut late = ha(&["ctl-b (pid 77)"]);
        late.renewed_ms_ago = 8_000;
        let said = leader_line(&late, 1_700_000_060_000);
        assert!(
            said.contains(
                "renewed 8 s ago (past lease − margin, 8 s: it acts on nothing until a renewal \
                 is answered) · standbys: 1"
            ),
            "{said}"
        );
        late.renewed_ms_ago = 7_999;
        assert!(!leader_line(&late, 1_700_000_060_000).contains("past lease"));
        // A leader whose start is unknown is named without it.
        late.leading_since_wall_ms = 0;
        assert!(leader_line(&late, 1).starts_with("leader: ctl-a (pid 4242) · lease 10 s"));
        // Names from etcd are cut like any id a message repeats.
        late.leader = "x".repeat(500);
        assert!(leader_line(&late, 1).contains("(500 characters)"));
    }

    #[test]
    fn the_budget_line_says_what_is_spent_how_fast_and_when_it_ends() {
        use swactor_provisioning::budget::{Budget, OnBudget, Spend};
        let b = Budget::of_usd(50.0, OnBudget::Down).unwrap();
        let s = Spend {
            spent_micros: 12_345_678,
            usd_per_hour_micros: 1_210_000,
        };
        assert_eq!(
            budget_line(Some(&b), Some(&s)).unwrap(),
            "budget: 12.346 of 50.000 $ spent · 1.210 $/h now · reached in ~31 h, then the run \
             is torn down"
        );
        let p = Budget {
            on_reached: OnBudget::Pause,
            ..b
        };
        let over = Spend {
            spent_micros: 50_000_000,
            ..s
        };
        assert!(
            budget_line(Some(&p), Some(&over))
                .unwrap()
                .ends_with("· reached: the run is paused")
        );
        assert_eq!(budget_line(None, None), None);
        assert_eq!(budget_line(None, Some(&Spend::default())), None);
        assert!(
            budget_line(None, Some(&s))
                .unwrap()
                .starts_with("spent: 12.346 $")
        );
    }

    #[test]
    fn the_lifetime_line_says_when_the_run_ends_and_why() {
        use swactor_provisioning::lifetime::{Lifetime, Status, Verdict, Which};
        let l = Lifetime {
            max_lifetime_s: 7_200,
            idle_teardown_s: 1_800,
        };
        let at = |verdict, idle_ms| {
            lifetime_line(&Status {
                lifetime: l,
                verdict,
                idle_ms,
            })
        };
        let within = |left_ms, which| Verdict::Within { left_ms, which };
        assert_eq!(
            at(within(7_800_000, Which::MaxLifetime), None),
            "tears down in 2 h 10 min (max_lifetime_s)"
        );
        assert_eq!(
            at(within(7_199_001, Which::MaxLifetime), None),
            "tears down in 2 h (max_lifetime_s)"
        );
        assert_eq!(
            at(within(1_500_000, Which::IdleTeardown), Some(300_000)),
            "tears down in 25 min (idle_teardown_s: idle 5 min)"
        );
        assert_eq!(
            at(within(5_500, Which::MaxLifetime), None),
            "tears down in 6 s (max_lifetime_s)"
        );
        assert_eq!(
            at(Verdict::Unbounded, None),
            "no idle teardown while a job runs (idle_teardown_s: 30 min)"
        );
        assert_eq!(
            at(Verdict::Reached(Which::MaxLifetime), None),
            "tearing down: max_lifetime_s (2 h) reached"
        );
        assert_eq!(span_fine(3 * 86_400 + 4 * 3_600 + 5, false), "3 d 4 h");
        assert_eq!(span_fine(3 * 86_400 + 5, true), "3 d 1 h");
        assert_eq!(span_fine(119, true), "119 s");
    }

    #[test]
    fn foreign_resources_are_named_priced_and_cut_after_five() {
        let r = |i: u64, d: Option<&str>, dph: Option<u64>| swactor_providers::ForeignResource {
            provider: "vast".to_owned(),
            resource: format!("instance {i}"),
            deployment: d.map(str::to_owned),
            key: format!("w-{i}/a{i}"),
            usd_per_hour_micros: dph,
        };
        assert_eq!(
            foreign_resource(&r(7, Some("0a1b2c3d"), Some(420_000))),
            "vast instance 7 (w-7/a7, deployment 0a1b2c3d, 0.420 $/h)"
        );
        assert_eq!(
            foreign_resource(&r(8, None, None)),
            "vast instance 8 (w-8/a8, made before deployments were recorded)"
        );
        let many: Vec<_> = (0..7)
            .map(|i| r(i, Some("0a1b2c3d"), Some(100_000)))
            .collect();
        let said = foreign_resources(&swactor_provisioning::RunId::new("gpu"), &many);
        assert!(
            said.starts_with(
                "run gpu also has 7 resource(s) that another deployment made, 0.700 $/h together: "
            ) && said.contains("instance 4 ")
                && !said.contains("instance 5 ")
                && said.contains("and 2 more")
                && said.contains("never adopts, replaces or destroys them"),
            "{said}"
        );
    }

    #[test]
    fn an_orphaned_node_is_said_to_end_itself_after_its_groups_lease() {
        let mut n = node(NodeStage::Dormant);
        n.agent = AgentLink::Connected;
        assert_eq!(
            orphan_words(&n),
            "renewed while connected · ends itself 60 min after its daemon stops renewing its lease"
        );
        n.lease_renewed_ms_ago = Some(2_400);
        assert_eq!(
            orphan_words(&n),
            "renewed 2 s ago · ends itself 60 min after its daemon stops renewing its lease"
        );
        n.agent = AgentLink::Away {
            grace_until: Timestamp::from_millis(9_000),
        };
        n.lease_renewed_ms_ago = Some(40_000);
        assert_eq!(lease_words(&n), "last renewed 40 s ago (its agent is away)");
        n.orphan_after_s = 5;
        n.agent = AgentLink::NotJoined;
        assert_eq!(
            orphan_words(&n),
            "given when its agent joins · ends itself 5 s after its daemon stops renewing its lease"
        );
        n.orphan_after_s = 0;
        assert_eq!(orphan_words(&n), "never ends itself (orphan_after_s = 0)");
    }

    fn node(stage: NodeStage) -> NodeSummary {
        NodeSummary {
            node: LogicalNodeId::parse("worker-1").unwrap(),
            attempt: NodeAttemptId(3),
            stage,
            intent: Intent::Active,
            ready: false,
            pending: None,
            failures: 0,
            last_error: None,
            last_cause: None,
            next_retry_at: None,
            agent: AgentLink::NotJoined,
            lease: None,
            resource: None,
            next: NextStep::Nothing,
            orphan_after_s: 3_600,
            lease_renewed_ms_ago: None,
        }
    }

    fn at(ms: u64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    #[test]
    fn a_ready_node_is_ready_whatever_its_ladder_stage_is_called() {
        let mut n = node(NodeStage::Dormant);
        n.ready = true;
        n.agent = AgentLink::Connected;
        assert_eq!(state_word(&n), "ready");
        assert_eq!(state_text(&n, at(0)), "ready");
        assert_eq!(retry_cell(&n, at(0)), "-");
    }

    #[test]
    fn every_stage_has_a_word_of_the_vocabulary() {
        for (stage, word) in [
            (NodeStage::New, "creating"),
            (NodeStage::LeaseRequested, "creating"),
            (NodeStage::EndpointKnown, "booting"),
            (NodeStage::BootstrapRunning, "booting"),
            (NodeStage::SwactorJoined, "joining"),
            (NodeStage::Dormant, "joining"),
            (NodeStage::Failed, "failed"),
            (NodeStage::Destroyed, "restarting"),
        ] {
            assert_eq!(state_word(&node(stage)), word, "{stage:?}");
        }
        let mut leaving = node(NodeStage::Dormant);
        leaving.intent = Intent::Deleting;
        assert_eq!(state_word(&leaving), "deleting");
        leaving.stage = NodeStage::Destroyed;
        leaving.next_retry_at = Some(at(5_000));
        leaving.next = NextStep::Leaving;
        assert_eq!(state_word(&leaving), "deleted");
        assert_eq!(
            retry_cell(&leaving, at(0)),
            "-",
            "a deleted node is not retried"
        );
        // A failed attempt being cleaned up, then waiting for the next one.
        let mut failed = node(NodeStage::Failed);
        failed.intent = Intent::Deleting;
        failed.failures = 1;
        assert_eq!(state_text(&failed, at(0)), "failed");
        failed.stage = NodeStage::Destroyed;
        failed.next_retry_at = Some(at(2_000));
        failed.next = NextStep::RetryAt(at(2_000));
        assert_eq!(state_text(&failed, at(0)), "failed, retrying in 2 s");
        // The same wait held by a pause: no time is promised.
        failed.next = NextStep::Held(swactor_provisioning::HeldBy::Paused);
        assert_eq!(state_text(&failed, at(0)), "failed, held: paused");
        assert_eq!(retry_cell(&failed, at(0)), "held: paused");
    }

    #[test]
    fn waits_are_relative_to_the_clusters_clock() {
        let mut n = node(NodeStage::Failed);
        n.next_retry_at = Some(at(112_000));
        n.next = NextStep::RetryAt(at(112_000));
        assert_eq!(state_text(&n, at(100_000)), "failed, retrying in 12 s");
        assert_eq!(retry_cell(&n, at(100_000)), "in 12 s");
        assert_eq!(retry_cell(&n, at(113_000)), "now");
        let mut down = node(NodeStage::Destroyed);
        down.next_retry_at = Some(at(100_200));
        down.next = NextStep::RetryAt(at(100_200));
        assert_eq!(state_text(&down, at(100_000)), "restarting in 1 s");
        let mut away = node(NodeStage::Dormant);
        away.ready = true;
        away.agent = AgentLink::Away {
            grace_until: at(104_000),
        };
        away.next = NextStep::LostAt {
            at: at(104_000),
            replaced: true,
        };
        assert_eq!(
            state_text(&away, at(100_000)),
            "disconnected (grace for 4 s more)"
        );
        away.next = NextStep::LostAt {
            at: at(104_000),
            replaced: false,
        };
        assert_eq!(
            state_text(&away, at(100_000)),
            "disconnected (grace for 4 s more; not replaced while paused)"
        );
        assert_eq!(ago(at(0), at(180_000)), "3 min ago");
        assert_eq!(ago(at(0), at(500)), "just now");
        assert!(!state_text(&n, at(100_000)).contains("t+"));
    }

    #[test]
    fn outcomes_are_told_in_plain_words() {
        assert_eq!(
            outcome_words("Definite failure: no room"),
            "failed: no room"
        );
        assert_eq!(outcome_words("lease destroyed"), "machine released");
        assert_eq!(
            outcome_words("lease nodes/r/w-0-a1"),
            "leased nodes/r/w-0-a1"
        );
        assert_eq!(outcome_words("something new"), "something new");
    }

    #[test]
    fn a_long_list_of_names_is_bounded() {
        let many: Vec<u32> = (0..100_000).collect();
        let text = names(&many);
        assert!(text.starts_with("0, 1, 2,") && text.ends_with(", 19, … and 99980 more"));
        assert_eq!(names(&["a", "b"]), "a, b");
    }

    #[test]
    fn a_long_id_is_cut_and_a_valid_one_never_is() {
        let long = "a".repeat(5_000);
        assert_eq!(cut(&long), format!("{}… (5000 characters)", "a".repeat(40)));
        let longest_valid = format!("{}-4294967295", "a".repeat(63));
        assert_eq!(cut(&longest_valid), longest_valid);
        let text = format!("node {long} is unknown");
        let shown = cut_long_words(&text);
        assert!(shown.len() < 100, "{shown}");
        assert!(shown.ends_with("(5000 characters) is unknown"), "{shown}");
        assert_eq!(cut_long_words("a b  c\nd"), "a b  c\nd");
    }

    /// Issue 28, Why 6: `status --json` had no word for the cluster's state.
    #[test]
    fn the_cluster_is_said_in_one_word_that_a_teardown_and_a_pause_win() {
        let mut s = ClusterSnapshot {
            generation: swactor_provisioning::Generation(1),
            ..ClusterSnapshot::empty("r")
        };
        assert!(!s.inventory_read);
        assert_eq!(cluster_state(&s), "converging");
        s.converged = true;
        assert_eq!(cluster_state(&s), "converged");
        s.paused = true;
        assert_eq!(cluster_state(&s), "paused");
        s.shutting_down = Some(ShutdownMode::Keep);
        assert_eq!(cluster_state(&s), "stopping");
        s.shutting_down = Some(ShutdownMode::Teardown);
        assert_eq!(cluster_state(&s), "tearing down");
        // A status from an older daemon still reads.
        let old: ClusterSnapshot = serde_json::from_value(serde_json::json!({
            "run_id": "r", "generation": 1, "observed_generation": null,
            "converged": false, "adopted": true, "desired_nodes": 0, "nodes": [],
            "stats": serde_json::to_value(swactor_provisioning::DriverStats::default()).unwrap(),
            "now": 0
        }))
        .unwrap();
        assert!(old.inventory_read);
    }

    #[test]
    fn sizes_read_in_bytes_below_a_kilobyte_and_in_decimal_units_above() {
        assert_eq!(size_words(0), "0 bytes");
        assert_eq!(size_words(1), "1 byte");
        assert_eq!(size_words(6), "6 bytes");
        assert_eq!(size_words(999), "999 bytes");
        assert_eq!(size_words(1000), "1.0 kB");
        assert_eq!(size_words(1234), "1.2 kB");
        assert_eq!(size_words(999_949), "999.9 kB");
        assert_eq!(size_words(999_960), "1.0 MB");
        assert_eq!(size_words(3_400_000), "3.4 MB");
        assert_eq!(size_words(52_428_800), "52.4 MB");
        assert_eq!(size_words(5_000_000_000), "5.0 GB");
        assert_eq!(size_words(u64::MAX), "18.4 EB");
        assert_eq!(sizes_compared(6, 1000), ("6 bytes".into(), "1.0 kB".into()));
        assert_eq!(
            sizes_compared(1_000_001, 1_000_000),
            (
                "1.0 MB (1000001 bytes)".into(),
                "1.0 MB (1000000 bytes)".into()
            )
        );
    }
}
