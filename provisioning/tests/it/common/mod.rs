//! Builders shared by the provisioning integration tests.
#![allow(dead_code, unreachable_pub)] // Each test binary uses a different subset.

use std::collections::BTreeMap;
use std::sync::Arc;
use swactor_provisioning::*;

pub fn t(ms: u64) -> Timestamp {
    Timestamp::from_millis(ms)
}

pub fn group(id: &str, count: u32) -> GroupShape {
    GroupShape {
        id: id.to_owned(),
        run_id: None,
        count,
        provider: ProviderShape {
            kind: "fake".to_owned(),
            params: BTreeMap::new(),
            placement: Default::default(),
        },
        boot: BootParams::default(),
        role: "worker".to_owned(),
        join: SwarmJoin::default(),
        limits: NodeLimits::default(),
        policy: Default::default(),
    }
}

pub fn shape(generation: u64, groups: Vec<GroupShape>) -> ClusterShape {
    ClusterShape {
        run_id: RunId::new("run"),
        generation: Generation(generation),
        groups,
        capacity: None,
        budget: None,
        lifetime: Default::default(),
    }
}

pub fn node_id(s: &str) -> LogicalNodeId {
    LogicalNodeId::parse(s).expect("valid node id")
}

pub fn template(desired: &DesiredState, node: &str) -> Arc<NodeTemplate> {
    desired.slot(&node_id(node)).expect("desired slot").clone()
}

pub fn config() -> ReconcilerConfig {
    ReconcilerConfig {
        jitter_permille: 0,
        ..ReconcilerConfig::default()
    }
}

pub fn driver() -> Driver {
    Driver::new(RunId::new("run"), config()).unwrap()
}

/// Runs passes until none is queued; returns every dispatch.
pub fn drain(d: &mut Driver, now: Timestamp) -> Vec<Dispatch> {
    let mut out = Vec::new();
    while let Some(pass) = d.poll_pass(now).unwrap() {
        assert!(pass.errors.is_empty(), "{:?}", pass.errors);
        out.extend(pass.dispatches);
        d.finish_pass().unwrap();
    }
    out
}

/// Drains a host's outputs at `now` as a daemon would (writes made
/// durable at once, an empty inventory) without answering any dispatch;
/// returns the dispatches, in order.
pub fn drain_host(h: &mut Host<Driver>, now: Timestamp) -> Vec<Dispatch> {
    let mut out = Vec::new();
    while let Some(o) = h.poll_output(now) {
        match o {
            Output::Persist(delta) => h.handle_persisted(delta.seq),
            Output::List => h.handle_inventory(Ok(Vec::new()), now),
            Output::Pass(pass) => out.extend(pass.dispatches),
            Output::Collect(_)
            | Output::Probe { .. }
            | Output::Folded(_)
            | Output::Reply(..)
            | Output::Stop => {}
        }
    }
    out
}

pub fn result(d: &Dispatch, outcome: OperationOutcome) -> OperationResult {
    OperationResult {
        node: d.key.node,
        op: d.op,
        outcome,
    }
}

pub fn fail(d: &Dispatch, class: FailureClass) -> OperationResult {
    result(
        d,
        OperationOutcome::Failed {
            class,
            reason: "injected".to_owned(),
        },
    )
}

/// The success outcome a well-behaved provider gives for `d`.
pub fn success(d: &Dispatch) -> OperationResult {
    let key = &d.key;
    let outcome = match &d.request {
        EffectRequest::CreateLease { .. } => OperationOutcome::LeaseCreated {
            lease: LeaseId::from(format!("lease-{key}")),
            endpoint: None,
        },
        EffectRequest::LookupEndpoint { .. } => OperationOutcome::EndpointFound {
            endpoint: NodeEndpoint::from(format!("ep-{key}")),
        },
        EffectRequest::StartBootstrap { .. } => OperationOutcome::BootstrapStarted {
            session: SessionId::from(format!("sess-{key}")),
        },
        EffectRequest::CancelBootstrap { .. } => OperationOutcome::BootstrapCancelled,
        EffectRequest::DestroyLease { .. } => OperationOutcome::LeaseDestroyed,
    };
    result(d, outcome)
}

