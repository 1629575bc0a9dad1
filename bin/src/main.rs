//! `swactor`: the daemon (`up`), the CLI (`apply`, `plan`, `status`,
//! `describe`, `watch`, `down`, `validate`, `run`, `jobs`, `job`, and
//! `replay` and `explain` over the daemon's flight recordings) and the node
//! agent (`agent`), in one binary.
//!
//! Exit codes: 0 on success, 1 on any error (bad input, a refusal, an
//! unreachable daemon, a broken stream), 2 from `plan --detailed-exitcode`
//! when there is work to do, 3 from a daemon whose cluster kept failing
//! (see `docs/architecture.md`), 4 from `replay` or `explain` when a
//! recording is answered otherwise than recorded. `run` exits with its
//! job's worst exit code (130 after Ctrl-C; see `docs/jobs.md`). A stdout closed early (as by
//! `| head`) changes none of them: what is written after is dropped.

/// jemalloc: it hands memory freed after a burst (a flood of refused
/// connections) back to the system within seconds, where glibc's malloc
/// kept it resident.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

mod bench;
mod client;
mod flight;
mod jobs;
mod logs;
mod remote;

use swactor_daemon::{
    agent, control, daemon, guard, handshakes, progress, protocol, shapefile, state, term, words,
};

use clap::{Parser, Subcommand};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Duration;

/// Swactor keeps a fleet of machines shaped the way you declared it.
#[derive(Debug, Parser)]
#[command(
    name = "swactor",
    version,
    after_help = "Examples:
  swactor up examples/local.toml        run the daemon and converge on a shape
  swactor status                        every node, from a second terminal
  swactor plan changed.toml             what a changed shape would do
  swactor apply changed.toml            do it (asks before destroying or replacing)
  swactor run --all -- hostname         run a command on every ready node
  swactor down                          tear everything down and stop the daemon

