//! Integration tests of the engine, in one binary so iroh links once.

mod blocking;
mod journal;
mod net;
mod net_limits;
mod supervision;
mod telemetry;
mod timers;

use std::future::Future;
use std::time::Duration;

/// Awaits `fut`, failing the test if it takes longer than `limit`.
pub async fn within<T>(limit: Duration, what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(limit, fut).await {
        Ok(value) => value,
        Err(_) => panic!("{what} did not finish within {limit:?}"),
    }
}

/// Polls `check` (yielding to the runtime between tries) until it holds.
pub async fn eventually(limit: Duration, what: &str, mut check: impl FnMut() -> bool) {
    within(limit, what, async {
        while !check() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
}
