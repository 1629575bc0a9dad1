//! A deadline is an engine timer in policy code.

use std::time::Duration;

/// Waits with a timeout.
pub async fn run() -> bool {
    tokio::time::timeout(Duration::from_millis(1), async {}).await.is_ok() // VIOLATION: tokio::time::timeout
}
