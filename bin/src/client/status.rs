//! `status` and `describe`: the cluster and one node, as tables and text.

use super::*;

/// `swactor status [--json]`.
///
/// # Errors
/// An unreachable daemon.
pub(crate) async fn status(state_dir: &Path, json: bool) -> Result<()> {
    let answer = one(state_dir, ControlRequest::Status).await?;
    let ControlResponse::Status(snap) = answer else {
        return Err(unexpected(&answer));
    };
    let mut out = Out::new();
    if json {
        out.line(status_json(&snap)?)?;
    } else {
        print_status(&mut out, &snap, stdout_width(), "")?;
    }
    out.flush()?;
    Ok(())
}

/// What `status --json` prints: the snapshot with the cluster's state in a
/// word first, as the headline says it (`converging`, `converged`,
/// `paused`, `tearing down`, `stopping`), and `ha` (who leads) only when
/// several daemons share the run.
fn status_json(snap: &ClusterSnapshot) -> serde_json::Result<String> {
    #[derive(serde::Serialize)]
    struct WithState<'a> {
        state: &'static str,
        #[serde(flatten)]
        snapshot: &'a ClusterSnapshot,
    }
    let with_state = WithState {
        state: crate::words::cluster_state(snap),
        snapshot: snap,
    };
    let mut text = serde_json::to_string_pretty(&with_state)?;
    // `ha` cannot be skipped in the type (postcard frames have no field
    // names), so a daemon alone on its journal would print `"ha": null`,
    // which it never printed before there were several. It is the
    // snapshot's last field; a test says so if that changes.
    if snap.ha.is_none()
        && let Some(head) = text.strip_suffix(",\n  \"ha\": null\n}")
    {
        text = format!("{head}\n}}");
    }
    Ok(text)
}

/// The first line of a status: the run, the generation, how many nodes are
/// ready, and how many are in each other state.
pub(super) fn status_headline(s: &ClusterSnapshot) -> String {
    let ready = s.nodes.iter().filter(|n| state_word(n) == "ready").count();
    let mut line = format!(
        "run {} · generation {} · {ready}/{} ready",
        s.run_id, s.generation.0, s.desired_nodes
    );
    let mut others: BTreeMap<&str, usize> = BTreeMap::new();
    for n in &s.nodes {
        let word = state_word(n);
        if word != "ready" {
            *others.entry(word).or_default() += 1;
        }
    }
    for (word, count) in others {
        line.push_str(&format!(" · {count} {word}"));
    }
    if s.orphans > 0 {
        line.push_str(&format!(" · collecting {} leftover(s)", s.orphans));
    }
    // The same word `status --json` gives as its `state`; `paused` has a
    // longer form of its own below.
    match crate::words::cluster_state(s) {
        "converging" => {}
        "paused" if s.converged => line.push_str(" · converged"),
        "paused" => {}
        word => {
            line.push_str(" · ");
            line.push_str(word);
        }
    }
    if s.paused {
        line.push_str(" · paused (`swactor resume` to go on)");
    }
    line
}

/// The status table: one row per node, its state in the common vocabulary.
///
/// A `RESOURCE` column (what the provider says of each node's lease: a
/// container id, say) is shown when any node has something there.
pub(super) fn status_table(s: &ClusterSnapshot) -> Table {
    let resources = s.nodes.iter().any(|n| n.resource.is_some());
    let leases = s.nodes.iter().any(|n| n.lease_renewed_ms_ago.is_some());
    let mut headers = vec!["NODE", "ATTEMPT", "STATE"];
    if resources {
        headers.push("RESOURCE");
    }
    if leases {
        headers.push("LEASE");
    }
    headers.extend(["FAILS", "RETRY", "LAST ERROR"]);
    let mut table = Table::new(&headers);
    for n in &s.nodes {
        let mut cells = vec![
            n.node.to_string(),
            n.attempt.to_string(),
            state_cell(n, s.now),
        ];
        if resources {
            cells.push(n.resource.clone().unwrap_or_else(|| "-".to_owned()));
        }
        if leases {
            cells.push(match n.lease_renewed_ms_ago {
                Some(_) => crate::words::lease_words(n),
                None => "-".to_owned(),
            });
        }
        cells.extend([n.failures.to_string(), retry_cell(n, s.now)]);
        table.row(cells, n.last_error.clone().unwrap_or_default());
    }
    table
}

