//! Re-exporting through a helper module does not hide `tokio::time::sleep`.

use std::time::Duration;

mod helpers {
    pub use tokio::time::sleep as nap;
}

/// Sleeps through the helper.
pub async fn run() {
    helpers::nap(Duration::from_millis(1)).await; // VIOLATION: tokio::time::sleep
}
