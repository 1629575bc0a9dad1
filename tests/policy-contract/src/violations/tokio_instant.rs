//! Reading tokio's clock.

/// Reads the time.
pub fn run() -> u128 {
    let start = tokio::time::Instant::now(); // VIOLATION: tokio::time::Instant::now
    start.elapsed().as_nanos()
}
