//! A periodic tick is an engine timer in policy code.

use std::time::Duration;

/// Ticks once.
pub async fn run() {
    let mut ticks = tokio::time::interval(Duration::from_millis(1)); // VIOLATION: tokio::time::interval
    ticks.tick().await;
}
