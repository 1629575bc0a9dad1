//! ractor's raw spawn bypasses supervision (defined in `tokio_primitives`).

/// Spawns a bare task through ractor.
pub fn run() {
    drop(ractor::concurrency::spawn(async {})); // VIOLATION: ractor::concurrency::spawn|ractor::concurrency::tokio_primitives::spawn
}