Exit codes: 0 success, 1 error, 2 `plan --detailed-exitcode` found work,
3 the daemon's cluster kept failing, 4 `replay` or `explain` found a
recording answered otherwise than recorded; `run` exits with its job's worst exit
code (130 after Ctrl-C). A pipe closed early (`| head`) changes none of them."
)]
struct Cli {
    /// The state directory (default: $SWACTOR_STATE_DIR, or ./.swactor).
    #[arg(long, global = true)]
    state_dir: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

/// Seconds `up --until-converged` waits when `--timeout` is not given.
const UP_TIMEOUT_DEFAULT_S: f64 = 300.0;

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the daemon in the foreground and converge on SHAPE.
    #[command(after_help = "Examples:
  swactor up examples/local.toml                          start (or resume) and stay
  swactor up examples/local.toml --until-converged        exit 0 once converged, tearing down
  swactor up                                              resume the journal's shape
  swactor up bigger.toml --yes                            no question, even for a big change

On a state directory whose journal holds a shape, SHAPE is offered as the next
generation: its plan is shown first, and a change that destroys or replaces
nodes, or creates more than 20 at once, is confirmed on a terminal (or needs
--yes).")]
    Up {
        /// The shape file (TOML).
        shape: Option<PathBuf>,
        /// Exit once converged (tearing down unless --keep).
        #[arg(long)]
        until_converged: bool,
        /// With --until-converged: give up after this many seconds (default 300).
        #[arg(long, requires = "until_converged")]
        timeout: Option<f64>,
        /// On exit, leave the nodes running for the next `swactor up` to adopt.
        #[arg(long)]
        keep: bool,
        /// Go ahead without asking, even when SHAPE destroys or replaces nodes.
        #[arg(long, short = 'y')]
        yes: bool,
        /// The address the daemon listens on (default: the last daemon's of
        /// this state directory, else 127.0.0.1: only agents and CLIs on
        /// this machine reach it). Remote agents need one they can reach,
        /// e.g. 0.0.0.0 with --advertise.
        #[arg(long, value_name = "IP")]
        listen: Option<std::net::IpAddr>,
        /// The address remote agents dial (default: the --listen address).
        /// Needed when listening on all interfaces (0.0.0.0 or ::).
        #[arg(long, value_name = "IP")]
        advertise: Option<std::net::IpAddr>,
        /// The swactor binary remote hosts run as their agent (default:
        /// `swactor-agent` next to this executable, else this executable).
        #[arg(long, value_name = "PATH", env = "SWACTOR_AGENT_BINARY")]
        agent_binary: Option<PathBuf>,
        /// Where the dashboard and /metrics listen (default: the address
        /// used last time in this state directory, else a free port on
        /// 127.0.0.1). Kept in STATE/http.addr; the token is in STATE/http.token.
        #[arg(long, value_name = "ADDR:PORT")]
        http: Option<std::net::SocketAddr>,
        /// With no journal in a state directory where a run has been (its
        /// journal was lost): take the resources the provider still lists
        /// for the run as the shape's nodes, as they are.
        #[arg(long, conflicts_with = "fresh")]
        adopt: bool,
        /// With no journal in a state directory where a run has been:
        /// destroy what the provider still lists for the run, then create
        /// the shape anew.
        #[arg(long)]
        fresh: bool,
        /// Keep the journal in etcd instead of STATE/journal.redb, and take
        /// turns on the run with every other daemon started on the same
        /// etcd and shape: one leads, the others stand by (docs/ha.md).
        #[command(flatten)]
        etcd: swactor_daemon::journal::EtcdArgs,
        /// With --etcd: the key prefix the run's keys live under (e.g.
        /// /prod), so one etcd serves several deployments.
        #[arg(long, value_name = "PREFIX", default_value = "")]
        etcd_prefix: String,
        /// With --etcd: how long the leader's etcd lease lives without a
        /// renewal, in seconds (default 10). A standby takes over within
        /// about this long of the leader's machine being lost.
        #[arg(long, value_name = "SECONDS")]
        lease_ttl: Option<f64>,
        /// The most the flight recordings in STATE/flight/ may take
        /// together, in MiB (one per daemon life: every input the daemon's
        /// host was given, for `swactor replay` and `swactor explain`); the
        /// oldest go first. 0 records nothing.
        #[arg(long, value_name = "MIB", default_value_t = 64)]
        flight_max_mib: u64,
    },
    /// Offer a new shape to the running daemon (its plan is shown first).
    #[command(after_help = "Examples:
  swactor apply changed.toml         show the plan, ask if it destroys or replaces, apply
  swactor apply changed.toml --yes   the same without the question (for scripts)

A change that destroys or replaces nodes, or creates more than 20 at once, is
confirmed on a terminal; without one it is refused unless --yes is given.
A refused change changes nothing.")]
    Apply {
        /// The shape file (TOML).
        shape: PathBuf,
        /// Go ahead without asking, even when the shape destroys or replaces nodes.
        #[arg(long, short = 'y')]
        yes: bool,
    },
    /// Show what SHAPE would change, or what the current shape still has to do.
    #[command(after_help = "Examples:
  swactor plan changed.toml                       summary and the first 20 changes
  swactor plan changed.toml --all                 every change
  swactor plan --detailed-exitcode                for scripts: 0 nothing to do, 2 work, 1 error")]
    Plan {
        /// The shape file (TOML).
        shape: Option<PathBuf>,
        /// List every changed node (by default the first 20).
        #[arg(long)]
        all: bool,
        /// Exit 0 when there is nothing to do, 2 when there is, 1 on an error.
        #[arg(long)]
        detailed_exitcode: bool,
    },
    /// Check a shape file without a daemon, and say what it would create.
    #[command(after_help = "Example:
  swactor validate examples/local.toml")]
    Validate {
        /// The shape file (TOML).
        shape: PathBuf,
    },
    /// Show every node.
    #[command(after_help = "Examples:
  swactor status
  swactor status --json | jq '.nodes[] | select(.ready | not)'")]
    Status {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show one node in depth: its state, lease and last attempts.
    #[command(after_help = "Example:
  swactor describe worker-1")]
    Describe {
        /// The node, e.g. worker-1.
        node: String,
    },
    /// Follow the daemon's events live, one timestamped line each.
    #[command(after_help = "Example:
  swactor watch

Exits 0 when the daemon ends the stream (it stopped) or on Ctrl-C, and 1 when
the stream breaks off (the daemon died, the connection was lost).")]
    Watch,
    /// Pause reconciling: show state, but create, replace and remove nothing.
    #[command(
        long_about = "Pause reconciling: the daemon goes on folding what it hears and \
`status` shows it, but it dispatches nothing new: no node is created, replaced, scaled away \
or advanced. Operations already under way finish; a node that fails is cleaned up (nothing \
leaks) but not replaced. `apply` is accepted and recorded, and acted on only after \
`swactor resume`. The pause is durable: a daemon restarted (even after kill -9) comes back \
paused. `swactor down` overrides it and removes every node.",
        after_help = "Example:
  swactor pause && swactor status      # headline says `paused`"
    )]
    Pause,
    /// Resume reconciling after `swactor pause`.
    #[command(after_help = "Example:\n  swactor resume")]
    Resume,
    /// Replace one node: its current attempt is failed ("replaced by the
    /// operator"), cleaned up, and a new one is started.
    #[command(
        long_about = "Replace one node: its current attempt is failed with the reason \
\"replaced by the operator\" and goes through the same cleanup as any failed attempt (its \
bootstrap is stopped and its machine released) before a new attempt is started, after the \
usual backoff; the slot never has two live attempts. A node that is already failed or \
leaving, or has an operation in flight, is refused (try again once it finishes). While \
reconciling is paused the old attempt is cleaned up but no new one starts until `swactor \
resume`.",
        after_help = "Example:\n  swactor replace worker-1"
    )]
    Replace {
        /// The node, e.g. worker-1.
        node: String,
    },
    /// Stop the daemon, tearing everything down (or keeping it with --keep).
    #[command(after_help = "Examples:
  swactor down          destroy every node, then stop the daemon (it never asks; --yes is taken)
  swactor down --keep   stop the daemon, leave the nodes for the next `swactor up`")]
    Down {
        /// Leave the nodes running for the next `swactor up` to adopt.
        #[arg(long, conflicts_with = "purge")]
        keep: bool,
        /// After the teardown, also remove what remote hosts cache for
        /// Swactor (the uploaded agent binary, ~/.swactor when empty).
        #[arg(long)]
        purge: bool,
        /// Go ahead without asking. `down` never asks (naming it is how it is
        /// confirmed); taken so that scripts may pass --yes to it as they do
        /// to `up` and `apply`.
        #[arg(long, short = 'y')]
        yes: bool,
    },
    /// Print the public key the daemon logs into SSH hosts with (made on
    /// first use), for their `authorized_keys`.
    #[command(
        after_help = "Example:\n  swactor ssh-key | ssh root@10.0.0.5 'cat >> ~/.ssh/authorized_keys'"
    )]
    SshKey,
    /// Show a node's agent log: its latest attempt's, or `--attempt N`'s.
    /// A `process` node's is read from the state directory, where the ends
    /// of its last three attempts' logs are kept after they are gone; any
    /// other node's (a container's log, a file on an SSH host or instance)
    /// is read from its machine by the running daemon, while it exists.
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
    /// Run a command on the cluster's ready nodes, streaming their output.
    #[command(after_help = "Examples:
  swactor run --all -- hostname                          every ready node
  swactor run --group gpu --workspace . -- ./train.sh    ship a directory, run in it
  swactor run --nodes worker-0 worker-1 --output 'out/*' -- make
  swactor run --all --timeout 60 --env SEED=3 -- ./bench

