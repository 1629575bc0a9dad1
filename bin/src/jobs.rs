//! `swactor run`, `swactor jobs` and `swactor job …`: the CLI's side of jobs.

use crate::client::{Client, with_client};
use crate::protocol::{ControlRequest, ControlResponse};
use anyhow::{Context, Result, bail};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use swactor_daemon::jobs::service::{JobEvent, JobRecord, JobSpec, JobState, Targets};
use swactor_provisioning::LogicalNodeId;

/// Options of `swactor run`.
#[derive(Debug, clap::Args)]
pub(crate) struct RunArgs {
    /// Run on every ready node of this group (repeat for more groups).
    #[arg(long, value_name = "G")]
    pub(crate) group: Vec<String>,
    /// Run on these nodes (each must be ready); or, given one number N, on
    /// N ready nodes taken together as a gang (of --group, if given): ranks
    /// 0…N-1 start together, and one rank's failure stops the others.
    #[arg(long, value_name = "N", num_args = 1..)]
    pub(crate) nodes: Vec<String>,
    /// Place in the queue: higher starts first (default 0; may be negative).
    #[arg(
        long,
        value_name = "P",
        default_value_t = 0,
        allow_negative_numbers = true
    )]
    pub(crate) priority: i32,
    /// Restarts a gang may make, every rank anew on ready nodes, when the
    /// cluster replaced one of its nodes (never for an exit code).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub(crate) retry: u32,
    /// A command run on each node before the job (split like a shell
    /// would); skipped on a node where it already succeeded with the same
    /// workspace.
    #[arg(long, value_name = "CMD")]
    pub(crate) setup: Option<String>,
    /// Run on every ready node.
    #[arg(long)]
    pub(crate) all: bool,
    /// A directory shipped to each node; the command runs inside its copy.
    #[arg(long, value_name = "DIR")]
    pub(crate) workspace: Option<PathBuf>,
    /// Files of the workspace to bring back when the command ends, as globs
    /// relative to it (`*`, `?`, `**`); written to ./outputs/JOB/NODE/.
    #[arg(long, value_name = "GLOB", num_args = 1..)]
    pub(crate) output: Vec<String>,
    /// Stop the job after this many seconds (its runs fail with 124).
    #[arg(long, value_name = "S")]
    pub(crate) timeout: Option<f64>,
    /// An environment variable for the command (repeat for more).
    #[arg(long, value_name = "K=V")]
    pub(crate) env: Vec<String>,
    /// The command and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub(crate) argv: Vec<String>,
}

fn targets(args: &RunArgs) -> Result<Targets> {
    if let [n] = args.nodes.as_slice()
        && let Ok(n) = n.parse::<u32>()
    {
        if args.all {
            bail!(
                "--all and --nodes {n} exclude each other: --nodes {n} takes {n} ready node(s) \
                 of the cluster, or of --group"
            );
        }
        return Ok(Targets::Gang {
            nodes: n,
            groups: args.group.clone(),
        });
    }
    let chosen = usize::from(args.all)
        + usize::from(!args.group.is_empty())
        + usize::from(!args.nodes.is_empty());
    match chosen {
        0 => bail!(
            "say where to run: --all, --group G, --nodes N (a gang of N nodes) or --nodes NODE…"
        ),
        1 if args.all => Ok(Targets::All),
        1 if !args.group.is_empty() => Ok(Targets::Groups(args.group.clone())),
        1 => Ok(Targets::Nodes(args.nodes.clone())),
        _ => bail!("--all, --group and --nodes exclude each other: give one"),
    }
}

/// Prints output line by line, each prefixed by its node.
#[derive(Default)]
struct Lines {
    partial: HashMap<(String, bool), String>,
}

impl Lines {
    fn add(&mut self, node: &str, stderr: bool, text: &str) -> std::io::Result<()> {
        let buf = self.partial.entry((node.to_owned(), stderr)).or_default();
        buf.push_str(text);
        while let Some(at) = buf.find('\n') {
            let line: String = buf.drain(..=at).collect();
            print_line(node, stderr, line.trim_end_matches('\n'))?;
        }
        Ok(())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        for ((node, stderr), rest) in self.partial.drain() {
            if !rest.is_empty() {
                print_line(&node, stderr, &rest)?;
            }
        }
        Ok(())
    }
}

fn print_line(node: &str, stderr: bool, line: &str) -> std::io::Result<()> {
    if stderr {
        let mut err = std::io::stderr().lock();
        writeln!(err, "[{node}] {line}")
    } else {
        // A reader that went away does not end the job or change its exit code.
        writeln!(crate::term::Stdout, "[{node}] {line}")
    }
}

