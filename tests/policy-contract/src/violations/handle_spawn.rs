//! Reaching the runtime through its handle is still spawning.

use tokio::runtime::Handle;

/// Spawns on the current runtime.
pub fn run() {
    drop(Handle::current().spawn(async {})); // VIOLATION: tokio::runtime::Handle::spawn
}
