//! Commands that change the cluster or check a shape: `validate`, `plan`,
//! `apply`, `pause`, `replace` and `down`.

use super::*;

/// `swactor validate SHAPE`: every check that needs no daemon, the
/// capacity of this machine included (as `up` would check it).
///
/// # Errors
/// The shape is not one a daemon would take; the error says why.
pub(crate) fn validate(shape: &Path) -> Result<()> {
    let file = ShapeFile::load(shape)?;
    let checked = file.check(1)?;
    if let Some(refused) = capacity_refusal(&checked, None, &offline_capacities()) {
        bail!("{refused}");
    }
    let total = checked.node_count();
    let mut out = Out::new();
    out.line(format_args!(
        "{}: valid — run {}, {} in {} group(s)",
        shape.display(),
        checked.run_id,
        nodes(total),
        checked.groups.len()
    ))?;
    let width = checked.groups.iter().map(|g| g.id.len()).max().unwrap_or(0);
    for g in &checked.groups {
        out.line(format_args!(
            "  {:<width$}  {} × {} (role {})",
            g.id, g.count, g.provider.kind, g.role
        ))?;
    }
    if let Some(capacity) = checked.capacity {
        out.line(format_args!(
            "  capacity: at most {} (the shape's own)",
            nodes(capacity)
        ))?;
    }
    out.line(format_args!(
        "`swactor up {}` on a fresh state directory creates {}; next to a running daemon, \
         `swactor plan {}` shows what it would change.",
        shape.display(),
        nodes(total),
        shape.display()
    ))?;
    out.flush()?;
    Ok(())
}

/// Prints a plan's summary and its bounded listing.
pub(super) fn print_plan(out: &mut Out, report: &PlanReport) -> std::io::Result<()> {
    let total = guard::changed(&report.diff);
    let generation = report
        .generation
        .map(|g| format!(" (as generation {g})"))
        .unwrap_or_default();
    if total > 0 {
        out.line(format_args!("{}{generation}", guard::summary(&report.diff)))?;
    } else if report.placement_only {
        out.line(format_args!(
            "plan: the shape changes no node ({} unchanged), only where new nodes may go \
             (a group's hosts or their labels){generation}",
            report.diff.unchanged
        ))?;
    } else if report.has_work() {
        // Terraform's "no changes" would be untrue here: the daemon still
        // has work, whatever the shape says.
        out.line(format_args!(
            "plan: the shape changes no node ({} unchanged), but the cluster is not converged yet",
            report.diff.unchanged
        ))?;
    } else {
        out.line(format_args!(
            "plan: no changes; {} unchanged, converged on generation {}",
            nodes(report.diff.unchanged),
            report.current
        ))?;
    }
    for line in guard::listing(&report.changes, total) {
        out.line(line)?;
    }
    if report.under_way_total > 0 {
        out.line(format_args!(
            "under way now, whatever the shape: {} not ready",
            nodes(report.under_way_total)
        ))?;
        for n in &report.under_way {
            let error = n
                .last_error
                .as_deref()
                .map(|e| format!(" — {e}"))
                .unwrap_or_default();
            out.line(format_args!(
                "  {:<16} {:<5} {}{error}",
                n.node.to_string(),
                n.attempt.to_string(),
                state_text(n, report.now)
            ))?;
        }
        let more = report
            .under_way_total
            .saturating_sub(report.under_way.len() as u64);
        if more > 0 {
            out.line(format_args!(
                "  … and {more} more (`swactor status` lists them)"
            ))?;
        }
    } else if !report.converged {
        let why = if report.orphans > 0 {
            format!("collecting {} leftover resource(s)", report.orphans)
        } else {
            "checking what an earlier daemon left".to_owned()
        };
        out.line(format_args!("under way now: {why}"))?;
    }
    Ok(())
}

