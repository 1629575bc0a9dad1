//! Embedding the whole daemon in another program, through the public API.
//!
//! ```text
//!   embed                  this program: runs swactor_daemon::daemon::up on a
//!    │                     state directory of its own, with a two-node shape
//!    ├── embed agent …     node 1: the local process provider starts this same
//!    └── embed agent …     node 2: executable as each node's agent
//! ```
//!
//! The daemon leases two local agent processes, each joins it over iroh with
//! its attempt-bound key, the journal records the run in the state
//! directory, and once the cluster is converged the daemon tears it down and
//! returns. The program then opens the journal the daemon left and shows
//! what it recorded.
//!
//! The local process provider starts the daemon's own executable as each
//! node's agent, so an embedding program answers the two entry points the
//! `swactor` binary does: `agent …` and `job-exec …`.
//!
//! Run it: `cargo run -p swactor-daemon --example embed [STATE_DIR]`.

// An application, not a policy crate: it owns its runtime.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use clap::Parser;
use std::path::PathBuf;
use std::time::Duration;
use swactor_daemon::agent::AgentOptions;
use swactor_daemon::daemon::{UpOptions, up};
use swactor_daemon::journal::DaemonJournal;

/// What the provider starts this program as, on each node.
#[derive(Debug, Parser)]
enum NodeSide {
    /// The node agent.
    Agent(AgentOptions),
}

const SHAPE: &str = r#"
run = "embedded"

[[group]]
id = "worker"
count = 2
provider = "process"
boot_check = ["true"]
"#;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    // How an agent starts a job's command; it must come first (no runtime).
    if let Some(code) = swactor_daemon::jobs::agent::exec_if_asked(&args) {
        std::process::exit(code);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    if args.get(1).map(String::as_str) == Some("agent") {
        let NodeSide::Agent(opts) = NodeSide::parse();
        let code = runtime.block_on(swactor_daemon::agent::run(opts));
        std::process::exit(code.unwrap_or_else(|e| {
            eprintln!("agent: {e:#}");
            1
        }));
    }
    let code = runtime.block_on(embed(args.get(1).map(PathBuf::from)));
    std::process::exit(code.unwrap_or_else(|e| {
        eprintln!("embed: {e:#}");
        1
    }));
}

async fn embed(state_dir: Option<PathBuf>) -> anyhow::Result<i32> {
    let temp = tempfile::tempdir()?;
    let state_dir = state_dir.unwrap_or_else(|| temp.path().join("state"));
    let shape = temp.path().join("shape.toml");
    std::fs::write(&shape, SHAPE)?;
    println!(
        "embed: converging on two local nodes in {}",
        state_dir.display()
    );
    let code = up(UpOptions {
        shape: Some(shape),
        state_dir: state_dir.clone(),
        until_converged: true,
        timeout: Duration::from_secs(120),
        keep: false,
        yes: true,
        listen: None,
        advertise: None,
        agent_binary: None,
        http: None,
        unrecorded: None,
    })
    .await?;
    println!("embed: the daemon returned {code}");
    // What the daemon persisted: the run, the shape it accepted and the
    // attempts it reserved, read back from the journal file it left.
    let (_journal, image) = DaemonJournal::open(&state_dir.join("journal.redb"))?;
    let Some(image) = image else {
        anyhow::bail!("the daemon left an empty journal");
    };
    let meta = &image.meta;
    println!(
        "embed: journal: run {}, {} attempt(s) reserved, {} slot record(s), shape generation {}",
        meta.run_id,
        meta.attempts_reserved,
        image.slots.len(),
        meta.shape
            .as_ref()
            .map_or_else(|| "none".to_owned(), |s| s.generation.to_string()),
    );
    Ok(code)
}
