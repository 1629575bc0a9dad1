//! `swactor bench …`: measurements of the real daemon, in the project.

pub(crate) mod sim;
pub(crate) mod swarm;

/// `swactor bench …`.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum BenchCommand {
    /// N simulated agents (each a real iroh endpoint with its own key)
    /// joined to a real daemon on loopback: time to join, the daemon's
    /// processor time and memory at rest, frames per second, and how long
    /// `status` and `/metrics` take. Ends with one JSON line.
    #[command(after_help = "Examples:
  swactor bench swarm --agents 1000 --secs 30
  swactor bench swarm --agents 10000 --secs 300 --freeze --flood 5000

The daemon runs in a child process (its processor time and memory are its
own); the agents run in this one. Exit code 0 when every agent joined and
none was shown disconnected while left alone, 1 otherwise.")]
    Swarm(swarm::SwarmArgs),
    /// The bench's daemon (started by `bench swarm`, not by hand).
    #[command(hide = true)]
    SwarmDaemon(swarm::DaemonArgs),
}