/// What the nodes do if this daemon goes for good, once for each window
/// their groups set: `if this daemon goes for good, nodes end themselves
/// after 60 min without a renewal (orphan_after_s)`.
pub(super) fn orphan_line(s: &ClusterSnapshot) -> Option<String> {
    let mut windows: Vec<u32> = s.nodes.iter().map(|n| n.orphan_after_s).collect();
    windows.sort_unstable();
    windows.dedup();
    let said: Vec<String> = windows
        .iter()
        .map(|w| match w {
            0 => "never (orphan_after_s = 0)".to_owned(),
            w => format!("after {}", crate::words::span(u64::from(*w))),
        })
        .collect();
    (!said.is_empty()).then(|| {
        format!(
            "if this daemon goes for good, its nodes end themselves {} without a lease renewal \
             (orphan_after_s; `swactor describe NODE` for one)",
            said.join(" or ")
        )
    })
}

/// Prints a status, each line after `prefix`, fitted to `width` columns if given.
pub(super) fn print_status(
    out: &mut Out,
    s: &ClusterSnapshot,
    width: Option<usize>,
    prefix: &str,
) -> std::io::Result<()> {
    let width = width.map(|w| w.saturating_sub(prefix.chars().count() + 1));
    let now_wall_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    for line in status_lines(s, width, now_wall_ms) {
        out.line(format_args!("{prefix}{line}"))?;
    }
    Ok(())
}

/// The lines of a status, tables fitted to `width` columns if given, as of
/// `now_wall_ms` (milliseconds since the Unix epoch).
fn status_lines(s: &ClusterSnapshot, width: Option<usize>, now_wall_ms: u64) -> Vec<String> {
    let mut lines = vec![status_headline(s)];
    if let Some(ha) = &s.ha {
        lines.push(crate::words::leader_line(ha, now_wall_ms));
    }
    for h in &s.holds {
        lines.push(format!("group {}: {}", h.group, h.reason));
    }
    lines.extend(status_table(s).render(width).into_iter().flatten());
    lines.extend(orphan_line(s));
    if !s.rentals.is_empty() {
        lines.push(rentals_headline(s));
        lines.extend(rentals_table(s).render(width).into_iter().flatten());
    }
    lines.extend(crate::words::budget_line(
        s.budget.as_ref(),
        s.spend.as_ref(),
    ));
    if let Some(lifetime) = &s.lifetime {
        lines.push(crate::words::lifetime_line(lifetime));
    }
    if !s.foreign.is_empty() {
        let cost = crate::words::foreign_cost(&s.foreign)
            .map(|m| format!(" · {} $/h", usd_per_hour(m)))
            .unwrap_or_default();
        let ours = s.deployment.as_deref().map_or_else(
            || "this daemon's journal predates deployments".to_owned(),
            |d| format!("this daemon is deployment {d}"),
        );
        lines.push(format!(
            "foreign: {} resource(s) of run {} made by another deployment{cost} \
             ({ours}; it never adopts or destroys them):",
            s.foreign.len(),
            s.run_id
        ));
        for r in &s.foreign {
            lines.push(format!("  {}", crate::words::foreign_resource(r)));
        }
    }
    lines
}

/// Dollars per hour from millionths.
pub(super) fn usd_per_hour(micros: u64) -> String {
    crate::words::usd(micros)
}

/// The rented machines' line: how many and what they cost together.
pub(super) fn rentals_headline(s: &ClusterSnapshot) -> String {
    let total: u64 = s.rentals.iter().map(|r| r.usd_per_hour_micros).sum();
    format!(
        "rented machines: {} · {} $/h in all",
        s.rentals.len(),
        usd_per_hour(total)
    )
}

/// One row per rented machine: where it was rented and what it costs.
pub(super) fn rentals_table(s: &ClusterSnapshot) -> Table {
    let mut table = Table::new(&[
        "NODE",
        "ATTEMPT",
        "PROVIDER",
        "INSTANCE",
        "OFFER",
        "MACHINE",
        "$/H",
        "LAST SEEN",
    ]);
    for r in &s.rentals {
        table.row(
            vec![
                r.node.to_string(),
                r.attempt.to_string(),
                r.provider.clone(),
                r.instance.clone(),
                if r.offer.is_empty() {
                    "?".to_owned()
                } else {
                    r.offer.clone()
                },
                r.machine.clone(),
                usd_per_hour(r.usd_per_hour_micros),
            ],
            r.status.clone(),
        );
    }
    table
}

/// `swactor describe NODE`: one node in depth.
///
/// # Errors
/// Not a node id, a node the daemon does not know, or an unreachable daemon.
pub(crate) async fn describe(state_dir: &Path, node: &str) -> Result<()> {
    if LogicalNodeId::parse(node).is_none() {
        bail!("{}", crate::control::not_a_node_id(node));
    }
    let answer = one(state_dir, ControlRequest::Describe(node.to_owned())).await?;
    let ControlResponse::Described(d) = answer else {
        return Err(unexpected(&answer));
    };
    let mut out = Out::new();
    print_description(&mut out, &d, stdout_width())?;
    out.flush()?;
    Ok(())
}

