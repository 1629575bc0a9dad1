//! `swactor replay` and `swactor explain`: a daemon's flight recordings
//! played back over a fresh host, to check it decides as recorded and to
//! tell why a node went the way it did.
//!
//! A recording (`swactor_provisioning::flight`) holds what the daemon's
//! cluster host was built from and every input it was handed, each with a
//! digest of the host's answer. Playing it back needs no daemon, no
//! provider and no network: the host is pure, so the same inputs make the
//! same decisions, and a digest that differs points at the first input a
//! build decides otherwise.
//!
//! `explain` replays the same way and asks the ladder, after every input,
//! what it would do for one node (as the driver's next pass would): each
//! time that answer changes it prints the row, the facts that chose it and
//! the input that brought it about.

use anyhow::{Context, Result, bail};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, Instant};
use swactor_provisioning::flight::{
    FlightError, FlightHeader, FlightInput, Frame, Recording, ReplayError, Replayer, replay,
};
use swactor_provisioning::{
    DeleteReason, Driver, GroupId, Host, Intent, LadderRow, Link, LogicalNodeId, NodeAction,
    NodeDecision, NodeStage, Reconciler, RolloutGates, Timestamp, reconcile_node_gated,
    reconcile_node_paused, same_template,
};

use crate::state::StateDir;
use crate::words::{cut, cut_long_words, effect_words, next_words, stage_word};

/// `replay`'s exit code when a recording was answered otherwise than
/// recorded (1 stays "could not be read or replayed").
pub(crate) const EXIT_DIVERGED: i32 = 4;

/// How often a long replay says on stderr how far it got.
const PROGRESS_EVERY: Duration = Duration::from_secs(2);

/// Inputs between two looks at the clock for progress.
const PROGRESS_STRIDE: u64 = 4_096;

/// The directory of the state directory the daemon writes its recordings to.
const FLIGHT_DIR: &str = "flight";

/// A recording's file name ends with this.
const FLIGHT_EXT: &str = "flight";

/// The driver core a recording's host was built around, built as the
/// daemon builds it.
fn core_for(header: &FlightHeader) -> Result<Driver, String> {
    Driver::new(header.run_id.clone(), header.reconciler.clone()).map_err(|e| e.to_string())
}

// ----- replay -----

/// How one recording's replay went.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Every input was answered as recorded.
    AsRecorded {
        /// Inputs replayed.
        inputs: u64,
        /// The recording ended at a cut marker.
        cut: bool,
    },
    /// An input was answered otherwise than recorded.
    Diverged {
        /// Its index.
        index: u64,
    },
    /// It could not be read or replayed, and why.
    Unreadable(String),
}

impl Verdict {
    fn code(&self) -> i32 {
        match self {
            Self::AsRecorded { .. } => 0,
            Self::Unreadable(_) => 1,
            Self::Diverged { .. } => EXIT_DIVERGED,
        }
    }
}

/// `swactor replay FILE...`: replays each recording and says how it went;
/// returns the exit code (the worst of the files': a divergence over an
/// unreadable file over success).
pub(crate) fn replay_files(files: &[PathBuf]) -> Result<i32> {
    let mut out = crate::term::Stdout;
    let mut worst = 0;
    for file in files {
        let name = file.display().to_string();
        let verdict = match std::fs::read(file) {
            Ok(bytes) => replay_bytes(&name, &bytes, &mut out, &mut Ticker::stderr())?,
            Err(e) => Verdict::Unreadable(format!("cannot be read: {e}")),
        };
        if let Verdict::Unreadable(why) = &verdict {
            eprintln!("swactor: {name}: {}", cut_long_words(why));
        }
        worst = worse(worst, verdict.code());
    }
    Ok(worst)
}

/// The worse of two exit codes: a divergence, then an error, then success.
fn worse(a: i32, b: i32) -> i32 {
    let rank = |c: i32| match c {
        0 => 0,
        EXIT_DIVERGED => 2,
        _ => 1,
    };
    if rank(b) > rank(a) { b } else { a }
}

/// Replays one recording, `name` its file, writing what it is and how it
/// went to `out`; a recording that cannot be read says why in its verdict.
///
/// # Errors
/// Only writing to `out`.
pub(crate) fn replay_bytes(
    name: &str,
    bytes: &[u8],
    out: &mut dyn Write,
    ticker: &mut Ticker,
) -> Result<Verdict> {
    let recording = match Recording::read(bytes) {
        Ok(r) => r,
        Err(e) => return Ok(Verdict::Unreadable(e.to_string())),
    };
    let count = Count::of(&recording);
    writeln!(out, "{name}")?;
    writeln!(out, "  {}", about(&recording.header, &count))?;
    let result = replay(bytes, core_for, |frame, _| {
        ticker.tick(name, frame.index + 1, count.inputs);
    });
    Ok(match result {
        Ok(done) => {
            writeln!(
                out,
                "  {} replayed, every answer as recorded",
                inputs(done.inputs)
            )?;
            if done.cut {
                writeln!(
                    out,
                    "  the recording was cut after them: the daemon dropped what came later \
                     (its recorder fell behind or reached its limit), so the rest is unchecked"
                )?;
            }
            if done.torn {
                writeln!(
                    out,
                    "  after them, a frame half written: the recording is still being written, \
                     or its daemon stopped mid-write or ran out of disk"
                )?;
            }
            Verdict::AsRecorded {
                inputs: done.inputs,
                cut: done.cut,
            }
        }
        Err(ReplayError::Diverged(d)) => {
            say_divergence(
                out,
                &d,
                "inputs before it were answered as recorded; this build decides otherwise from \
                 there",
            )?;
            Verdict::Diverged { index: d.index }
        }
        Err(e @ (ReplayError::Read(_) | ReplayError::Host(_))) => {
            Verdict::Unreadable(e.to_string())
        }
    })
}

/// Says where a replay first answered otherwise than recorded, what the
/// replay answered, and (in brackets) what that means for the rest.
fn say_divergence(
    out: &mut dyn Write,
    d: &swactor_provisioning::flight::Divergence,
    then: &str,
) -> std::io::Result<()> {
    writeln!(
        out,
        "  DIVERGED at input {}: {}",
        d.index,
        cut_long_words(&d.input)
    )?;
    writeln!(out, "  the recording kept: {}", cut_long_words(&d.recorded))?;
    writeln!(
        out,
        "  the replay answered: {}",
        cut_long_words(&d.replayed)
    )?;
    writeln!(out, "  ({then})")
}

