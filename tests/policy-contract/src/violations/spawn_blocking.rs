//! Blocking work is the engine's blocking substrate's job.

/// Runs a closure on a blocking thread.
pub fn run() {
    drop(tokio::task::spawn_blocking(|| 1)); // VIOLATION: tokio::task::spawn_blocking
}