/// `swactor run`: returns the worst exit code of the job's runs.
pub(crate) async fn run(state_dir: &Path, args: RunArgs) -> Result<i32> {
    let targets = targets(&args)?;
    let workspace = match &args.workspace {
        None => None,
        Some(dir) => {
            let abs = std::fs::canonicalize(dir).with_context(|| {
                format!(
                    "the workspace {} does not exist; nothing was shipped",
                    dir.display()
                )
            })?;
            if !abs.is_dir() {
                bail!(
                    "the workspace {} is not a directory; nothing was shipped",
                    dir.display()
                );
            }
            Some(abs)
        }
    };
    let mut env = Vec::new();
    for kv in &args.env {
        let Some((k, v)) = kv.split_once('=').filter(|(k, _)| !k.is_empty()) else {
            bail!("--env {kv:?} is not KEY=VALUE");
        };
        env.push((k.to_owned(), v.to_owned()));
    }
    let setup = match &args.setup {
        None => None,
        Some(cmd) => match shlex::split(cmd) {
            Some(argv) if !argv.is_empty() => Some(argv),
            _ => bail!("--setup {cmd:?} is not a command (unbalanced quotes, or empty)"),
        },
    };
    let spec = JobSpec {
        targets,
        workspace,
        outputs: args.output.clone(),
        timeout_s: args.timeout,
        env,
        argv: args.argv.clone(),
        priority: args.priority,
        retry: args.retry,
        setup,
    };
    with_client(state_dir, async |c| follow_run(c, spec).await).await
}

/// Follows a submitted job until it is done, showing its events and
/// cancelling it on Ctrl-C; returns the worst exit code of its runs (130
/// when it was cancelled).
async fn follow_run(client: &Client, spec: JobSpec) -> Result<i32> {
    let (conn, mut recv) = client.stream(&ControlRequest::Run(spec)).await?;
    let mut lines = Lines::default();
    let mut job: Option<String> = None;
    let mut cancelling = false;
    let interrupted = tokio::signal::ctrl_c();
    tokio::pin!(interrupted);
    let done = loop {
        let next = tokio::select! {
            next = crate::client::recv_answer(&mut recv) => next,
            _ = &mut interrupted, if !cancelling => {
                cancelling = true;
                cancel_on_interrupt(client, job.as_deref()).await?;
                continue;
            }
        };
        let event = job_event(next, &mut lines, job.as_deref())?;
        if let Some(record) = show_event(event, &mut lines, &mut job)? {
            break record;
        }
    };
    lines.flush()?;
    conn.close(0u32.into(), b"done");
    let copied = copy_outputs(&done)?;
    if let Some(dir) = copied {
        eprintln!("swactor: outputs in {}", dir.display());
    }
    summary(&done, cancelling);
    Ok(
        if cancelling && done.runs.iter().any(|r| r.state == JobState::Cancelled) {
            130
        } else {
            done.exit_code()
        },
    )
}

/// Ctrl-C: asks the daemon to cancel `job` on every node; an error when the
/// daemon has not accepted the job yet.
async fn cancel_on_interrupt(client: &Client, job: Option<&str>) -> Result<()> {
    match job {
        Some(id) => {
            eprintln!("swactor: Ctrl-C: cancelling {id} on every node…");
            match client.ask(ControlRequest::JobCancel(id.to_owned())).await {
                Ok(_) => {}
                Err(e) => eprintln!("swactor: cannot cancel {id}: {e:#}"),
            }
        }
        None => bail!("interrupted before the daemon accepted the job"),
    }
    Ok(())
}

/// The job event in the daemon's next answer; an error for any other
/// answer, and when the stream ends or breaks (the output so far shown).
fn job_event(
    next: Result<Option<ControlResponse>>,
    lines: &mut Lines,
    job: Option<&str>,
) -> Result<JobEvent> {
    match next {
        Ok(Some(ControlResponse::Job(ev))) => Ok(ev),
        Ok(Some(ControlResponse::Error(e))) => bail!("{}", crate::words::cut_long_words(&e)),
        Ok(Some(other)) => Err(crate::client::unexpected(&other)),
        Ok(None) | Err(_) => {
            lines.flush()?;
            let why = match next {
                Err(e) => format!(" ({e:#})"),
                _ => " (it ended the stream)".to_owned(),
            };
            match job {
                Some(id) => bail!(
                    "lost contact with the daemon{why}; {id} goes on without this CLI \
                     (`swactor jobs`, `swactor job logs {id}`, `swactor job outputs {id}`)"
                ),
                None => bail!("lost contact with the daemon{why} before it accepted the job"),
            }
        }
    }
}