/// Says on stderr why `name` is not read.
fn refuse(name: &str, e: &FlightError) {
    eprintln!("swactor: {name}: {}", cut_long_words(&e.to_string()));
}

/// What a recording holds, counted before it is replayed.
struct Count {
    inputs: u64,
    cut: bool,
    /// A frame that cannot be read stops the count (the replay says why).
    damaged: bool,
}

impl Count {
    fn of(recording: &Recording<'_>) -> Self {
        let mut frames = recording.frames();
        let mut inputs = 0;
        let mut damaged = false;
        for frame in frames.by_ref() {
            if frame.is_err() {
                damaged = true;
                break;
            }
            inputs += 1;
        }
        Self {
            inputs,
            cut: frames.was_cut(),
            damaged,
        }
    }
}

/// `build …, run …, started …, N inputs`: what a recording is.
fn about(header: &FlightHeader, count: &Count) -> String {
    let mut s = format!(
        "build {}, run {}, started {}, {}",
        cut_long_words(&header.build),
        cut(&header.run_id.to_string()),
        utc_datetime(header.wall_ms),
        inputs(count.inputs),
    );
    if count.cut {
        s.push_str(" (cut there)");
    }
    if count.damaged {
        s.push_str(" before a damaged frame");
    }
    s
}

fn inputs(n: u64) -> String {
    if n == 1 {
        "1 input".to_owned()
    } else {
        format!("{n} inputs")
    }
}

/// Progress of a long replay, on stderr at most every [`PROGRESS_EVERY`].
pub(crate) struct Ticker {
    every: Option<Duration>,
    last: Instant,
}

impl Ticker {
    /// Progress lines on stderr.
    pub(crate) fn stderr() -> Self {
        Self {
            every: Some(PROGRESS_EVERY),
            last: Instant::now(),
        }
    }

    /// No progress lines.
    #[cfg(test)]
    fn off() -> Self {
        Self {
            every: None,
            last: Instant::now(),
        }
    }

    fn tick(&mut self, name: &str, done: u64, total: u64) {
        let Some(every) = self.every else { return };
        if !done.is_multiple_of(PROGRESS_STRIDE) || self.last.elapsed() < every {
            return;
        }
        self.last = Instant::now();
        eprintln!("swactor: {name}: {done} of {total} inputs replayed");
    }
}

// ----- times -----

fn utc(ms: u64) -> Option<chrono::DateTime<chrono::Utc>> {
    chrono::DateTime::from_timestamp_millis(i64::try_from(ms).ok()?)
}

/// `2026-12-01 10:20:30 UTC`.
fn utc_datetime(ms: u64) -> String {
    utc(ms).map_or_else(
        || format!("{ms} ms after the epoch"),
        |t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string(),
    )
}

/// `10:20:30.123`, in UTC.
fn utc_time(ms: u64) -> String {
    utc(ms).map_or_else(
        || format!("{ms} ms"),
        |t| t.format("%H:%M:%S%.3f").to_string(),
    )
}

/// Where `explain --at` stops, as given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum At {
    /// A wall-clock instant (ms since the Unix epoch).
    Wall(u64),
    /// A time of day in UTC (ms since midnight) on the first recording's day.
    TimeOfDay(u64),
    /// This long after the first recording started.
    FromStart(u64),
}

impl At {
    /// Reads an RFC 3339 time, `HH:MM:SS[.fff]` (UTC) or `+SECS`.
    ///
    /// # Errors
    /// Anything else.
    pub(crate) fn parse(s: &str) -> Result<Self> {
        const HELP: &str = "an RFC 3339 time (2026-12-01T10:20:30Z), a time of day in UTC \
             (10:20:30) or seconds after the recording started (+90)";
        if let Some(secs) = s.strip_prefix('+') {
            let secs: f64 = secs
                .parse()
                .ok()
                .filter(|s: &f64| s.is_finite() && *s >= 0.0)
                .with_context(|| format!("--at {}: not {HELP}", cut(s)))?;
            return Ok(Self::FromStart((secs * 1_000.0) as u64));
        }
        if let Ok(t) = chrono::DateTime::parse_from_rfc3339(s) {
            let ms = u64::try_from(t.timestamp_millis())
                .with_context(|| format!("--at {}: before 1970", cut(s)))?;
            return Ok(Self::Wall(ms));
        }
        if let Ok(t) = chrono::NaiveTime::parse_from_str(s, "%H:%M:%S%.f") {
            use chrono::Timelike;
            let ms = u64::from(t.num_seconds_from_midnight()) * 1_000
                + u64::from(t.nanosecond() / 1_000_000);
            return Ok(Self::TimeOfDay(ms));
        }
        bail!("--at {}: not {HELP}", cut(s))
    }

    /// The wall-clock instant it names, for recordings the first of which
    /// started at `start_ms`.
    fn resolve(self, start_ms: u64) -> u64 {
        const DAY_MS: u64 = 86_400_000;
        match self {
            Self::Wall(ms) => ms,
            Self::TimeOfDay(ms) => start_ms - start_ms % DAY_MS + ms,
            Self::FromStart(ms) => start_ms.saturating_add(ms),
        }
    }
}

// ----- explain -----

/// What `swactor explain` is asked.
pub(crate) struct ExplainOptions {
    /// The node, e.g. `w-1`.
    pub(crate) node: String,
    /// Stop there.
    pub(crate) at: Option<String>,
    /// Recordings to read instead of the state directory's.
    pub(crate) recordings: Vec<PathBuf>,
}

/// `swactor explain NODE`: returns the exit code.
///
/// # Errors
/// A bad node id or `--at`, no recordings, none readable, or writing.
pub(crate) fn explain(state_dir: &Path, opts: &ExplainOptions) -> Result<i32> {
    let node = LogicalNodeId::parse(&opts.node).with_context(|| {
        format!(
            "{} is not a node id (a group id, a dash and an index, e.g. worker-0)",
            cut(&opts.node)
        )
    })?;
    let at = opts.at.as_deref().map(At::parse).transpose()?;
    let files = if opts.recordings.is_empty() {
        let state = StateDir::open(state_dir.to_path_buf())?;
        recordings_in(&state.root().join(FLIGHT_DIR))?
    } else {
        opts.recordings.clone()
    };
    let mut lives = Vec::new();
    for file in files {
        let bytes =
            std::fs::read(&file).with_context(|| format!("cannot read {}", file.display()))?;
        lives.push((file.display().to_string(), bytes));
    }
    explain_lives(
        &node,
        at,
        lives,
        &mut crate::term::Stdout,
        &mut Ticker::stderr(),
    )
}

