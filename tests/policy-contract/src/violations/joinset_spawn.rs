//! A `JoinSet` is still a task spawner.

use tokio::task::JoinSet;

/// Spawns into a set.
pub fn run() {
    let mut set = JoinSet::new();
    set.spawn(async {}); // VIOLATION: tokio::task::JoinSet::spawn
}
