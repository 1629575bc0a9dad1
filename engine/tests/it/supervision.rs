//! Supervision with a restart budget, under paused time.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use swactor_engine::{ChildEvent, ChildSpec, Children, RestartPolicy};
use tokio::sync::mpsc;

enum ChildMsg {
    Panic,
    Ping(RpcReplyPort<usize>),
}

/// A child that panics on demand and counts its starts.
struct Flaky;

impl Actor for Flaky {
    type Msg = ChildMsg;
    type State = usize;
    type Arguments = Arc<AtomicUsize>;

    async fn pre_start(
        &self,
        _myself: ActorRef<ChildMsg>,
        starts: Arc<AtomicUsize>,
    ) -> Result<usize, ActorProcessingErr> {
        Ok(starts.fetch_add(1, Ordering::SeqCst) + 1)
    }

    async fn handle(
        &self,
        _myself: ActorRef<ChildMsg>,
        msg: ChildMsg,
        generation: &mut usize,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ChildMsg::Panic => panic!("flaky child asked to panic"),
            ChildMsg::Ping(reply) => {
                let _ = reply.send(*generation);
            }
        }
        Ok(())
    }
}

enum ParentMsg {
    FailChild,
    PingChild(RpcReplyPort<Option<usize>>),
}

type Report = Result<ChildEvent, String>;

struct Parent {
    policy: RestartPolicy,
}

struct ParentState {
    children: Children,
    reports: mpsc::UnboundedSender<Report>,
}

impl Actor for Parent {
    type Msg = ParentMsg;
    type State = ParentState;
    type Arguments = (Arc<AtomicUsize>, mpsc::UnboundedSender<Report>);

    async fn pre_start(
        &self,
        myself: ActorRef<ParentMsg>,
        (starts, reports): Self::Arguments,
    ) -> Result<ParentState, ActorProcessingErr> {
        let mut children = Children::new();
        let spec = ChildSpec::new("flaky", self.policy, move || (Flaky, starts.clone()));
        children.start(&myself.get_cell(), spec).await?;
        Ok(ParentState { children, reports })
    }

    async fn handle(
        &self,
        _myself: ActorRef<ParentMsg>,
        msg: ParentMsg,
        state: &mut ParentState,
    ) -> Result<(), ActorProcessingErr> {
        let child = state.children.get::<ChildMsg>("flaky");
        match msg {
            ParentMsg::FailChild => {
                if let Some(child) = child {
                    let _ = child.cast(ChildMsg::Panic);
                }
            }
            ParentMsg::PingChild(reply) => {
                let generation = match child {
                    Some(child) => ractor::call!(child, ChildMsg::Ping).ok(),
                    None => None,
                };
                let _ = reply.send(generation);
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<ParentMsg>,
        event: SupervisionEvent,
        state: &mut ParentState,
    ) -> Result<(), ActorProcessingErr> {
        let outcome = state
            .children
            .handle_event(&myself.get_cell(), &event)
            .await;
        let _ = state.reports.send(
            outcome
                .as_ref()
                .map(Clone::clone)
                .map_err(ToString::to_string),
        );
        outcome?;
        Ok(())
    }
}

/// Watches the parent and records how it ended.
struct GrandParent;

impl Actor for GrandParent {
    type Msg = ();
    type State = mpsc::UnboundedSender<String>;
    type Arguments = mpsc::UnboundedSender<String>;

    async fn pre_start(
        &self,
        _myself: ActorRef<()>,
        tx: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(tx)
    }

    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<()>,
        event: SupervisionEvent,
        tx: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match event {
            SupervisionEvent::ActorFailed(_, error) => {
                let _ = tx.send(format!("failed: {error}"));
            }
            SupervisionEvent::ActorTerminated(_, _, reason) => {
                let _ = tx.send(format!("terminated: {reason:?}"));
            }
            _ => {}
        }
        Ok(())
    }
}

struct Harness {
    parent: ActorRef<ParentMsg>,
    grandparent: ActorRef<()>,
    starts: Arc<AtomicUsize>,
    reports: mpsc::UnboundedReceiver<Report>,
    endings: mpsc::UnboundedReceiver<String>,
}

async fn harness(policy: RestartPolicy) -> Harness {
    let (ending_tx, endings) = mpsc::unbounded_channel();
    let (grandparent, _) = Actor::spawn(None, GrandParent, ending_tx).await.unwrap();
    let starts = Arc::new(AtomicUsize::new(0));
    let (report_tx, reports) = mpsc::unbounded_channel();
    let (parent, _) = Actor::spawn_linked(
        None,
        Parent { policy },
        (starts.clone(), report_tx),
        grandparent.get_cell(),
    )
    .await
    .unwrap();
    Harness {
        parent,
        grandparent,
        starts,
        reports,
        endings,
    }
}

impl Harness {
    /// Makes the child panic and returns what supervision did about it.
    async fn fail_child(&mut self) -> Report {
        self.parent.cast(ParentMsg::FailChild).unwrap();
        loop {
            let report = crate::within(
                Duration::from_secs(5),
                "supervision report",
                self.reports.recv(),
            )
            .await
            .expect("parent alive");
            // Started events for the new child are incidental here.
            if !matches!(report, Ok(ChildEvent::Started { .. })) {
                return report;
            }
        }
    }

