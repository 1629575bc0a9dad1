//! A deadline is an engine timer in policy code.

use std::time::Duration;

use tokio::time::timeout;

/// Waits with a timeout.
pub async fn run() -> bool {
    let waited = timeout(Duration::from_millis(1), async {}); // VIOLATION: tokio::time::timeout
    waited.await.is_ok()
}
