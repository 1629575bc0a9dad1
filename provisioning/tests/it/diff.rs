//! What a shape changes on a cluster: the counted diff and the full listing agree.

use crate::common;

use common::*;
use swactor_provisioning::*;

/// A ready node of slot `id`, made from `desired`'s template for it.
fn ready_node(desired: &DesiredState, id: &str, attempt: u64) -> ManagedNode {
    let mut n = ManagedNode::new(NodeAttemptId(attempt), template(desired, id), 0);
    n.record.stage = NodeStage::Dormant;
    n.record.ready = true;
    n
}

/// `group(id, count)` with another role: a template that makes other nodes.
fn other_role(id: &str, count: u32) -> GroupShape {
    GroupShape {
        role: "other".to_owned(),
        ..group(id, count)
    }
}

fn listed(changes: &[(LogicalNodeId, Change)]) -> Vec<String> {
    changes
        .iter()
        .map(|(id, c)| format!("{id} {c:?}"))
        .collect()
}

#[test]
fn every_change_lists_creates_replaces_and_destroys_in_slot_order() {
    // Running: a-0 a-1 (old template), b-0 b-1, d-0.
    let old = shape(1, vec![other_role("a", 2), group("b", 2), group("d", 1)])
        .validate()
        .unwrap();
    let mut state = ClusterState::new(RunId::new("run"), 1);
    for (i, id) in ["d-0", "b-1", "a-0", "b-0", "a-1"].iter().enumerate() {
        state
            .nodes
            .insert(node_id(id), ready_node(&old, id, i as u64 + 1));
    }
    // Wanted: a-0 a-1 a-2 (new template), b-0, c-0; no d.
    let next = shape(2, vec![group("a", 3), group("b", 1), group("c", 1)])
        .validate()
        .unwrap();
    assert_eq!(
        listed(&every_change(&state, &next)),
        [
            "a-0 Replace",
            "a-1 Replace",
            "a-2 Create",
            "b-1 Destroy",
            "c-0 Create",
            "d-0 Destroy",
        ]
    );
}

#[test]
fn a_node_destroyed_already_is_not_destroyed_again_and_unchanged_nodes_are_not_listed() {
    let old = shape(1, vec![group("w", 3)]).validate().unwrap();
    let mut state = ClusterState::new(RunId::new("run"), 1);
    for (i, id) in ["w-0", "w-1", "w-2"].iter().enumerate() {
        state
            .nodes
            .insert(node_id(id), ready_node(&old, id, i as u64 + 1));
    }
    let gone = state.nodes.get_mut(&node_id("w-2")).unwrap();
    gone.record.stage = NodeStage::Destroyed;
    gone.record.ready = false;
    let next = shape(2, vec![group("w", 1)]).validate().unwrap();
    assert_eq!(listed(&every_change(&state, &next)), ["w-1 Destroy"]);
    let counted = diff(&state, &next);
    assert_eq!((counted.destroy, counted.unchanged), (1, 1));
}

#[test]
fn the_listing_goes_past_the_diffs_examples_and_agrees_with_its_counts() {
    let many = u32::try_from(ShapeDiff::EXAMPLES_MAX).unwrap() + 50;
    let old = shape(1, vec![other_role("a", 30), group("z", 40)])
        .validate()
        .unwrap();
    let mut state = ClusterState::new(RunId::new("run"), 1);
    for (i, spec) in old.specs().enumerate() {
        let id = spec.node.to_string();
        state
            .nodes
            .insert(spec.node, ready_node(&old, &id, i as u64 + 1));
    }
    // a: every node replaced; m: every slot created; z: ten destroyed.
    let next = shape(2, vec![group("a", 30), group("m", many), group("z", 30)])
        .validate()
        .unwrap();
    let counted = diff(&state, &next);
    let every = every_change(&state, &next);
    let count = |c: Change| every.iter().filter(|(_, x)| *x == c).count() as u64;
    assert_eq!(
        (
            count(Change::Create),
            count(Change::Replace),
            count(Change::Destroy)
        ),
        (counted.create, counted.replace, counted.destroy)
    );
    assert_eq!(
        (counted.create, counted.replace, counted.destroy),
        (u64::from(many), 30, 10)
    );
    assert_eq!(counted.examples.len(), ShapeDiff::EXAMPLES_MAX);
    assert_eq!(every[..ShapeDiff::EXAMPLES_MAX], counted.examples[..]);
    assert!(
        every.windows(2).all(|w| w[0].0 < w[1].0),
        "in slot order, each slot once"
    );
}
