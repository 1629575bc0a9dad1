//! Jobs: run a command on the cluster's nodes over `swactor/jobs/0`.
//!
//! The daemon side turns a `swactor run` into one job with one run per
//! (node, attempt): [`service`] takes requests and keeps the jobs' records,
//! [`runner`] holds the actors that drive them, and [`machine`] decides, as
//! plain data, what a run does next; [`blobs`] serves workspace chunks to
//! the agents over iroh-blobs; [`remote`] opens shells and forwards TCP
//! connections on a node over the same links (`swactor ssh`, `swactor
//! forward`). The agent side ([`agent`]) fetches the
//! chunks it lacks into its chunk store, materialises workspaces, runs
//! commands in their own process group and keeps each run's output and
//! exit status on disk until the daemon collects them. The wire types, the
//! workspace manifest, the output log format and what a run does next live
//! in the pure `swactor-jobs` crate, re-exported here. `docs/jobs.md` tells
//! the whole story.
//!
//! ```text
//! JobsActor                    one per daemon; records a job whose actor failed
//!  └── JobActor  job-N         owns the job's record and its timeout timer
//!       └── RunActor (N, node) ships, starts, follows, collects one run
//!            └── Forwarder     the agent's log and exit, as messages
//! ```

pub mod agent;
pub mod blobs;
pub mod remote;
pub mod runner;
pub mod service;

use std::path::{Path, PathBuf};

pub use swactor_jobs::machine;
pub use swactor_jobs::wire::*;

/// Every regular file under `root`, as sorted relative `/`-separated paths
/// (symbolic links and other special files are left out).
pub fn walk(root: &Path) -> std::io::Result<Vec<(String, PathBuf)>> {
    let mut out = Vec::new();
    let mut stack = vec![(String::new(), root.to_path_buf())];
    while let Some((rel, dir)) = stack.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let child_rel = if rel.is_empty() {
                name
            } else {
                format!("{rel}/{name}")
            };
            let kind = entry.file_type()?;
            if kind.is_dir() {
                stack.push((child_rel, entry.path()));
            } else if kind.is_file() {
                out.push((child_rel, entry.path()));
            }
        }
    }
    out.sort();
    Ok(out)
}