/// Shows one event of a followed job; returns the job's record once it is
/// done.
fn show_event(
    event: JobEvent,
    lines: &mut Lines,
    job: &mut Option<String>,
) -> Result<Option<JobRecord>> {
    match event {
        JobEvent::Accepted {
            job: id,
            nodes,
            skipped,
            workspace_files,
            workspace_bytes,
        } => {
            let ws = if workspace_files > 0 {
                format!(
                    ", workspace of {workspace_files} file(s), {}",
                    crate::words::size_words(workspace_bytes)
                )
            } else {
                String::new()
            };
            if nodes.is_empty() {
                eprintln!("swactor: {id} accepted{ws}");
            } else {
                eprintln!(
                    "swactor: {id} on {} node(s): {}{ws}",
                    nodes.len(),
                    joined(&nodes)
                );
            }
            if !skipped.is_empty() {
                eprintln!("swactor: not ready, left out: {}", joined(&skipped));
            }
            *job = Some(id);
        }
        JobEvent::Queued { job: id, why } => eprintln!("swactor: {id} {why}"),
        JobEvent::Placed { nodes, restart } => {
            let id = job.clone().unwrap_or_default();
            if restart > 0 {
                eprintln!(
                    "swactor: {id} restart {restart}: every rank anew on {} node(s): {}",
                    nodes.len(),
                    joined(&nodes)
                );
            } else {
                eprintln!(
                    "swactor: {id} started on {} node(s): {}",
                    nodes.len(),
                    joined(&nodes)
                );
            }
        }
        JobEvent::Shipped {
            node,
            bytes,
            chunks,
            of,
        } => {
            if chunks == 0 && of > 0 {
                eprintln!(
                    "swactor: [{node}] workspace already there ({of} chunk(s)); nothing sent"
                );
            } else if of > 0 {
                eprintln!(
                    "swactor: [{node}] workspace shipped: sent {chunks} of {of} chunk(s), {}",
                    crate::words::size_words(bytes)
                );
            }
        }
        JobEvent::Output { node, stderr, text } => {
            lines.add(&node.to_string(), stderr, &text)?;
        }
        JobEvent::Finished(run) => {
            if run.state != JobState::Succeeded {
                let why = run.error.clone().unwrap_or_default();
                eprintln!("swactor: [{}] {}: {why}", run.node, run.state.word());
            }
        }
        JobEvent::Done(record) => return Ok(Some(*record)),
    }
    Ok(None)
}

fn summary(job: &JobRecord, cancelled: bool) {
    let mut counts: Vec<(JobState, usize)> = Vec::new();
    for r in &job.runs {
        match counts.iter_mut().find(|(s, _)| *s == r.state) {
            Some((_, n)) => *n += 1,
            None => counts.push((r.state, 1)),
        }
    }
    let parts: Vec<String> = counts
        .iter()
        .map(|(s, n)| format!("{n} {}", s.word()))
        .collect();
    if cancelled {
        let nodes: Vec<LogicalNodeId> = job
            .runs
            .iter()
            .filter(|r| r.state == JobState::Cancelled)
            .map(|r| r.node)
            .collect();
        eprintln!(
            "swactor: {} cancelled on {} node(s) ({}); their process groups were killed",
            job.id,
            nodes.len(),
            joined(&nodes)
        );
    }
    if job.runs.is_empty() {
        let why = job.cancelled.as_deref().unwrap_or("no run was placed");
        eprintln!("swactor: {} {}: {why}", job.id, job.state().word());
        return;
    }
    let restarts = job.gang.as_ref().map_or(0, |g| g.restarts);
    let restarted = if restarts > 0 {
        format!(" (after {restarts} restart(s))")
    } else {
        String::new()
    };
    eprintln!(
        "swactor: {} {}: {}{restarted}",
        job.id,
        job.state().word(),
        parts.join(", ")
    );
}

/// Copies the job's collected outputs to `./outputs/<job>/<node>/`.
fn copy_outputs(job: &JobRecord) -> Result<Option<PathBuf>> {
    if job.outputs.is_empty() || !job.runs.iter().any(|r| r.output_files > 0) {
        return Ok(None);
    }
    let into = PathBuf::from("outputs").join(&job.id);
    let from = PathBuf::from(&job.outputs_dir);
    for run in job.runs.iter().filter(|r| r.output_files > 0) {
        let src = from.join(run.node.to_string());
        let dst = into.join(run.node.to_string());
        for (rel, path) in swactor_daemon::jobs::walk(&src)
            .with_context(|| format!("cannot read {}", src.display()))?
        {
            let to = dst.join(&rel);
            if let Some(parent) = to.parent() {
                std::fs::create_dir_all(parent)
                    .with_context(|| format!("cannot make {}", parent.display()))?;
            }
            std::fs::copy(&path, &to).with_context(|| format!("cannot write {}", to.display()))?;
        }
    }
    Ok(Some(into))
}