/// Prints what the daemon says of one node: its facts, then its last
/// attempts.
pub(super) fn print_description(
    out: &mut Out,
    d: &NodeDescription,
    width: Option<usize>,
) -> std::io::Result<()> {
    let facts = node_facts(d);
    out.line(d.node)?;
    let mut table = Table::new(&["", ""]);
    for (k, v) in facts {
        table.row(vec![k.to_owned()], v);
    }
    for line in table.render(width).into_iter().skip(1).flatten() {
        out.line(line)?;
    }
    if d.attempts.is_empty() {
        return Ok(());
    }
    print_attempts(out, d, width)
}

/// What `describe` says of a node, as (name, value) rows.
fn node_facts(d: &NodeDescription) -> Vec<(&'static str, String)> {
    let now = d.now;
    let mut facts: Vec<(&str, String)> = Vec::new();
    match &d.summary {
        Some(n) => {
            facts.push(("state", state_text(n, now)));
            let failures = match n.failures {
                0 => String::new(),
                1 => " (1 failure since it was last ready)".to_owned(),
                f => format!(" ({f} failures since it was last ready)"),
            };
            facts.push(("attempt", format!("{}{failures}", n.attempt)));
            if matches!(n.next, NextStep::RetryAt(_) | NextStep::Held(_)) {
                facts.push(("next retry", next_words(n.next, now)));
            }
            facts.push((
                "agent",
                match n.agent {
                    AgentLink::Connected => "connected".to_owned(),
                    AgentLink::NotJoined => "not joined to this daemon".to_owned(),
                    AgentLink::Away { .. } => format!("disconnected; {}", next_words(n.next, now)),
                },
            ));
            if let Some(p) = n.pending {
                facts.push(("doing", effect_words(p).to_owned()));
            }
            facts.push(("if orphaned", orphan_words(n)));
        }
        None => facts.push(("state", "no node (the slot is empty)".to_owned())),
    }
    facts.push((
        "desired",
        if d.desired {
            "yes: the current shape wants this slot".to_owned()
        } else {
            "no: the current shape does not want this slot".to_owned()
        },
    ));
    facts.push((
        "lease",
        d.lease.clone().unwrap_or_else(|| "none".to_owned()),
    ));
    if let Some(b) = d.bootstrap {
        facts.push(("bootstrap", bootstrap_words(b).to_owned()));
    }
    if let Some(r) = &d.failed_reason {
        facts.push(("failed", r.clone()));
    }
    if let Some(e) = d.summary.as_ref().and_then(|n| n.last_error.clone()) {
        facts.push(("last error", e));
    }
    facts
}

/// Prints a node's last attempts as a table, oldest first, and where their
/// agents' logs are.
fn print_attempts(out: &mut Out, d: &NodeDescription, width: Option<usize>) -> std::io::Result<()> {
    let now = d.now;
    out.line("attempts, oldest first:")?;
    let mut table = Table::new(&[
        "ATTEMPT",
        "STARTED",
        "READY",
        "ENDED",
        "OUTCOME",
        "REASON / LAST ERROR",
    ]);
    let current = d.summary.as_ref().map(|n| n.attempt);
    for a in &d.attempts {
        let outcome = if a.failed_reason.is_some() {
            "failed"
        } else if a.ended_at.is_some() {
            "ended"
        } else if Some(a.attempt) == current {
            d.summary.as_ref().map_or("", state_word)
        } else {
            stage_word(a.stage)
        };
        let when = |t: Option<Timestamp>| t.map_or_else(|| "-".to_owned(), |t| ago(t, now));
        table.row(
            vec![
                a.attempt.to_string(),
                ago(a.started_at, now),
                when(a.ready_at),
                when(a.ended_at),
                outcome.to_owned(),
            ],
            attempt_why(a),
        );
    }
    for line in table.render(width).into_iter().flatten() {
        out.line(line)?;
    }
    out.line(format_args!(
        "agent logs: `swactor logs {}` (`--attempt N` for an earlier attempt aN)",
        d.node
    ))?;
    Ok(())
}