Output lines are prefixed by their node. The exit code is the worst of the
runs' exit codes. Outputs go to ./outputs/JOB/NODE/. Ctrl-C cancels the job on
every node (its process group is killed).")]
    Run(jobs::RunArgs),
    /// List the jobs.
    #[command(after_help = "Examples:
  swactor jobs                 id, state, runs and command of every job
  swactor jobs --json          every field, e.g. the bytes each run was shipped")]
    Jobs {
        /// As JSON (every field, including the bytes each run was shipped).
        #[arg(long)]
        json: bool,
    },
    /// One job: its output, or cancel it.
    #[command(
        subcommand,
        after_help = "Examples:
  swactor job logs job-3                   replay its output, prefixed by node
  swactor job logs job-3 --node worker-1   one node's output
  swactor job outputs job-3                copy its outputs to ./outputs/job-3/NODE/
  swactor job cancel job-3                 kill it on every node it still runs on"
    )]
    Job(JobCommand),
    /// A shell, or one command, on a node: through the daemon and the
    /// node's agent, for every provider (no SSH server is involved).
    #[command(after_help = "Examples:
  swactor ssh worker-0                         an interactive login shell
  swactor ssh worker-0 -- uname -a             one command; its exit code is ssh's
  echo hi | swactor ssh worker-0 -- cat        stdin is forwarded, EOF included
  swactor ssh -t worker-0 -- top               a command that wants a terminal