/// `swactor plan [SHAPE] [--all]`. Returns whether the daemon has work to
/// do: the shape changes something, or the cluster is not converged yet.
///
/// # Errors
/// Bad input or an unreachable daemon.
pub(crate) async fn plan(state_dir: &Path, shape: Option<&Path>, all: bool) -> Result<bool> {
    let file = shape.map(ShapeFile::load).transpose()?;
    if let Some(f) = &file {
        f.check(1)?;
    }
    let answer = one(state_dir, ControlRequest::Plan { shape: file, all }).await?;
    let ControlResponse::Plan(report) = answer else {
        return Err(unexpected(&answer));
    };
    let mut out = Out::new();
    print_plan(&mut out, &report)?;
    out.flush()?;
    Ok(report.has_work())
}

/// `swactor apply SHAPE [--yes]`: shows the plan, asks when it destroys,
/// replaces or creates many nodes, then applies.
///
/// # Errors
/// Bad input, a refusal (of the daemon, or of the question), or an
/// unreachable daemon; nothing changes then.
pub(crate) async fn apply(state_dir: &Path, shape: &Path, yes: bool) -> Result<()> {
    let file = ShapeFile::load(shape)?;
    file.check(1)?;
    with_client(state_dir, async |client| {
        let plan = ControlRequest::Plan {
            shape: Some(file.clone()),
            all: false,
        };
        let answer = client.ask(plan).await?;
        let ControlResponse::Plan(report) = answer else {
            return Err(unexpected(&answer));
        };
        let mut out = Out::new();
        print_plan(&mut out, &report)?;
        out.flush()?;
        guard::ask(&report.diff, yes).await?;
        match client.ask(ControlRequest::Apply(file.clone())).await? {
            ControlResponse::Applied {
                generation,
                changed: true,
                paused,
            } => {
                out.line(format_args!("applied: generation {generation}"))?;
                if paused {
                    out.line(
                        "the cluster is paused: the shape is recorded, but nothing changes \
                         until `swactor resume`",
                    )?;
                } else {
                    rollout_lines(&mut out, &file, &report)?;
                }
            }
            ControlResponse::Applied {
                generation,
                changed: false,
                ..
            } => out.line(format_args!(
                "unchanged: the shape is already generation {generation}"
            ))?,
            other => return Err(unexpected(&other)),
        }
        if let Ok(shape) = file.to_shape(1)
            && shape.lifetime.max_lifetime_s > 0
        {
            let which = swactor_provisioning::lifetime::Which::MaxLifetime;
            out.line(format_args!(
                "{} counts again from now",
                crate::words::lifetime_setting(&shape.lifetime, which)
            ))?;
        }
        out.flush()?;
        Ok(())
    })
    .await
}

/// One line per group whose nodes a plan replaces: how many of its ready
/// nodes go at a time.
pub(super) fn rollout_lines(
    out: &mut Out,
    file: &ShapeFile,
    report: &PlanReport,
) -> std::io::Result<()> {
    if report.diff.replace == 0 {
        return Ok(());
    }
    let Some(desired) = file.check(1).ok().and_then(|s| s.validate().ok()) else {
        return Ok(());
    };
    let replaced: std::collections::BTreeSet<&str> = report
        .changes
        .iter()
        .filter(|(_, c)| *c == swactor_provisioning::Change::Replace)
        .map(|(n, _)| n.group.as_str())
        .collect();
    for g in desired
        .groups
        .iter()
        .filter(|g| replaced.contains(g.id.as_str()))
    {
        let surge = g.policy.max_surge_of(g.count);
        if surge == 0 {
            out.line(format_args!(
                "group {}: ready nodes are replaced {} at a time (max_unavailable), in slot order; \
                 a replacement that fails stops the rollout, and `swactor status` says why",
                g.id,
                g.policy.max_unavailable_of(g.count)
            ))?;
        } else {
            out.line(format_args!(
                "group {}: {surge} surge node(s) ({}-{} and up) are added first, then ready nodes \
                 are replaced in slot order keeping at least {} ready (max_unavailable {}, \
                 max_surge {surge}); the surge nodes go once the group is ready with the new \
                 template; a replacement that fails stops the rollout, and `swactor status` says why",
                g.id,
                g.id,
                g.count,
                g.count - g.policy.max_unavailable_of(g.count).min(g.count),
                g.policy.max_unavailable_of(g.count),
            ))?;
        }
    }
    Ok(())
}