/// Why an attempt ended or what it last said: its failure, its last error
/// if that differs, else its bootstrap stage; and what its provider gave
/// up rather than released.
fn attempt_why(a: &swactor_provisioning::AttemptRecord) -> String {
    let mut why: Vec<String> = Vec::new();
    if let Some(r) = &a.failed_reason {
        why.push(r.clone());
    }
    if let Some(left) = &a.left_behind {
        why.push(format!("left behind: {left}"));
    }
    if let Some(e) = &a.last_error
        && a.failed_reason.as_ref() != Some(e)
    {
        why.push(e.clone());
    }
    if why.is_empty()
        && let Some(b) = a.bootstrap
    {
        why.push(bootstrap_words(b).to_owned());
    }
    why.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use swactor_provisioning::{Intent, NodeAttemptId, NodeStage};

    fn snapshot() -> ClusterSnapshot {
        let mut s = ClusterSnapshot::empty("r");
        s.desired_nodes = 1;
        s.nodes.push(NodeSummary {
            node: LogicalNodeId::parse("w-0").unwrap(),
            attempt: NodeAttemptId(1),
            stage: NodeStage::Dormant,
            intent: Intent::Active,
            ready: true,
            pending: None,
            failures: 0,
            last_error: None,
            last_cause: None,
            next_retry_at: None,
            agent: AgentLink::Connected,
            lease: None,
            resource: None,
            next: NextStep::Nothing,
            orphan_after_s: 3_600,
            lease_renewed_ms_ago: Some(1_500),
        });
        s
    }

    fn ha(standbys: &[&str]) -> swactor_actors::HaStatus {
        swactor_actors::HaStatus {
            leader: "ctl-a (pid 4242)".to_owned(),
            leading_since_wall_ms: 1_700_000_000_000,
            standbys: standbys.iter().map(|s| (*s).to_owned()).collect(),
            lease_ttl_ms: 10_000,
            margin_ms: 2_000,
            renewed_ms_ago: 1_200,
            etcd: "https://etcd-0:2379".to_owned(),
            terms: 1,
            ..Default::default()
        }
    }

    const NOW_MS: u64 = 1_700_000_300_000;

    #[test]
    fn a_daemon_alone_on_its_journal_prints_its_status_as_before() {
        assert_eq!(
            status_lines(&snapshot(), None, NOW_MS),
            [
                "run r · generation 0 · 1/1 ready",
                "  NODE  ATTEMPT  STATE  LEASE            FAILS  RETRY  LAST ERROR",
                "  w-0   a1       ready  renewed 1 s ago  0      -",
                "if this daemon goes for good, its nodes end themselves after 60 min without a \
                 lease renewal (orphan_after_s; `swactor describe NODE` for one)",
            ]
        );
    }

    #[test]
    fn a_shared_run_names_its_leader_and_standbys_under_the_headline() {
        let alone = status_lines(&snapshot(), None, NOW_MS);
        let since = crate::words::clock_at(1_700_000_000_000);
        for (standbys, said) in [
            (
                vec!["ctl-b (pid 77)"],
                "standbys: 1 (ctl-b (pid 77))".to_owned(),
            ),
            (
                vec![],
                "standbys: none — nothing takes over if the leader's machine is lost".to_owned(),
            ),
        ] {
            let mut s = snapshot();
            s.ha = Some(ha(&standbys));
            let mut lines = status_lines(&s, None, NOW_MS);
            assert_eq!(
                lines[1],
                format!(
                    "leader: ctl-a (pid 4242) since {since} (5 min ago) · lease 10 s, renewed \
                     1.2 s ago · {said}"
                )
            );
            lines.remove(1);
            assert_eq!(lines, alone);
        }
    }

    #[test]
    fn status_json_has_ha_only_when_daemons_share_the_run() {
        let alone = status_json(&snapshot()).unwrap();
        let parsed: serde_json::Value = serde_json::from_str(&alone).unwrap();
        assert!(parsed.get("ha").is_none(), "{alone}");
        assert!(alone.starts_with("{\n  \"state\": \"converging\",\n  \"run_id\": \"r\","));
        assert!(
            alone.ends_with("\n}") && !alone.ends_with(",\n}"),
            "{alone}"
        );
        // Only `ha` goes: the other empty fields are printed as ever.
        assert!(parsed["lifetime"].is_null() && parsed["spend"].is_null());
        let mut s = snapshot();
        s.ha = Some(ha(&["ctl-b (pid 77)"]));
        let shared: serde_json::Value = serde_json::from_str(&status_json(&s).unwrap()).unwrap();
        assert_eq!(shared["ha"]["leader"], "ctl-a (pid 4242)");
        assert_eq!(shared["ha"]["standbys"][0], "ctl-b (pid 77)");
        assert_eq!(shared["ha"]["renewed_ms_ago"], 1_200);
    }
}