    async fn ping(&self) -> Option<usize> {
        ractor::call!(self.parent, ParentMsg::PingChild).unwrap()
    }
}

fn policy() -> RestartPolicy {
    RestartPolicy {
        restarts_max: 2,
        window: Duration::from_secs(10),
    }
}

#[tokio::test(start_paused = true)]
async fn a_panicking_child_is_restarted() {
    let mut h = harness(policy()).await;
    assert_eq!(h.ping().await, Some(1));
    let report = h.fail_child().await;
    assert_eq!(
        report,
        Ok(ChildEvent::Restarted {
            label: "flaky".into(),
            failures: 1
        })
    );
    assert_eq!(h.ping().await, Some(2), "a fresh child answers");
    assert_eq!(h.starts.load(Ordering::SeqCst), 2);
    h.parent.stop(None);
    h.grandparent.stop(None);
}

#[tokio::test(start_paused = true)]
async fn the_failure_after_the_budget_within_the_window_escalates_to_the_parent() {
    let mut h = harness(policy()).await;
    for expected in 1..=2 {
        let report = h.fail_child().await;
        assert_eq!(
            report,
            Ok(ChildEvent::Restarted {
                label: "flaky".into(),
                failures: expected
            })
        );
        tokio::time::advance(Duration::from_secs(1)).await;
    }
    let report = h.fail_child().await;
    let error = report.unwrap_err();
    assert!(error.contains("failed 3 times within 10s"), "{error}");
    // The parent fails with the escalation and its own supervisor hears it.
    let ending = crate::within(Duration::from_secs(5), "parent ending", h.endings.recv())
        .await
        .unwrap();
    assert!(
        ending.starts_with("failed: ") && ending.contains("escalating"),
        "{ending}"
    );
    assert_eq!(
        h.starts.load(Ordering::SeqCst),
        3,
        "no restart after escalation"
    );
    h.grandparent.stop(None);
}

#[tokio::test(start_paused = true)]
async fn failures_spaced_beyond_the_window_never_escalate() {
    let mut h = harness(policy()).await;
    for _ in 0..5 {
        let report = h.fail_child().await;
        assert_eq!(
            report,
            Ok(ChildEvent::Restarted {
                label: "flaky".into(),
                failures: 1
            })
        );
        tokio::time::advance(Duration::from_secs(11)).await;
    }
    assert_eq!(h.ping().await, Some(6));
    assert!(h.endings.try_recv().is_err(), "parent still running");
    h.parent.stop(None);
    h.grandparent.stop(None);
}

#[test]
fn a_zero_window_policy_is_rejected() {
    let policy = RestartPolicy {
        restarts_max: 1,
        window: Duration::ZERO,
    };
    assert!(policy.validate().is_err());
}