/// The `*.flight` files of `dir`.
fn recordings_in(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            bail!(
                "no flight recordings: {} does not exist (a daemon writes one there each time \
                 it starts; or name one with --recording)",
                dir.display()
            )
        }
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", dir.display())),
    };
    let mut files = Vec::new();
    for entry in entries {
        let path = entry
            .with_context(|| format!("cannot read {}", dir.display()))?
            .path();
        if path.extension().is_some_and(|e| e == FLIGHT_EXT) && path.is_file() {
            files.push(path);
        }
    }
    if files.is_empty() {
        bail!("no flight recordings in {}", dir.display());
    }
    Ok(files)
}

/// Explains `node` over the recordings `lives` (name and bytes each), in
/// the order they were started; returns the exit code.
fn explain_lives(
    node: &LogicalNodeId,
    at: Option<At>,
    lives: Vec<(String, Vec<u8>)>,
    out: &mut dyn Write,
    ticker: &mut Ticker,
) -> Result<i32> {
    // One daemon life after another, by when each started. One that cannot
    // be read is said and left out, and the exit code says so.
    let mut code = 0;
    let mut readable = Vec::new();
    for (name, bytes) in &lives {
        match Recording::read(bytes) {
            Ok(r) => readable.push((r.header.wall_ms, name.as_str(), bytes.as_slice())),
            Err(e) => {
                refuse(name, &e);
                code = 1;
            }
        }
    }
    if readable.is_empty() {
        bail!("none of the recordings can be read");
    }
    readable.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
    let start = readable[0].0;
    let cutoff = at.map(|a| a.resolve(start));
    if let Some(c) = cutoff.filter(|c| *c < start) {
        bail!(
            "--at names {}, before the first recording began ({})",
            utc_datetime(c),
            utc_datetime(start)
        );
    }
    let mut ex = Explainer {
        node: *node,
        cutoff,
        known: Known::default(),
        lines: 0,
    };
    let count = readable.len();
    for (i, (_, name, bytes)) in readable.into_iter().enumerate() {
        writeln!(out, "life {} of {count}: {name}", i + 1)?;
        match ex.life(name, bytes, out, ticker)? {
            LifeEnd::Done => {}
            LifeEnd::Stopped(at) => {
                writeln!(out, "stopped at {} (--at)", utc_time(at))?;
                break;
            }
            LifeEnd::Diverged => {
                code = EXIT_DIVERGED;
                break;
            }
            LifeEnd::Unreadable => code = 1,
        }
    }
    if ex.lines == 0 && code != EXIT_DIVERGED {
        if ex.known.contains(node) {
            match cutoff {
                Some(c) => bail!(
                    "the ladder decided nothing for {node} before {}",
                    utc_time(c)
                ),
                None => bail!("the ladder decided nothing for {node} in these recordings"),
            }
        }
        bail!(
            "the recordings know no node {node}; they know {}",
            ex.known.describe()
        );
    }
    Ok(code)
}

/// How one life's explanation ended.
enum LifeEnd {
    /// Its recording ended.
    Done,
    /// `--at` was reached at this wall-clock instant.
    Stopped(u64),
    /// The replay decided otherwise than recorded (said).
    Diverged,
    /// A frame or the host could not be read (said).
    Unreadable,
}

/// What a decision line is printed on a change of.
type Key = Option<(
    Option<swactor_provisioning::NodeAttemptId>,
    LadderRow,
    Option<NodeAction>,
)>;

struct Explainer {
    node: LogicalNodeId,
    cutoff: Option<u64>,
    known: Known,
    lines: u64,
}

impl Explainer {
    fn life(
        &mut self,
        name: &str,
        bytes: &[u8],
        out: &mut dyn Write,
        ticker: &mut Ticker,
    ) -> Result<LifeEnd> {
        let recording = Recording::read(bytes)?;
        let header = &recording.header;
        let count = Count::of(&recording);
        writeln!(out, "  {}", about(header, &count))?;
        let core = match core_for(header) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("swactor: {name}: the recorded host cannot be built again: {e}");
                return Ok(LifeEnd::Unreadable);
            }
        };
        let mut replayer = match Replayer::new(header, core) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("swactor: {name}: the recorded host cannot be built again: {e}");
                return Ok(LifeEnd::Unreadable);
            }
        };
        self.known.desired(replayer.host());
        let mut now = header.now;
        let mut shown: Key = None;
        // When the decision shown waits on a deadline, that deadline.
        let mut waiting: Option<Timestamp> = None;
        // Whether the decision shown is an action.
        let mut acting = false;
        let mut causes = Causes::default();
        for frame in recording.frames() {
            let frame = match frame {
                Ok(f) => f,
                Err(e) => {
                    refuse(name, &e);
                    return Ok(LifeEnd::Unreadable);
                }
            };
            if let Some(t) = frame.input.now() {
                now = t;
            }
            if let Some(cutoff) = self.cutoff
                && header.wall_at(now) > cutoff
            {
                return Ok(LifeEnd::Stopped(cutoff));
            }
            if let Err(d) = replayer.step(&frame.input, frame.answer) {
                say_divergence(
                    out,
                    &d,
                    "this build decides otherwise from there: what follows is unknown",
                )?;
                return Ok(LifeEnd::Diverged);
            }
            ticker.tick(name, frame.index + 1, count.inputs);
            let host = replayer.host();
            self.known.input(&frame.input);
            if matches!(
                frame.input,
                FlightInput::Apply { .. } | FlightInput::ApplyNext { .. }
            ) {
                self.known.desired(host);
            }
            let frame = Rc::new(frame);
            causes.note(&frame, &self.node);
            let decision = decide(host, &self.node, now);
            let attempt = host.core().state().nodes.get(&self.node).map(|n| n.attempt);
            let waited = std::mem::replace(&mut waiting, decision.as_ref().and_then(|d| d.wake_at));
            let key: Key = decision
                .as_ref()
                .map(|d| (attempt, d.row, d.action.clone()));
            if key == shown {
                continue;
            }
            shown = key;
            let acted = std::mem::replace(
                &mut acting,
                decision.as_ref().is_some_and(|d| d.action.is_some()),
            );
            self.lines += 1;
            let wall = header.wall_at(now);
            match &decision {
                Some(d) => {
                    writeln!(
                        out,
                        "{}  #{}  {}: {}",
                        utc_time(wall),
                        frame.index,
                        d.row,
                        action_words(d, header)
                    )?;
                    for line in facts(host, &self.node, now, header) {
                        writeln!(out, "    {line}")?;
                    }
                }
                None => writeln!(
                    out,
                    "{}  #{}  gone: no longer in the cluster nor desired",
                    utc_time(wall),
                    frame.index
                )?,
            }
            if let Some(cause) = causes.take(&frame, acted, waited, now, header) {
                writeln!(out, "    because: {cause}")?;
            }
        }
        self.known.desired(replayer.host());
        Ok(LifeEnd::Done)
    }
}

