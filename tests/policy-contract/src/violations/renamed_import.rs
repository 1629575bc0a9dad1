//! Renaming the import does not hide `tokio::spawn` (clippy names it by its
//! definition, `tokio::task::spawn`).

use tokio::spawn as go;

/// Starts a task under another name.
pub fn run() {
    drop(go(async {})); // VIOLATION: tokio::spawn|tokio::task::spawn
}