/// `swactor jobs`.
pub(crate) async fn list(state_dir: &Path, json: bool) -> Result<()> {
    let jobs = with_client(state_dir, async |c| {
        match c.ask(ControlRequest::Jobs).await? {
            ControlResponse::Jobs(jobs) => Ok(jobs),
            other => Err(crate::client::unexpected(&other)),
        }
    })
    .await?;
    let mut out = std::io::BufWriter::new(crate::term::Stdout);
    if json {
        serde_json::to_writer_pretty(&mut out, &jobs)?;
        writeln!(out)?;
        return Ok(());
    }
    if jobs.is_empty() {
        writeln!(
            out,
            "no jobs yet (`swactor run --all -- hostname` starts one)"
        )?;
        return Ok(());
    }
    writeln!(out, "{:<10} {:<10} {:<28} COMMAND", "JOB", "STATE", "RUNS")?;
    for j in &jobs {
        let done = j
            .runs
            .iter()
            .filter(|r| r.state == JobState::Succeeded)
            .count();
        let runs = match &j.waiting {
            Some(why) => why.strip_prefix("queued: ").unwrap_or(why).to_owned(),
            None if j.runs.is_empty() => j.cancelled.clone().unwrap_or_default(),
            None => {
                let restarts = j.gang.as_ref().map_or(0, |g| g.restarts);
                if restarts > 0 {
                    format!("{done}/{} succeeded, restart {restarts}", j.runs.len())
                } else {
                    format!("{done}/{} succeeded", j.runs.len())
                }
            }
        };
        writeln!(
            out,
            "{:<10} {:<10} {:<28} {}",
            j.id,
            j.state().word(),
            runs,
            crate::words::cut(&j.argv.join(" "))
        )?;
    }
    Ok(())
}

/// `swactor job logs`.
pub(crate) async fn logs(state_dir: &Path, id: &str, node: Option<String>) -> Result<()> {
    let req = ControlRequest::JobLogs {
        id: id.to_owned(),
        node,
    };
    let pieces = with_client(state_dir, async |c| match c.ask(req).await? {
        ControlResponse::JobLogs(p) => Ok(p),
        other => Err(crate::client::unexpected(&other)),
    })
    .await?;
    let mut lines = Lines::default();
    for (node, stderr, text) in pieces {
        lines.add(&node.to_string(), stderr, &text)?;
    }
    lines.flush()?;
    Ok(())
}

/// `swactor job outputs`.
pub(crate) async fn outputs(state_dir: &Path, id: &str) -> Result<()> {
    let jobs = with_client(state_dir, async |c| {
        match c.ask(ControlRequest::Jobs).await? {
            ControlResponse::Jobs(jobs) => Ok(jobs),
            other => Err(crate::client::unexpected(&other)),
        }
    })
    .await?;
    let seq = id.strip_prefix("job-").unwrap_or(id);
    let Some(job) = jobs.iter().find(|j| j.id.strip_prefix("job-") == Some(seq)) else {
        bail!("no job {id:?} (`swactor jobs` lists them)");
    };
    if !job.state().is_final() {
        bail!(
            "{} is still {}; its outputs are collected when it ends",
            job.id,
            job.state().word()
        );
    }
    match copy_outputs(job)? {
        Some(dir) => eprintln!("swactor: outputs of {} in {}", job.id, dir.display()),
        None => eprintln!("swactor: {} has no collected outputs", job.id),
    }
    Ok(())
}

/// `swactor job cancel`.
pub(crate) async fn cancel(state_dir: &Path, id: &str) -> Result<()> {
    let answer = with_client(state_dir, async |c| {
        c.ask(ControlRequest::JobCancel(id.to_owned())).await
    })
    .await?;
    match answer {
        ControlResponse::JobCancelled { job, nodes } if nodes.is_empty() => {
            eprintln!("swactor: {job} had already ended; nothing to cancel");
        }
        ControlResponse::JobCancelled { job, nodes } => {
            eprintln!(
                "swactor: cancelling {job} on {} node(s) ({}): their process groups are killed",
                nodes.len(),
                joined(&nodes)
            );
        }
        other => return Err(crate::client::unexpected(&other)),
    }
    Ok(())
}

/// Every node of `nodes`, in order, comma-separated.
fn joined(nodes: &[LogicalNodeId]) -> String {
    nodes
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}