/// What the ladder decides for `id` at `now` on `host` as it is: what the
/// driver's next pass does for it, decided as the driver decides it.
fn decide(host: &Host<Driver>, id: &LogicalNodeId, now: Timestamp) -> Option<NodeDecision> {
    let core = host.core();
    let state = core.state();
    let desired = core.desired();
    let slot = |id: &LogicalNodeId| {
        desired
            .group(&id.group)
            .filter(|_| core.desires(id))
            .map(|g| &g.template)
    };
    let template = slot(id);
    let Some(node) = state.nodes.get(id) else {
        // A desired slot with no node is inserted (not while paused).
        return template.map(|t| NodeDecision {
            row: LadderRow::InsertSlot,
            action: (!core.is_paused()).then(|| NodeAction::Insert {
                template: t.clone(),
            }),
            wake_at: None,
        });
    };
    if core.is_paused() {
        return Some(reconcile_node_paused(node, template, now));
    }
    let mut gates = RolloutGates::new(state, desired).with_tripped(core.tripped());
    let outdated_ready =
        node.is_ready() && template.is_some_and(|t| !same_template(t, &node.template));
    if outdated_ready {
        // A pass spends its group's rollout budget in slot order: the
        // group's earlier ready nodes are offered first.
        for (other_id, other) in state.nodes.group(&id.group) {
            if other_id == id {
                break;
            }
            if other.is_ready() {
                let _ = reconcile_node_gated(other_id, other, slot(other_id), now, &mut gates);
            }
        }
    }
    Some(reconcile_node_gated(id, node, template, now, &mut gates))
}

/// What a decision does, for people.
fn action_words(d: &NodeDecision, header: &FlightHeader) -> String {
    let Some(action) = &d.action else {
        return match d.wake_at {
            Some(at) => format!("wait until {}", utc_time(header.wall_at(at))),
            None => "wait".to_owned(),
        };
    };
    match action {
        NodeAction::Insert { .. } => "insert the slot with a first attempt".to_owned(),
        NodeAction::BeginDelete { reason } => format!(
            "begin deleting the attempt ({})",
            match reason {
                DeleteReason::Undesired => "its slot is no longer desired",
                DeleteReason::SpecDrift => "its slot wants another template",
                DeleteReason::Failed => "it failed",
            }
        ),
        NodeAction::MarkDestroyed => "mark it destroyed: nothing is left to clean".to_owned(),
        NodeAction::Restart { .. } => "restart the slot with a fresh attempt".to_owned(),
        NodeAction::Reap => "reap the slot".to_owned(),
        NodeAction::ObserveConvergence => "mark it ready".to_owned(),
        NodeAction::Dispatch(effect) => format!("dispatch {effect:?} ({})", effect_words(*effect)),
    }
}

/// The facts a decision was made on: the attempt, its stage and intent,
/// failures, errors, the pending operation, the agent's link and what comes
/// next.
fn facts(
    host: &Host<Driver>,
    id: &LogicalNodeId,
    now: Timestamp,
    header: &FlightHeader,
) -> Vec<String> {
    let Some(n) = host.core().state().nodes.get(id) else {
        return vec!["no attempt yet".to_owned()];
    };
    let time = |at: Timestamp| utc_time(header.wall_at(at));
    let rec = &n.record;
    let intent = match n.intent {
        Intent::Active => "active",
        Intent::Deleting => "deleting",
    };
    let pending = match &n.pending {
        Some(p) => format!("{} {:?} (due by {})", p.id, p.effect, time(p.deadline)),
        None => "none".to_owned(),
    };
    let agent = match host.link(id) {
        Some(Link::Connected(a)) if a == n.attempt => "connected".to_owned(),
        Some(Link::Away { attempt, until }) if attempt == n.attempt => {
            format!("away, its grace ends {}", time(until))
        }
        _ => "not joined to this daemon".to_owned(),
    };
    let next = host
        .next_step(id, now)
        .map(|s| next_words(s, now))
        .unwrap_or_else(|| "-".to_owned());
    let mut lines = vec![
        format!(
            "{}: stage {:?} ({}), {intent}; failures {}; pending {pending}",
            n.attempt,
            rec.stage,
            match (n.intent, rec.stage) {
                _ if n.is_ready() => "ready",
                (_, NodeStage::Destroyed) => "cleaned up",
                (_, NodeStage::Failed) => "failed",
                (Intent::Deleting, _) => "being cleaned up",
                (Intent::Active, stage) => stage_word(stage),
            },
            n.retry.consecutive_failures,
        ),
        format!("agent {agent}; next {next}"),
    ];
    if let Some(reason) = rec.failed_reason() {
        let when = rec.failed_at().map(|t| format!(" at {}", time(t)));
        lines.push(format!(
            "failed{}: {}",
            when.unwrap_or_default(),
            cut_long_words(reason)
        ));
    }
    if let Some(error) = rec.last_error() {
        let cause = rec
            .last_cause()
            .map(|c| format!(" ({c:?})"))
            .unwrap_or_default();
        lines.push(format!("last error{cause}: {}", cut_long_words(error)));
    }
    lines
}

