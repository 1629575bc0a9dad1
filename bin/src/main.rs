//! `swactor`: the daemon (`up`), the CLI (`apply`, `plan`, `status`, `watch`,
//! `down`) and the node agent (`agent`), in one binary.

mod agent;
mod client;
mod control;
mod daemon;
mod journal;
mod logs;
mod progress;
mod protocol;
mod shapefile;
mod state;
mod swarm;

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::time::Duration;

/// Swactor keeps a fleet of machines shaped the way you declared it.
#[derive(Debug, Parser)]
#[command(name = "swactor", version, about)]
struct Cli {
    /// The state directory (default: $SWACTOR_STATE_DIR, or ./.swactor).
    #[arg(long, global = true)]
    state_dir: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the daemon in the foreground and converge on SHAPE.
    Up {
        /// The shape file (TOML).
        shape: Option<PathBuf>,
        /// Exit once converged (tearing down unless --keep).
        #[arg(long)]
        until_converged: bool,
        /// With --until-converged: give up after this many seconds.
        #[arg(long, default_value_t = 300.0)]
        timeout: f64,
        /// On exit, leave the nodes running for the next `swactor up` to adopt.
        #[arg(long)]
        keep: bool,
    },
    /// Offer a new shape to the running daemon.
    Apply {
        /// The shape file (TOML).
        shape: PathBuf,
    },
    /// Show what the next pass would do (for SHAPE, or the current shape).
    Plan {
        /// The shape file (TOML).
        shape: Option<PathBuf>,
    },
    /// Show every node.
    Status {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Follow the daemon's telemetry.
    Watch,
    /// Stop the daemon, tearing everything down (or keeping it with --keep).
    Down {
        /// Leave the nodes running for the next `swactor up` to adopt.
        #[arg(long)]
        keep: bool,
    },
    /// Show a node's agent log: its latest attempt's, or `--attempt N`'s.
    /// The ends of the last three attempts' logs are kept after their
    /// machines are gone.
    #[command(after_help = "Example:\n  swactor logs worker-0 --follow")]
    Logs {
        /// The node, e.g. `worker-0`.
        node: String,
        /// An earlier attempt, by number (`swactor describe NODE` lists them).
        #[arg(long)]
        attempt: Option<u64>,
        /// The run, when the state directory holds more than one.
        #[arg(long)]
        run: Option<String>,
        /// Keep printing what the agent writes until its attempt ends.
        #[arg(long, short = 'f')]
        follow: bool,
    },
    /// The node agent (started by providers, not by hand).
    Agent(agent::AgentOptions),
}

fn main() {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_env("SWACTOR_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("swactor: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    let state_dir = state::StateDir::path_from(cli.state_dir);
    let outcome = runtime.block_on(async move {
        match cli.command {
            Command::Up {
                shape,
                until_converged,
                timeout,
                keep,
            } => {
                if !timeout.is_finite() || timeout <= 0.0 {
                    anyhow::bail!("--timeout must be a positive number of seconds, not {timeout}");
                }
                daemon::up(daemon::UpOptions {
                    shape,
                    state_dir,
                    until_converged,
                    timeout: Duration::from_secs_f64(timeout),
                    keep,
                })
                .await
            }
            Command::Apply { shape } => client::apply(&state_dir, &shape).await.map(|()| 0),
            Command::Plan { shape } => client::plan(&state_dir, shape.as_deref()).await.map(|()| 0),
            Command::Status { json } => client::status(&state_dir, json).await.map(|()| 0),
            Command::Watch => client::watch(&state_dir).await.map(|()| 0),
            Command::Down { keep } => client::down(&state_dir, keep).await.map(|()| 0),
            Command::Logs {
                node,
                attempt,
                run,
                follow,
            } => {
                let opts = logs::LogsOptions {
                    node,
                    attempt,
                    run,
                    follow,
                };
                logs::logs(&state_dir, &opts).await
            }
            Command::Agent(opts) => agent::run(opts).await,
        }
    });
    // Ending the runtime here stops any task still draining.
    drop(runtime);
    match outcome {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("swactor: {e:#}");
            std::process::exit(2);
        }
    }
}
