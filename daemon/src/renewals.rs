//! When the daemon last renewed each node's lease, for the views: what
//! `status`, `describe` and the dashboard show as `renewed 2 s ago`.
//!
//! The swarm notes a renewal once its frame was sent (the welcome is the
//! first); a view asks at the moment it answers. One entry per slot (its
//! latest attempt's), so the table never outgrows the cluster.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;
use swactor_actors::NodeSummary;
use swactor_provisioning::{LogicalNodeId, NodeAttemptId, ResourceKey};

/// The last renewal of each slot's lease, shared by the swarm (which
/// writes) and the views (which read).
#[derive(Clone, Debug, Default)]
pub(crate) struct Renewals(Arc<Mutex<HashMap<LogicalNodeId, (NodeAttemptId, Instant)>>>);

impl Renewals {
    /// `key`'s lease was renewed just now.
    pub(crate) fn renewed(&self, key: &ResourceKey) {
        let now = Instant::now();
        let mut map = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let entry = map.entry(key.node).or_insert((key.attempt, now));
        // An older attempt's agent, still connected, never hides the newer's.
        if key.attempt >= entry.0 {
            *entry = (key.attempt, now);
        }
    }

    /// Fills in how long ago each node's current attempt had its lease
    /// renewed; a node whose attempt was never renewed by this daemon is
    /// left empty.
    pub(crate) fn fill<'a>(&self, nodes: impl IntoIterator<Item = &'a mut NodeSummary>) {
        let map = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        for n in nodes {
            n.lease_renewed_ms_ago = map
                .get(&n.node)
                .filter(|(attempt, _)| *attempt == n.attempt)
                .map(|(_, at)| u64::try_from(at.elapsed().as_millis()).unwrap_or(u64::MAX));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use swactor_provisioning::RunId;

    fn summary(node: &str, attempt: u64) -> NodeSummary {
        NodeSummary {
            node: LogicalNodeId::parse(node).unwrap(),
            attempt: NodeAttemptId(attempt),
            stage: swactor_provisioning::NodeStage::Dormant,
            intent: swactor_provisioning::Intent::Active,
            ready: true,
            pending: None,
            failures: 0,
            last_error: None,
            last_cause: None,
            next_retry_at: None,
            agent: swactor_actors::AgentLink::Connected,
            lease: None,
            resource: None,
            next: swactor_provisioning::NextStep::Nothing,
            orphan_after_s: 5,
            lease_renewed_ms_ago: None,
        }
    }

    #[test]
    fn only_the_current_attempts_renewal_is_shown() {
        let r = Renewals::default();
        let key = |node: &str, attempt| ResourceKey {
            run_id: RunId::new("r"),
            node: LogicalNodeId::parse(node).unwrap(),
            attempt: NodeAttemptId(attempt),
        };
        r.renewed(&key("w-0", 2));
        r.renewed(&key("w-0", 1));
        let mut nodes = [summary("w-0", 2), summary("w-1", 1), summary("w-0", 1)];
        r.fill(&mut nodes);
        assert!(nodes[0].lease_renewed_ms_ago.is_some_and(|ms| ms < 10_000));
        assert_eq!(nodes[1].lease_renewed_ms_ago, None, "never renewed");
        assert_eq!(nodes[2].lease_renewed_ms_ago, None, "an older attempt");
    }
}