/// The inputs a decision line may name as its cause.
#[derive(Default)]
///
/// Frames are kept, not their words: most are never named, and a long
/// replay should not format every one.
struct Causes<'b> {
    /// The latest input that is not a poll.
    any: Option<Rc<Frame<'b>>>,
    /// The latest that is neither a poll nor the daemon's own bookkeeping.
    telling: Option<Rc<Frame<'b>>>,
    /// The latest naming the node since the last line.
    own: Option<Rc<Frame<'b>>>,
}

/// What kind of input a frame is, for naming causes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// One of the host's own polls: it made a pass, it happened nothing.
    Poll,
    /// Handed in on the daemon's schedule, deciding nothing about a node by
    /// itself (a persist confirmed, a wall-clock reading, a spend).
    Bookkeeping,
    /// A timer fired: time passed.
    Timer,
    /// Something happened: a result, an observation, an apply, a join.
    Event,
}

impl Kind {
    fn of(input: &FlightInput<'_>) -> Self {
        match input {
            _ if input.is_poll() => Self::Poll,
            FlightInput::Persisted { .. }
            | FlightInput::WaitConverged { .. }
            | FlightInput::WaitAdopted { .. }
            | FlightInput::Spent { .. }
            | FlightInput::WallClock { .. }
            | FlightInput::Lifetime { .. } => Self::Bookkeeping,
            FlightInput::Timeout { .. } | FlightInput::Tick { .. } => Self::Timer,
            _ => Self::Event,
        }
    }
}

impl<'b> Causes<'b> {
    /// `#12 agent of run/w-1/a2 joined at 10:20:30.123`.
    fn text(frame: &Frame<'_>, header: &FlightHeader) -> String {
        let at = frame
            .input
            .now()
            .map(|t| format!(" at {}", utc_time(header.wall_at(t))))
            .unwrap_or_default();
        format!(
            "#{} {}{at}",
            frame.index,
            cut_long_words(&frame.input.describe())
        )
    }

    fn note(&mut self, frame: &Rc<Frame<'b>>, node: &LogicalNodeId) {
        let kind = Kind::of(&frame.input);
        if kind == Kind::Poll {
            return;
        }
        if frame.input.node() == Some(*node) {
            self.own = Some(frame.clone());
        }
        if kind != Kind::Bookkeeping {
            self.telling = Some(frame.clone());
        }
        self.any = Some(frame.clone());
    }

    /// The cause of a change seen right after `frame`, the node having
    /// waited until `waited` (if it did) and the decision shown before
    /// having been an action (`acted`): the frame itself when something
    /// happened; else the pass that did that action; else the end of the
    /// wait; else what came since the last line that names the node; else
    /// the timer that fired; else the latest input that tells anything.
    fn take(
        &mut self,
        frame: &Frame<'_>,
        acted: bool,
        waited: Option<Timestamp>,
        now: Timestamp,
        header: &FlightHeader,
    ) -> Option<String> {
        let own = self.own.take();
        let kind = Kind::of(&frame.input);
        if kind == Kind::Event {
            return Some(Self::text(frame, header));
        }
        if kind == Kind::Poll && acted {
            return Some(format!(
                "the pass at #{} carried out the decision above",
                frame.index
            ));
        }
        if let Some(w) = waited.filter(|w| *w <= now) {
            return Some(format!(
                "its wait until {} was over (#{} {})",
                utc_time(header.wall_at(w)),
                frame.index,
                frame.input.kind()
            ));
        }
        if let Some(own) = own {
            return Some(Self::text(&own, header));
        }
        if kind == Kind::Timer {
            return Some(Self::text(frame, header));
        }
        self.telling
            .as_ref()
            .or(self.any.as_ref())
            .map(|f| Self::text(f, header))
    }
}

/// The nodes the recordings know: every desired slot and every node an
/// input names.
#[derive(Default)]
struct Known {
    /// Per group: the most slots it was desired with, and the indices of
    /// nodes seen beyond them.
    groups: BTreeMap<GroupId, (u32, BTreeSet<u32>)>,
}

/// Nodes named one by one per group before the rest are left out.
const KNOWN_SHOWN: usize = 20;

impl Known {
    fn add(&mut self, id: &LogicalNodeId) {
        let (extent, others) = self.groups.entry(id.group).or_default();
        if id.index >= *extent {
            others.insert(id.index);
        }
    }

    fn input(&mut self, input: &FlightInput<'_>) {
        if let Some(id) = input.node() {
            self.add(&id);
        }
    }

    fn desired(&mut self, host: &Host<Driver>) {
        for g in &host.core().desired().groups {
            let (extent, others) = self.groups.entry(g.id).or_default();
            if g.count > *extent {
                *extent = g.count;
                others.retain(|i| *i >= g.count);
            }
        }
        for id in host.core().state().nodes.keys() {
            self.add(id);
        }
    }

    fn contains(&self, id: &LogicalNodeId) -> bool {
        self.groups
            .get(&id.group)
            .is_some_and(|(extent, others)| id.index < *extent || others.contains(&id.index))
    }

