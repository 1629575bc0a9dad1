//! What a policy crate may do: take time as an argument, keep ordered maps,
//! and talk to actors through references and messages.

use std::collections::BTreeMap;
use std::time::Duration;

use ractor::ActorRef;
use tokio::sync::mpsc;

/// A decision that only depends on its arguments.
pub fn deadline_ms(now_ms: u64, lease: Duration) -> u64 {
    now_ms.saturating_add(u64::try_from(lease.as_millis()).unwrap_or(u64::MAX))
}

/// Deterministic iteration order.
pub fn tally(words: &[&str]) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for word in words {
        *counts.entry((*word).to_owned()).or_insert(0) += 1;
    }
    counts
}

/// Sending a message is fine; only the engine starts tasks or timers.
pub fn notify(actor: &ActorRef<u64>, value: u64) -> bool {
    actor.send_message(value).is_ok()
}

/// Channels are plain data structures.
pub fn channel() -> (mpsc::Sender<u64>, mpsc::Receiver<u64>) {
    mpsc::channel(8)
}