/// `swactor pause` (`paused`) or `swactor resume`.
///
/// # Errors
/// A refusal (a teardown cannot be paused), or an unreachable daemon.
pub(crate) async fn pause(state_dir: &Path, paused: bool) -> Result<()> {
    let request = if paused {
        ControlRequest::Pause
    } else {
        ControlRequest::Resume
    };
    let answer = one(state_dir, request).await?;
    let ControlResponse::Paused { changed, .. } = answer else {
        return Err(unexpected(&answer));
    };
    let mut out = Out::new();
    out.line(match (paused, changed) {
        (true, true) => {
            "paused: nothing new is dispatched (no node is created, replaced or removed) \
             until `swactor resume`; operations under way finish, failed nodes are cleaned up"
        }
        (true, false) => "already paused",
        (false, true) => "resumed",
        (false, false) => "not paused: nothing to resume",
    })?;
    out.flush()?;
    Ok(())
}

/// `swactor replace NODE`.
///
/// # Errors
/// An unreachable daemon, or the replace was refused.
pub(crate) async fn replace(state_dir: &Path, node: &str) -> Result<()> {
    let answer = one(state_dir, ControlRequest::Replace(node.to_owned())).await?;
    let ControlResponse::Replaced { node, attempt } = answer else {
        return Err(unexpected(&answer));
    };
    // What follows the cleanup is the cluster's to say: nothing new starts
    // while it is paused.
    let paused = match one(state_dir, ControlRequest::Status).await {
        Ok(ControlResponse::Status(snap)) => snap.paused,
        _ => false,
    };
    let then = if paused {
        "no new attempt starts while the cluster is paused (`swactor resume` goes on)"
    } else {
        "then a new attempt starts (`swactor status` shows it)"
    };
    let mut out = Out::new();
    out.line(format!(
        "{node}: its attempt a{attempt} is failed (replaced by the operator) and is cleaned \
         up; {then}"
    ))?;
    out.flush()?;
    Ok(())
}

/// `swactor down [--keep]`.
///
/// Returns once the daemon has released its state directory, so an
/// immediate `swactor up` finds it free.
///
/// # Errors
/// An unreachable daemon, or one still holding the directory
/// [`RELEASE_WAIT_MAX`] after it answered.
pub(crate) async fn down(state_dir: &Path, keep: bool, purge: bool) -> Result<()> {
    let state = StateDir::open(state_dir.to_path_buf())?;
    let request = ControlRequest::Down { keep, purge };
    let (destroyed, kept, without_machine, purged) = match one(state_dir, request).await? {
        ControlResponse::Down {
            destroyed,
            kept,
            without_machine,
            purged,
        } => (destroyed, kept, without_machine, purged),
        other => return Err(unexpected(&other)),
    };
    let mut out = Out::new();
    if destroyed.is_empty() && kept.is_empty() && without_machine.is_empty() {
        out.line("daemon stopped; there were no nodes")?;
    }
    if !destroyed.is_empty() {
        out.line(format_args!(
            "destroyed {} node(s): {}",
            destroyed.len(),
            crate::words::names(&destroyed)
        ))?;
    }
    if !kept.is_empty() {
        out.line(format_args!(
            "kept {} node(s) running: {}",
            kept.len(),
            crate::words::names(&kept)
        ))?;
    }
    if !without_machine.is_empty() {
        out.line(crate::words::without_machine(&without_machine))?;
    }
    for (host, failed) in &purged {
        match failed {
            None => out.line(format_args!("purged {host}"))?,
            Some(why) => out.line(format_args!("could not purge {host}: {why}"))?,
        }
    }
    out.flush()?;
    let still = tokio::task::spawn_blocking(move || {
        let started = std::time::Instant::now();
        loop {
            match state.running_daemon() {
                None => return None,
                Some(holder) if started.elapsed() >= RELEASE_WAIT_MAX => return Some(holder),
                Some(_) => std::thread::sleep(RELEASE_POLL_INTERVAL),
            }
        }
    })
    .await
    .context("waiting for the daemon to exit")?;
    match still {
        None => Ok(()),
        Some(DaemonHolder { pid: Some(pid) }) => bail!("the daemon (pid {pid}) is still stopping"),
        Some(DaemonHolder { pid: None }) => bail!("the daemon is still stopping"),
    }
}