    /// `w-0 to w-3, w-7; gpu-0`, or `no node at all`.
    fn describe(&self) -> String {
        if self.groups.is_empty() {
            return "no node at all".to_owned();
        }
        self.groups
            .iter()
            .map(|(g, (extent, others))| {
                let mut names = Vec::new();
                match extent {
                    0 => {}
                    1 => names.push(format!("{g}-0")),
                    n => names.push(format!("{g}-0 to {g}-{}", n - 1)),
                }
                names.extend(others.iter().take(KNOWN_SHOWN).map(|i| format!("{g}-{i}")));
                if others.len() > KNOWN_SHOWN {
                    names.push(format!("and {} more", others.len() - KNOWN_SHOWN));
                }
                names.join(", ")
            })
            .collect::<Vec<_>>()
            .join("; ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use swactor_provisioning::flight::{CUT_MARKER, FLIGHT_FORMAT, Flight, FlightBatch, record};
    use swactor_provisioning::{
        BootParams, BootstrapEvent, BootstrapObservation, BootstrapStage, ClusterShape, EffectKind,
        EffectRequest, Generation, GroupShape, HostConfig, LeaseId, NodeEndpoint, NodeLimits,
        OperationOutcome, OperationResult, Output, ProviderShape, ReconcilerConfig, ResourceKey,
        RunId, SessionId, SwarmJoin, Ticket,
    };

    fn t(ms: u64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    /// 2026-12-01T10:00:00Z: the wall clock the recorded hosts start at.
    const WALL_MS: u64 = 1_796_119_200_000;

    fn shape(generation: u64, count: u32) -> ClusterShape {
        ClusterShape {
            run_id: RunId::new("run"),
            generation: Generation(generation),
            groups: vec![GroupShape {
                id: "w".to_owned(),
                run_id: None,
                count,
                provider: ProviderShape {
                    kind: "fake".to_owned(),
                    params: BTreeMap::new(),
                    placement: Default::default(),
                },
                boot: BootParams::default(),
                role: "worker".to_owned(),
                join: SwarmJoin::default(),
                limits: NodeLimits::default(),
                policy: Default::default(),
            }],
            capacity: None,
            budget: None,
            lifetime: Default::default(),
        }
    }

    fn node(s: &str) -> LogicalNodeId {
        LogicalNodeId::parse(s).unwrap()
    }

    /// A recorded host driven by hand as a daemon drives one, with a
    /// provider that does what it is asked and agents that join.
    struct Sim {
        flight: Flight<Driver>,
        header: Vec<u8>,
        frames: Vec<u8>,
    }

    impl Sim {
        fn new(wall_ms: u64) -> Self {
            let config = ReconcilerConfig {
                jitter_permille: 0,
                ..ReconcilerConfig::default()
            };
            let core = Driver::new(RunId::new("run"), config).unwrap();
            let (flight, header) = record(
                core,
                HostConfig::default(),
                None,
                "swactor test".to_owned(),
                wall_ms,
                t(0),
            )
            .unwrap();
            Self {
                flight,
                header,
                frames: Vec::new(),
            }
        }

        /// Applies `count` nodes and runs the host until they are ready.
        fn converged(count: u32) -> Self {
            let mut sim = Self::new(WALL_MS);
            sim.flight
                .handle_apply(&shape(1, count), Ticket(1), t(0))
                .unwrap();
            sim.pump(t(0));
            assert!(sim.flight.is_converged());
            sim
        }

        fn key(&self, id: &str) -> ResourceKey {
            ResourceKey {
                run_id: RunId::new("run"),
                node: node(id),
                attempt: self.flight.core().state().nodes[&node(id)].attempt,
            }
        }

        /// Drains the host at `now`: writes durable at once, an empty
        /// inventory, every dispatch answered with success, started agents
        /// joining and converging.
        fn pump(&mut self, now: Timestamp) {
            for _ in 0..64 {
                let mut round = Vec::new();
                while let Some(o) = self.flight.poll_output(now) {
                    match o {
                        Output::Persist(delta) => self.flight.handle_persisted(delta.seq),
                        Output::List => self.flight.handle_inventory(Ok(Vec::new()), now),
                        Output::Pass(pass) => round.extend(pass.dispatches),
                        Output::Collect(req) => {
                            self.flight.handle_collected(
                                &req.key,
                                Ok(swactor_provisioning::Release::Done),
                                now,
                            );
                        }
                        Output::Probe { .. }
                        | Output::Folded(_)
                        | Output::Reply(..)
                        | Output::Stop => {}
                    }
                }
                while self.flight.poll_event().is_some() {}
                if round.is_empty() {
                    return;
                }
                for d in &round {
                    let key = &d.key;
                    let outcome = match &d.request {
                        EffectRequest::CreateLease { .. } => OperationOutcome::LeaseCreated {
                            lease: LeaseId::from(format!("lease-{key}")),
                            endpoint: None,
                        },
                        EffectRequest::LookupEndpoint { .. } => OperationOutcome::EndpointFound {
                            endpoint: NodeEndpoint::from(format!("ep-{key}")),
                        },
                        EffectRequest::StartBootstrap { .. } => {
                            OperationOutcome::BootstrapStarted {
                                session: SessionId::from(format!("sess-{key}")),
                            }
                        }
                        EffectRequest::CancelBootstrap { .. } => {
                            OperationOutcome::BootstrapCancelled
                        }
                        EffectRequest::DestroyLease { .. } => OperationOutcome::LeaseDestroyed,
                    };
                    let result = OperationResult {
                        node: key.node,
                        op: d.op,
                        outcome,
                    };
                    let _ = self.flight.handle_result(result, now).unwrap();
                    if d.request.kind() == EffectKind::StartBootstrap {
                        self.flight.handle_agent_joined(key, now).unwrap();
                        let n = &self.flight.core().state().nodes[&key.node];
                        let obs = BootstrapObservation {
                            node: key.node,
                            attempt: n.attempt,
                            session: n.record.session.clone().unwrap(),
                            event: BootstrapEvent::Stage(BootstrapStage::Converged),
                        };
                        let _ = self.flight.handle_bootstrap(obs, now).unwrap();
                    }
                }
            }
        }

        /// Wakes the host as a daemon's timer would, up to `until`.
        fn listen(&mut self, until: Timestamp) {
            while let Some(at) = self.flight.poll_timeout().filter(|at| *at <= until) {
                self.flight.handle_timeout(at).unwrap();
                self.pump(at);
            }
        }

        /// The recording so far.
        fn bytes(&mut self) -> Vec<u8> {
            let taken = self.flight.take_frames(FlightBatch::default());
            taken.write_to(&mut self.frames);
            let mut all = self.header.clone();
            all.extend_from_slice(&self.frames);
            all
        }
    }

    /// A run of three nodes whose `w-1` agent went away and stayed away
    /// past its grace, so its attempt failed and was replaced.
    fn with_a_lost_agent() -> (Sim, ResourceKey) {
        let mut sim = Sim::converged(3);
        let lost = sim.key("w-1");
        sim.flight.handle_agent_gone(&lost, 0, t(1_000));
        sim.pump(t(1_000));
        sim.listen(t(120_000));
        assert!(sim.key("w-1").attempt > lost.attempt, "w-1 was replaced");
        assert!(sim.flight.is_converged());
        (sim, lost)
    }

    /// Where each frame's body is: (start, length), in order, until the
    /// end or a cut marker.
    fn frame_spans(bytes: &[u8]) -> Vec<(usize, usize)> {
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
        let mut at = 16 + u32_at(12) as usize;
        let mut spans = Vec::new();
        while at + 4 <= bytes.len() {
            let len = u32_at(at);
            if len == CUT_MARKER {
                break;
            }
            spans.push((at + 4, len as usize));
            at += 4 + len as usize;
        }
        spans
    }

    fn replayed(bytes: &[u8]) -> (Verdict, String) {
        let mut out = Vec::new();
        let verdict = replay_bytes("rec.flight", bytes, &mut out, &mut Ticker::off()).unwrap();
        (verdict, String::from_utf8(out).unwrap())
    }

    fn explained(
        node: &str,
        at: Option<&str>,
        lives: Vec<(String, Vec<u8>)>,
    ) -> Result<(i32, String)> {
        let mut out = Vec::new();
        let at = at.map(At::parse).transpose()?;
        let code = explain_lives(&self::node(node), at, lives, &mut out, &mut Ticker::off())?;
        Ok((code, String::from_utf8(out).unwrap()))
    }

    #[test]
    fn a_recording_replays_with_every_answer_as_recorded() {
        let (mut sim, _) = with_a_lost_agent();
        let bytes = sim.bytes();
        let frames = frame_spans(&bytes).len() as u64;
        assert!(frames > 50, "{frames} frames");
        let (verdict, out) = replayed(&bytes);
        assert_eq!(
            verdict,
            Verdict::AsRecorded {
                inputs: frames,
                cut: false
            },
            "{out}"
        );
        assert!(
            out.contains(&format!(
                "{frames} inputs replayed, every answer as recorded"
            )),
            "{out}"
        );
        assert!(out.contains("build swactor test, run run"), "{out}");
        assert!(out.contains("started 2026-12-01 10:00:00 UTC"), "{out}");
        assert!(out.contains(&format!(", {frames} inputs")), "{out}");
        assert!(!out.contains("cut"), "{out}");
    }

    #[test]
    fn a_tampered_answer_is_found_at_its_input() {
        let (mut sim, _) = with_a_lost_agent();
        let mut bytes = sim.bytes();
        let spans = frame_spans(&bytes);
        // The frame of the first operation result, well inside the run.
        let index = (0..spans.len())
            .find(|&i| {
                let rec = Recording::read(&bytes).unwrap();
                let frame = rec.frames().nth(i).unwrap().unwrap();
                matches!(frame.input, FlightInput::Result { .. })
            })
            .unwrap();
        assert!(index > 0);
        let (start, len) = spans[index];
        // Its answer, kept whole: `Answer::Folded(Folded::Applied)`. Made
        // `Answer::Digest(0)`, of the same length.
        assert_eq!(bytes[start + len - 2..start + len], [0, 0]);
        bytes[start + len - 2] = 1;
        let (verdict, out) = replayed(&bytes);
        assert_eq!(
            verdict,
            Verdict::Diverged {
                index: index as u64
            },
            "{out}"
        );
        assert!(
            out.contains(&format!("DIVERGED at input {index}: result for w-")),
            "{out}"
        );
        assert!(
            out.contains("the recording kept: an answer of digest 0000000000000000"),
            "{out}"
        );
        assert!(out.contains("the replay answered: Ok(Applied)"), "{out}");
        assert_eq!(verdict.code(), EXIT_DIVERGED);
        // Explaining over it stops there, and says so in its exit code.
        let (code, out) = explained("w-0", None, vec![("rec".into(), bytes)]).unwrap();
        assert_eq!(code, EXIT_DIVERGED, "{out}");
        assert!(out.contains(&format!("DIVERGED at input {index}")), "{out}");
    }

    #[test]
    fn a_recording_of_another_format_is_refused_naming_both_versions() {
        let mut sim = Sim::converged(1);
        let mut bytes = sim.bytes();
        let other = FLIGHT_FORMAT + 1;
        bytes[8..12].copy_from_slice(&other.to_le_bytes());
        let (verdict, out) = replayed(&bytes);
        let Verdict::Unreadable(why) = &verdict else {
            panic!("{verdict:?}: {out}");
        };
        assert!(
            why.contains(&format!("format version {other}"))
                && why.contains(&format!("version {FLIGHT_FORMAT}")),
            "{why}"
        );
        assert_eq!(verdict.code(), 1);
        assert!(out.is_empty(), "nothing replayed: {out}");
        // Explain leaves it out, explains from the others, and exits 1.
        let good = Sim::converged(1).bytes();
        let (code, out) = explained(
            "w-0",
            None,
            vec![("other".into(), bytes), ("good".into(), good)],
        )
        .unwrap();
        assert_eq!(code, 1, "{out}");
        assert!(out.contains("life 1 of 1: good"), "{out}");
        assert!(out.contains("row 11 (SteadyReady)"), "{out}");
    }

    #[test]
    fn a_cut_recording_is_replayed_to_its_cut_and_said_to_be_cut() {
        let (mut sim, _) = with_a_lost_agent();
        let bytes = sim.bytes();
        let spans = frame_spans(&bytes);
        let kept = spans.len() / 2;
        let (start, len) = spans[kept - 1];
        let mut cut = bytes[..start + len].to_vec();
        cut.extend_from_slice(&CUT_MARKER.to_le_bytes());
        let (verdict, out) = replayed(&cut);
        assert_eq!(
            verdict,
            Verdict::AsRecorded {
                inputs: kept as u64,
                cut: true
            },
            "{out}"
        );
        assert_eq!(verdict.code(), 0, "a cut is no failure");
        assert!(out.contains(&format!("{kept} inputs (cut there)")), "{out}");
        assert!(out.contains("the recording was cut after them"), "{out}");
        // A recording being written ends mid-frame: what is whole is replayed.
        let (start, _) = spans[kept];
        // `start` is where the frame's body begins, after its length:
        // torn in its length, and twice in its body.
        for torn in [start - 2, start + 3, start + 9] {
            let (verdict, out) = replayed(&bytes[..torn]);
            assert_eq!(
                verdict,
                Verdict::AsRecorded {
                    inputs: kept as u64,
                    cut: false
                },
                "{out}"
            );
            assert!(out.contains("after them, a frame half written"), "{out}");
        }
        let (_, out) = replayed(&bytes[..start - 4]);
        assert!(!out.contains("half written"), "{out}");
    }

    #[test]
    fn explain_names_the_row_and_the_failure_of_a_node_whose_attempt_failed() {
        let (mut sim, lost) = with_a_lost_agent();
        let (code, out) = explained("w-1", None, vec![("rec".into(), sim.bytes())]).unwrap();
        assert_eq!(code, 0, "{out}");
        // The failed attempt's deletion, with the failure that chose it.
        let begin = out
            .find("row 4 (BeginDelete): begin deleting the attempt (it failed)")
            .unwrap_or_else(|| panic!("no row 4 in:\n{out}"));
        let after = &out[begin..];
        let facts: String = after.lines().take(6).collect::<Vec<_>>().join("\n");
        assert!(
            facts.contains(&format!("{}: stage Failed", lost.attempt)),
            "{facts}"
        );
        assert!(facts.contains("failures 1"), "{facts}");
        assert!(facts.contains("failed at 10:0"), "{facts}");
        assert!(
            facts.contains("last error (AgentLost): its agent stayed away past its grace"),
            "{facts}"
        );
        // Its cause: the agent going away, seconds before its grace ended.
        assert!(
            facts.contains("because: #") && facts.contains(&format!("agent of {lost} went away")),
            "{facts}"
        );
        // Its first attempt was inserted and dispatched, in order, and the
        // replacement started after the failure.
        let insert = out.find("row 0 (InsertSlot): insert the slot").unwrap();
        let create = out
            .find("dispatch CreateLease (leasing a machine)")
            .unwrap();
        let restart = out.find("restart the slot with a fresh attempt").unwrap();
        assert!(
            insert < create && create < begin && begin < restart,
            "{out}"
        );
        // Only w-1's attempts (its first and its replacement) are shown.
        let attempts: BTreeSet<&str> = out
            .lines()
            .filter_map(|l| {
                let (id, _) = l.strip_prefix("    a")?.split_once(':')?;
                id.bytes().all(|b| b.is_ascii_digit()).then_some(id)
            })
            .collect();
        let expected: BTreeSet<String> = [lost.attempt.0, sim.key("w-1").attempt.0]
            .iter()
            .map(|a| a.to_string())
            .collect();
        assert_eq!(
            attempts,
            expected.iter().map(String::as_str).collect(),
            "{out}"
        );
    }

    #[test]
    fn explain_of_an_unknown_node_names_the_nodes_the_recording_knows() {
        let mut sim = Sim::converged(3);
        let err = explained("w-7", None, vec![("rec".into(), sim.bytes())]).unwrap_err();
        let err = err.to_string();
        assert!(err.contains("know no node w-7"), "{err}");
        assert!(err.contains("w-0 to w-2"), "{err}");
        let err = explained("x-0", None, vec![("rec".into(), sim.bytes())]).unwrap_err();
        assert!(err.to_string().contains("w-0 to w-2"), "{err}");
    }

    #[test]
    fn explain_stops_at_the_time_it_is_given() {
        let (mut sim, _) = with_a_lost_agent();
        let bytes = sim.bytes();
        let lives = || vec![("rec".to_owned(), bytes.clone())];
        let (_, all) = explained("w-1", None, lives()).unwrap();
        // The agent went away at +1 s; its grace ends well after +2 s.
        for at in [
            "+2",
            "10:00:02",
            "2026-12-01T10:00:02Z",
            "2026-12-01T11:00:02+01:00",
        ] {
            let (code, out) = explained("w-1", Some(at), lives()).unwrap();
            assert_eq!(code, 0);
            assert!(
                out.contains("stopped at 10:00:02.000 (--at)"),
                "{at}: {out}"
            );
            assert!(out.contains("row 11 (SteadyReady)"), "{at}: {out}");
            assert!(!out.contains("BeginDelete"), "{at}: {out}");
            assert!(all.len() > out.len());
        }
        let err = explained("w-1", Some("09:00:00"), lives()).unwrap_err();
        assert!(
            err.to_string().contains(
                "--at names 2026-12-01 09:00:00 UTC, before the first recording began \
                 (2026-12-01 10:00:00 UTC)"
            ),
            "{err}"
        );
    }

    #[test]
    fn explain_reads_lives_in_the_order_they_started() {
        let mut first = Sim::converged(2);
        let mut second = Sim::new(WALL_MS + 3_600_000);
        second
            .flight
            .handle_apply(&shape(1, 1), Ticket(1), t(0))
            .unwrap();
        second.pump(t(0));
        let lives = vec![
            ("second.flight".to_owned(), second.bytes()),
            ("first.flight".to_owned(), first.bytes()),
        ];
        let (code, out) = explained("w-0", None, lives).unwrap();
        assert_eq!(code, 0, "{out}");
        let one = out.find("life 1 of 2: first.flight").unwrap();
        let two = out.find("life 2 of 2: second.flight").unwrap();
        assert!(one < two, "{out}");
        // Each life decides its node from the start.
        assert_eq!(out.matches("row 0 (InsertSlot)").count(), 2, "{out}");
        assert!(out[two..].contains("11:00:00.000"), "{out}");
    }

    #[test]
    fn at_reads_rfc3339_times_of_day_and_offsets() {
        assert_eq!(At::parse("+90").unwrap(), At::FromStart(90_000));
        assert_eq!(At::parse("+0.5").unwrap(), At::FromStart(500));
        assert_eq!(At::parse("10:20:30").unwrap(), At::TimeOfDay(37_230_000));
        assert_eq!(
            At::parse("10:20:30.250").unwrap(),
            At::TimeOfDay(37_230_250)
        );
        assert_eq!(
            At::parse("2026-12-01T10:00:00Z").unwrap(),
            At::Wall(WALL_MS)
        );
        assert_eq!(
            At::TimeOfDay(37_230_000).resolve(WALL_MS),
            WALL_MS + 1_230_000
        );
        assert_eq!(At::FromStart(500).resolve(WALL_MS), WALL_MS + 500);
        for bad in ["", "+", "+-1", "yesterday", "25:00:00", "+nan"] {
            assert!(At::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn exit_codes_rank_a_divergence_over_an_error() {
        assert_eq!(worse(0, 1), 1);
        assert_eq!(worse(1, EXIT_DIVERGED), EXIT_DIVERGED);
        assert_eq!(worse(EXIT_DIVERGED, 1), EXIT_DIVERGED);
        assert_eq!(worse(1, 0), 1);
    }
}
