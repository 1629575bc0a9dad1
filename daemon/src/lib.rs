//! Swactor's daemon as a library, and the node agent's runtime.
//!
//! The `swactor` binary is a thin shell over this crate: it parses the
//! command line, renders what the CLI prints and calls in here. An embedder
//! can start the same daemon (see [`daemon`]) without copying the binary.
//!
//! ```text
//! daemon     `swactor up`: the journal, the host actors, the protocols, the lock
//! journal    the durable journal (redb) behind the reconciler's JournalStore
//! swarm      swactor/swarm/0: agents join with an attempt-bound key
//! control    swactor/control/0: apply, plan, status, watch, down, jobs
//! protocol   the control protocol's frames, shared with the CLI
//! http       the dashboard, the HTTP controls and the /metrics endpoint
//! metrics    what /metrics exposes: counters, histograms, the status collector
//! jobs       swactor/jobs/0 and iroh-blobs: jobs on the daemon and the agent
//! agent      the node agent: join, liveness, its end of the jobs protocol
//! shapefile  the TOML shape format, validated into the core's types
//! guard      what a change destroys or replaces, and asking first
//! replicas   the daemons of a run shared in etcd: addresses, who leads
//! state      the state directory: its files, tokens and the daemon lock
//! words      how states, sizes, times and costs read to a person
//! ```

pub mod agent;
pub mod agentbin;
pub mod control;
pub mod daemon;
pub mod guard;
pub mod handshakes;
pub mod http;
pub mod jobs;
pub mod journal;
pub mod metrics;
pub mod progress;
pub mod protocol;
pub(crate) mod renewals;
pub mod replicas;
pub mod shapefile;
pub mod state;
pub mod swarm;
pub mod term;
pub mod words;