Without CMD, and with -t, the command gets a terminal on the node and this
one is put in raw mode until it ends. Exits with the command's exit code
(128 + N for a signal), 1 when the node cannot be reached.")]
    Ssh(remote::SshArgs),
    /// Forward a local TCP port to a port on a node's 127.0.0.1.
    #[command(after_help = "Examples:
  swactor forward worker-0 8000            127.0.0.1:8000 here → worker-0's 127.0.0.1:8000
  swactor forward worker-0 0:8888          any free local port (printed) → 8888

Every connection is relayed through the daemon and the node's agent until
Ctrl-C. A connection the node refuses is closed and said on stderr; the
forward goes on.")]
    Forward(remote::ForwardArgs),
    /// Replay flight recordings over a fresh host and check that every
    /// answer is the one recorded.
    #[command(after_help = "Examples:
  swactor replay .swactor/flight/*.flight     every life of the daemon in that state directory
  swactor replay saved.flight                 a recording copied from another machine

A daemon writes one recording each time it starts, in STATE/flight/: every
input its cluster host was handed, with a digest of each answer. A replay
feeds the same inputs to a fresh host built by this binary, with no daemon,
provider or network. For each file it says what the recording is (the build
that wrote it, the run, when it started, how many inputs), then either that
every answer was as recorded or the first input answered otherwise (its
index, the input, the replay's answer). A recording that ends in a cut (the
daemon dropped what came later) is replayed up to the cut and said so; a
recording still being written is replayed up to its last whole input.
Progress goes to stderr every 2 seconds on long replays.

Exit codes: 0 every recording answered as recorded (cut or not), 1 a file
could not be read or is not a recording of this build's format (its version
and this build's are named), 4 a recording was answered otherwise than
recorded (this wins over 1 when files differ).")]
    Replay {
        /// The recordings (`*.flight`).
        #[arg(required = true, value_name = "FILE")]
        files: Vec<PathBuf>,
    },
    /// Tell why a node went the way it did: its decisions, replayed from
    /// the daemon's flight recordings.
    #[command(after_help = "Examples:
  swactor explain worker-1                        every decision the daemon made for it
  swactor explain worker-1 --at 14:02:10          up to that time of day (UTC)
  swactor explain worker-1 --at +90               up to 90 s after the first recording began
  swactor explain worker-1 --recording saved.flight

The recordings (by default every STATE/flight/*.flight, one per daemon start,
in the order they started; the one a running daemon writes may be read) are
replayed, and after every input the ladder is asked what it decides for the
node. Each time that changes, one line says when (UTC), at which input, the
ladder row and its action, then the facts it was decided on (the attempt,
its stage and intent, failures, the pending operation, the agent's link,
what comes next, why it failed, its last error and that error's kind) and
the input that brought the change about.

--at takes an RFC 3339 time, HH:MM:SS[.fff] in UTC on the first recording's
day, or +SECS after the first recording began.

Exit codes: 0 explained, 1 an error (no recordings, a node the recordings
do not know: the ones they know are named), 4 a recording was answered
otherwise than recorded (what follows that input is not explained).")]
    Explain {
        /// The node, e.g. worker-1.
        node: String,
        /// Stop at this time: RFC 3339, HH:MM:SS (UTC) or +SECS.
        #[arg(long, value_name = "TIME")]
        at: Option<String>,
        /// Read this recording instead of the state directory's (may be
        /// given more than once).
        #[arg(long, value_name = "FILE")]
        recording: Vec<PathBuf>,
    },
    /// Measure the real daemon: `bench swarm` joins N simulated agents to it.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// The node agent (started by providers, not by hand).
    #[command(hide = true)]
    Agent(agent::AgentOptions),
}

/// `swactor job …`.
#[derive(Debug, Subcommand)]
enum JobCommand {
    /// Replay a job's output, prefixed by node.
    Logs {
        /// The job (`job-3` or `3`).
        id: String,
        /// Only this node's output.
        #[arg(long)]
        node: Option<String>,
    },
    /// Copy a job's collected outputs to ./outputs/JOB/NODE/ (as `run` does
    /// when it sees the job end).
    Outputs {
        /// The job (`job-3` or `3`).
        id: String,
    },
    /// Cancel a job on every node it still runs on.
    Cancel {
        /// The job (`job-3` or `3`).
        id: String,
    },
}

fn main() {
    // `swactor job-exec --parent PID -- CMD…`: how an agent starts a run;
    // it becomes CMD before anything else starts (no runtime, no threads).
    let args: Vec<String> = std::env::args().collect();
    if let Some(code) = swactor_daemon::jobs::agent::exec_if_asked(&args) {
        std::process::exit(code);
    }
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            // Help and version are answers, not errors; every usage error
            // exits 1 like any other error, so 2 keeps its one meaning.
            std::process::exit(if e.use_stderr() { 1 } else { 0 });
        }
    };
    init_logging(&cli.command);
    // The daemon (and what it starts) and `ssh-key` write only into the
    // state directory, which is nobody else's.
    if matches!(
        cli.command,
        Command::Up { .. } | Command::SshKey | Command::Bench(bench::BenchCommand::SwarmDaemon(_))
    ) {
        state::StateDir::private_files_from_now_on();
    }
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
    let outcome = runtime.block_on(run_command(cli.command, state_dir));
    // Ending the runtime here stops any task still draining.
    drop(runtime);
    match outcome {
        Ok(code) => std::process::exit(code),
        Err(e) if closed_pipe(&e) => {
            // Output goes through `term::Stdout`, which takes a reader that
            // went away as the end of what is shown, so this is a command
            // cut short by some other pipe: 141, what a shell reports for a
            // SIGPIPE death, says so without a message nobody may read.
            std::process::exit(141);
        }
        Err(e) => {
            eprintln!("swactor: {}", words::cut_long_words(&format!("{e:#}")));
            std::process::exit(1);
        }
    }
}

/// Logs to stderr, filtered by `SWACTOR_LOG` and by what `command` shows in
/// its own words.
fn init_logging(command: &Command) {
    // The CLI's own messages say what went wrong with a request; what iroh
    // logs about the same connection (e.g. an endpoint dropped while a dial
    // to a stopped daemon was still pending) would only repeat it in its
    // own terms. The daemon and the agent keep iroh's warnings.
    let default_filter = match command {
        Command::Up { .. } | Command::Agent(_) => "warn",
        _ => "warn,iroh=off",
    };
    let mut filter = tracing_subscriber::EnvFilter::try_from_env("SWACTOR_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    // `up` shows every warning, hold and adoption of its cluster in its own
    // words (its progress lines, from the event stream): the cluster's log
    // lines that say the same again are kept off this terminal, whatever
    // SWACTOR_LOG asks for. `swactor watch` and telemetry.ndjson have them.
    if let Command::Up { .. } = command
        && let Ok(off) = format!("{}=off", swactor_actors::EVENT_LOG_TARGET).parse()
    {
        filter = filter.add_directive(off);
    }
    use tracing_subscriber::Layer;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    // Peers whose handshakes fail are logged by iroh one line each:
    // the first of a quiet spell is shown, the rest are counted and
    // summed up (see `handshakes`).
    let handshakes = handshakes::FailedHandshakes::global();
    // Asked at every event (a FilterFn would be asked once per callsite).
    let shown = tracing_subscriber::filter::DynFilterFn::new(move |meta, _| {
        !handshakes::FailedHandshakes::is_one(meta) || handshakes.first_of_a_spell()
    });
    tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                // Colours for people; none in a log file or a pipe.
                .with_ansi(std::io::stderr().is_terminal())
                .with_filter(shown)
                .with_filter(filter),
        )
        .init();
}

/// Runs one command to its end; returns the process exit code.
async fn run_command(command: Command, state_dir: PathBuf) -> anyhow::Result<i32> {
    match command {
        Command::Up {
            shape,
            until_converged,
            timeout,
            keep,
            yes,
            listen,
            advertise,
            agent_binary,
            http,
            adopt,
            fresh,
            etcd,
            etcd_prefix,
            lease_ttl,
            flight_max_mib,
        } => {
            let ha = daemon::HaOptions::from_args(&etcd, etcd_prefix, lease_ttl)?;
            daemon::up(daemon::UpOptions {
                shape,
                state_dir,
                listen,
                advertise,
                agent_binary,
                http,
                until_converged,
                timeout: up_timeout(timeout)?,
                keep,
                yes,
                unrecorded: unrecorded(adopt, fresh),
                providers: Vec::new(),
                ha,
                flight_max_bytes: flight_max_mib.saturating_mul(1 << 20),
            })
            .await
        }
        Command::Apply { shape, yes } => client::apply(&state_dir, &shape, yes).await.map(|()| 0),
        Command::Plan {
            shape,
            all,
            detailed_exitcode,
        } => {
            let work = client::plan(&state_dir, shape.as_deref(), all).await?;
            Ok(if detailed_exitcode && work { 2 } else { 0 })
        }
        Command::Validate { shape } => client::validate(&shape).map(|()| 0),
        Command::Status { json } => client::status(&state_dir, json).await.map(|()| 0),
        Command::Describe { node } => client::describe(&state_dir, &node).await.map(|()| 0),
        Command::Watch => client::watch(&state_dir).await.map(|()| 0),
        Command::SshKey => ssh_key(state_dir),
        Command::Pause => client::pause(&state_dir, true).await.map(|()| 0),
        Command::Resume => client::pause(&state_dir, false).await.map(|()| 0),
        Command::Replace { node } => client::replace(&state_dir, &node).await.map(|()| 0),
        Command::Down {
            keep,
            purge,
            yes: _,
        } => client::down(&state_dir, keep, purge).await.map(|()| 0),
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
        Command::Replay { files } => flight::replay_files(&files),
        Command::Explain {
            node,
            at,
            recording,
        } => flight::explain(
            &state_dir,
            &flight::ExplainOptions {
                node,
                at,
                recordings: recording,
            },
        ),
        Command::Run(args) => jobs::run(&state_dir, args).await,
        Command::Bench(bench::BenchCommand::Swarm(args)) => bench::swarm::swarm(args).await,
        Command::Bench(bench::BenchCommand::SwarmDaemon(args)) => {
            bench::swarm::daemon(state_dir, args).await
        }
        Command::Jobs { json } => jobs::list(&state_dir, json).await.map(|()| 0),
        Command::Job(JobCommand::Logs { id, node }) => {
            jobs::logs(&state_dir, &id, node).await.map(|()| 0)
        }
        Command::Job(JobCommand::Outputs { id }) => {
            jobs::outputs(&state_dir, &id).await.map(|()| 0)
        }
        Command::Job(JobCommand::Cancel { id }) => jobs::cancel(&state_dir, &id).await.map(|()| 0),
        Command::Ssh(args) => remote::ssh(&state_dir, args).await,
        Command::Forward(args) => remote::forward(&state_dir, args).await,
        Command::Agent(opts) => agent::run(opts).await,
    }
}

/// How long `up --until-converged` waits: `--timeout`, or its default.
fn up_timeout(timeout: Option<f64>) -> anyhow::Result<Duration> {
    let timeout = timeout.unwrap_or(UP_TIMEOUT_DEFAULT_S);
    if !timeout.is_finite() || timeout <= 0.0 {
        anyhow::bail!("--timeout must be a positive number of seconds, not {timeout}");
    }
    Ok(Duration::from_secs_f64(timeout))
}

/// What `up --adopt` or `--fresh` asks of an earlier run's resources.
fn unrecorded(adopt: bool, fresh: bool) -> Option<swactor_provisioning::Unrecorded> {
    match (adopt, fresh) {
        (true, _) => Some(swactor_provisioning::Unrecorded::Adopt),
        (_, true) => Some(swactor_provisioning::Unrecorded::Fresh),
        _ => None,
    }
}

/// `swactor ssh-key`: prints the public key of the state directory's SSH
/// identity, made on first use.
fn ssh_key(state_dir: PathBuf) -> anyhow::Result<i32> {
    let state = state::StateDir::create(state_dir)?;
    let identity =
        swactor_providers::ssh::SshIdentity::load_or_generate(&state.root().join("ssh"))?;
    use std::io::Write;
    writeln!(term::Stdout, "{}", identity.public_openssh())?;
    Ok(0)
}

/// Whether `e` comes from writing to a pipe whose reader is gone.
fn closed_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            || cause
                .downcast_ref::<serde_json::Error>()
                .and_then(serde_json::Error::io_error_kind)
                == Some(std::io::ErrorKind::BrokenPipe)
    })
}

#[cfg(test)]
mod allocator_tests {
    /// The build's jemalloc carries the tuning `.cargo/config.toml` gives
    /// it (`JEMALLOC_SYS_WITH_MALLOC_CONF`): built without it, a flood's
    /// memory stays pinned in thread caches and arenas.
    #[test]
    fn the_allocator_is_built_to_give_memory_back() {
        use tikv_jemalloc_ctl::opt;
        assert_eq!(opt::narenas::read().unwrap(), 1, "one arena");
        assert!(!opt::tcache::read().unwrap(), "no thread caches");
        assert!(opt::background_thread::read().unwrap(), "a purging thread");
    }
}