pub fn observe(d: &Driver, node: &str, event: BootstrapEvent) -> BootstrapObservation {
    let n = &d.state().nodes[&node_id(node)];
    BootstrapObservation {
        node: node_id(node),
        attempt: n.attempt,
        session: n.record.session.clone().expect("live session"),
        event,
    }
}

/// The nodes whose bootstrap runs (their agents have not joined yet).
pub fn bootstrapping(d: &Driver) -> Vec<String> {
    d.state()
        .nodes
        .iter()
        .filter(|(_, n)| n.record.stage == NodeStage::BootstrapRunning)
        .map(|(id, _)| id.to_string())
        .collect()
}

/// The agent of `node` joins and reports converged: what each fold did.
pub fn join(d: &mut Driver, node: &str, now: Timestamp) -> Vec<Folded> {
    [
        BootstrapEvent::SwactorJoined,
        BootstrapEvent::Stage(BootstrapStage::Converged),
    ]
    .into_iter()
    .map(|ev| {
        let o = observe(d, node, ev);
        d.handle_bootstrap(o, now).unwrap()
    })
    .collect()
}

/// Drives every node to ready with a perfectly behaved provider.
pub fn converge(d: &mut Driver, now: Timestamp) {
    for _ in 0..32 {
        let dispatches = drain(d, now);
        if dispatches.is_empty() && !d.is_pass_queued() {
            let joined = bootstrapping(d);
            if joined.is_empty() {
                break;
            }
            for id in joined {
                for folded in join(d, &id, now) {
                    assert_eq!(folded, Folded::Applied);
                }
            }
            continue;
        }
        for disp in dispatches {
            assert_eq!(
                d.handle_result(success(&disp), now).unwrap(),
                Folded::Applied
            );
        }
    }
    assert!(d.is_converged(), "did not converge: {:#?}", d.state());
}

/// Runs a host's outputs at `now` with a well-behaved provider, until
/// nothing more is dispatched: writes are durable at once (and kept in
/// `journal`, if given), the inventory is `listed`, every dispatch
/// succeeds, and a started bootstrap's agent joins and converges. Each
/// probe the host asks for is pushed onto `probes`, unanswered. Returns
/// the dispatches, in order.
pub fn pump_host(
    h: &mut Host<Driver>,
    mut journal: Option<&mut JournalImage>,
    listed: &[Listed],
    probes: &mut Vec<(ResourceKey, LeaseId)>,
    now: Timestamp,
) -> Vec<Dispatch> {
    let mut log = Vec::new();
    for _ in 0..64 {
        let mut round = Vec::new();
        while let Some(o) = h.poll_output(now) {
            match o {
                Output::Persist(delta) => {
                    if let Some(j) = journal.as_deref_mut() {
                        j.apply(&delta);
                    }
                    h.handle_persisted(delta.seq);
                }
                Output::List => h.handle_inventory(Ok(listed.to_vec()), now),
                Output::Pass(pass) => round.extend(pass.dispatches),
                Output::Probe { key, lease } => probes.push((key, lease)),
                Output::Collect(_) | Output::Folded(_) | Output::Reply(..) | Output::Stop => {}
            }
        }
        if round.is_empty() {
            break;
        }
        for d in &round {
            let _ = h.handle_result(success(d), now).unwrap();
            if d.request.kind() == EffectKind::StartBootstrap {
                h.handle_agent_joined(&d.key, now).unwrap();
                let n = &h.core().state().nodes[&d.key.node];
                let obs = BootstrapObservation {
                    node: d.key.node,
                    attempt: n.attempt,
                    session: n.record.session.clone().expect("a live session"),
                    event: BootstrapEvent::Stage(BootstrapStage::Converged),
                };
                let _ = h.handle_bootstrap(obs, now).unwrap();
            }
        }
        log.extend(round);
    }
    log
}
