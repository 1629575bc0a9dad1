//! Executor workers: run provider I/O for the driver under the idempotent-executor contract.
//!
//! # Guarantees
//! - **Deduplicated by operation id.** A completed operation submitted again
//!   is not run again: its recorded outcome is replayed. An id reused with a
//!   different request is refused and not run.
//! - **At most one running operation per attempt.** The driver routes every
//!   operation of an attempt to the same worker, and a worker runs one
//!   operation at a time.
//! - **Deadlines.** A provider call still running at the operation's deadline
//!   is dropped (cancelled) and reported ambiguous, so its late completion is
//!   never observed.
//! - **Never blocks the driver.** Provider calls are awaited here, in the
//!   worker, never in the driver.
//! - **Batched both ways.** The driver hands a worker a pass's operations
//!   for its lane in messages of at most [`BATCH_MAX`], and the worker runs
//!   them in order. Results that are ready without waiting (a provider that
//!   answers at once) are reported together, one message per batch; before
//!   the worker waits on a provider call it first reports everything it
//!   holds, so a slow call never delays the results of earlier ones. After
//!   each batch the worker lets the driver run, so a large pass flows
//!   through in steps rather than being held whole, twice over.
//! - **A session is always handed over.** A StartBootstrap submitted again is
//!   run again rather than replayed: the provider adopts the running session
//!   and hands its stream over once more (a replayed outcome would carry no
//!   stream, and the node would wait out its stall deadline).
//!
//! Workers report through their own message type, [`ExecutorReport`]; they
//! know nothing of the actor they report to.

// The replay index is a hash map: with a fixed hasher (no `RandomState`), and
// never iterated, so nothing depends on an order (the reason the policy
// lints forbid it elsewhere). A B-tree there cost 5% of the converge.
#[allow(
    clippy::disallowed_types,
    reason = "a fixed hasher, never iterated: see `History::index`"
)]
use std::collections::HashMap;
use std::collections::VecDeque;
use std::future::Future;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::task::Poll;
use swactor_engine::ractor::{Actor, ActorProcessingErr, ActorRef, DerivedActorRef};
use swactor_engine::{Clock, run_until, yield_to_others};
use swactor_providers::{BootstrapEvents, Inventory, OwnedResources, Provider, ProviderError};
use swactor_provisioning::{
    Dispatch, EffectRequest, FailureClass, LeaseId, OperationId, OperationOutcome, OperationResult,
    Release, ResourceKey, RunId,
};

/// The most operations the driver hands a worker in one message. A large
/// pass goes out in several, and the worker reports each one's results and
/// lets the driver run before it takes the next: a 100k pass is never held
/// twice (as the driver's batches and the worker's results) at once.
pub(crate) const BATCH_MAX: usize = 1024;

/// A message to an executor worker.
pub enum WorkerMsg {
    /// Run recorded operations, in order.
    Execute(Vec<Dispatch>),
    /// List what the provider holds for a run (for adoption).
    List(RunId),
    /// Destroy what an orphaned key holds (cancel its session, then its lease).
    Collect(ResourceKey, OwnedResources),
    /// Ask whether an away agent's machine is paused by its provider.
    Probe(ResourceKey, LeaseId),
    /// Test hook: fail this worker as if a provider call had panicked.
    Crash,
}

/// What a worker reports.
#[derive(Debug)]
pub enum ExecutorReport {
    /// Operations finished, in the order they finished.
    Finished(Vec<Finished>),
    /// The provider's inventory, for adoption and sweeps.
    Listed(Result<Inventory, ProviderError>),
    /// An orphan was collected (or not).
    Collected(ResourceKey, Result<Release, ProviderError>),
    /// Whether that machine is paused by its provider.
    Probed(ResourceKey, Result<bool, ProviderError>),
}

/// What a worker reports back for one operation.
#[derive(Debug)]
pub struct Finished {
    /// Index of the worker that ran it.
    pub worker: usize,
    /// The result to fold.
    pub result: OperationResult,
    /// The session's observation stream, for a bootstrap that started.
    pub events: Option<BootstrapEvents>,
}

/// Start arguments of a worker.
pub struct WorkerArgs {
    /// The worker's index in the pool (the driver routes by it).
    pub index: usize,
    /// Where results go.
    pub driver: DerivedActorRef<ExecutorReport>,
    /// The provider to call.
    pub provider: Arc<dyn Provider>,
    /// The engine clock (deadlines are milliseconds on it).
    pub clock: Clock,
    /// Completed operations remembered for replay.
    pub history_len_max: usize,
}

/// A worker's state.
pub struct WorkerState {
    args: WorkerArgs,
    /// Results not reported yet (see the module docs on batching).
    outbox: Vec<Finished>,
    history: History,
}

/// The last completed operations of a worker, for replay: a ring in
/// completion order (the oldest leaves first) and an index from operation
/// id to position in it. Entries never move while they are kept, so
/// remembering one is a push and an index insert, whatever their size.
struct History {
    len_max: usize,
    /// Completed operations, oldest first; a forgotten one stays as `None`
    /// until its turn to leave.
    ring: VecDeque<Option<(OperationId, EffectRequest, OperationOutcome)>>,
    /// Where each kept operation is: its number, counting every entry ever
    /// put in the ring. Looked up, inserted and removed by id, never
    /// iterated, and hashed with a fixed hasher: deterministic.
    #[allow(clippy::disallowed_types, reason = "a fixed hasher, never iterated")]
    index: HashMap<OperationId, u64, BuildHasherDefault<OpHasher>>,
    /// The number of the ring's front entry.
    front: u64,
}

impl History {
    fn new(len_max: usize) -> Self {
        Self {
            len_max,
            ring: VecDeque::new(),
            #[allow(clippy::disallowed_types, reason = "a fixed hasher, never iterated")]
            index: HashMap::default(),
            front: 0,
        }
    }

    fn get(&self, op: &OperationId) -> Option<&(OperationId, EffectRequest, OperationOutcome)> {
        let at = self.position(*self.index.get(op)?)?;
        self.ring.get(at)?.as_ref()
    }

    /// Where entry number `n` is in the ring.
    fn position(&self, n: u64) -> Option<usize> {
        usize::try_from(n.checked_sub(self.front)?).ok()
    }

    /// Empties the ring's entry number `n` (it leaves in its turn).
    fn clear_entry(&mut self, n: u64) {
        if let Some(slot) = self.position(n).and_then(|at| self.ring.get_mut(at)) {
            *slot = None;
        }
    }

    /// Forgets `op` (it runs again if submitted again).
    fn forget(&mut self, op: &OperationId) {
        if let Some(n) = self.index.remove(op) {
            self.clear_entry(n);
        }
    }

    /// Remembers a completed operation, letting the oldest go past `len_max`.
    fn remember(&mut self, op: OperationId, request: EffectRequest, outcome: OperationOutcome) {
        if self.len_max == 0 {
            return;
        }
        while self.ring.len() >= self.len_max {
            if let Some(Some((old, _, _))) = self.ring.pop_front() {
                self.index.remove(&old);
            }
            self.front += 1;
        }
        let n = self.front + self.ring.len() as u64;
        self.ring.push_back(Some((op, request, outcome)));
        if let Some(old) = self.index.insert(op, n) {
            // Remembered again (the driver does not do that): the older
            // entry is no longer what the id names.
            self.clear_entry(old);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.index.len()
    }
}

/// Hashes an [`OperationId`] (two integers the driver made, so nothing an
/// outsider chooses) with one multiply per word, as rustc's `FxHasher` does.
#[derive(Default)]
struct OpHasher(u64);

impl Hasher for OpHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b));
        }
    }

    fn write_u64(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0xf135_7aea_2e62_a9c5);
    }
}

/// The worker actor (a unit struct: all state is in [`WorkerState`]).
pub struct ExecutorWorker;

impl Actor for ExecutorWorker {
    type Msg = WorkerMsg;
    type State = WorkerState;
    type Arguments = WorkerArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<WorkerMsg>,
        args: WorkerArgs,
    ) -> Result<WorkerState, ActorProcessingErr> {
        let history = History::new(args.history_len_max);
        Ok(WorkerState {
            args,
            outbox: Vec::new(),
            history,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<WorkerMsg>,
        msg: WorkerMsg,
        state: &mut WorkerState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            WorkerMsg::Execute(batch) => {
                debug_assert!(
                    !batch.is_empty() && batch.len() <= BATCH_MAX,
                    "the driver sends batches of 1..=BATCH_MAX operations"
                );
                state.outbox.reserve(batch.len());
                for dispatch in batch {
                    state.execute(dispatch).await;
                }
                state.flush();
                // The driver folds these before this worker takes its next
                // batch: results and the operations they lead to flow on
                // instead of piling up behind a large pass.
                yield_to_others().await;
            }
            WorkerMsg::List(run_id) => {
                let listed = state.args.provider.list(&run_id).await;
                let _ = state
                    .args
                    .driver
                    .send_message(ExecutorReport::Listed(listed));
            }
            WorkerMsg::Collect(key, owned) => {
                let p = &state.args.provider;
                let mut outcome = Ok(Release::Done);
                if let Some(session) = &owned.session {
                    outcome = p.cancel_bootstrap(&key, session).await;
                }
                if let (Ok(cancelled), Some(lease)) = (&outcome, &owned.lease) {
                    // A session given up leaves its lease to destroy; the
                    // collection is given up if either release was.
                    let cancelled = cancelled.clone();
                    outcome = p.destroy_lease(&key, lease).await.map(|destroyed| {
                        match (destroyed, cancelled) {
                            (Release::Done, Release::Done) => Release::Done,
                            (Release::GivenUp(why), _) | (_, Release::GivenUp(why)) => {
                                Release::GivenUp(why)
                            }
                        }
                    });
                }
                let _ = state
                    .args
                    .driver
                    .send_message(ExecutorReport::Collected(key, outcome));
            }
            WorkerMsg::Probe(key, lease) => {
                let paused = state.args.provider.paused(&key, &lease).await;
                let _ = state
                    .args
                    .driver
                    .send_message(ExecutorReport::Probed(key, paused));
            }
            WorkerMsg::Crash => return Err("executor worker asked to crash".into()),
        }
        Ok(())
    }
}

impl WorkerState {
    fn send(&mut self, result: OperationResult, events: Option<BootstrapEvents>) {
        self.outbox.push(Finished {
            worker: self.args.index,
            result,
            events,
        });
    }

    /// Reports every result held.
    fn flush(&mut self) {
        if self.outbox.is_empty() {
            return;
        }
        let batch = std::mem::take(&mut self.outbox);
        // The driver being gone means the cluster is shutting down; nothing to do.
        let _ = self
            .args
            .driver
            .send_message(ExecutorReport::Finished(batch));
    }

    async fn execute(&mut self, d: Dispatch) {
        let restart = matches!(d.request, EffectRequest::StartBootstrap { .. })
            && self
                .history
                .get(&d.op)
                .is_some_and(|(_, r, _)| *r == d.request);
        if restart {
            // Run it again: the provider adopts the session and hands its stream over.
            self.history.forget(&d.op);
        }
        if let Some((_, request, outcome)) = self.history.get(&d.op) {
            let outcome = if *request == d.request {
                outcome.clone()
            } else {
                tracing::error!(op = %d.op, "operation id reused with a different request; refused");
                OperationOutcome::Failed {
                    class: FailureClass::Definite,
                    reason: "operation id reused with a different request; not run".to_owned(),
                }
            };
            let result = OperationResult {
                node: d.key.node,
                op: d.op,
                outcome,
            };
            self.send(result, None);
            return;
        }
        let provider = self.args.provider.clone();
        let done = {
            let mut call = std::pin::pin!(run(&*provider, &d));
            // One poll first: a call that is done at once joins the batch
            // (no time passed, so no deadline did); one that must wait sends
            // what the batch holds, then waits under the deadline.
            let first = std::future::poll_fn(|cx| Poll::Ready(call.as_mut().poll(cx))).await;
            match first {
                Poll::Ready(done) => Ok(done),
                Poll::Pending => {
                    self.flush();
                    let deadline = self.args.clock.at_ms(d.deadline.as_millis());
                    run_until(deadline, call).await
                }
            }
        };
        let (outcome, events) = match done {
            Ok(done) => done,
            Err(_) => (
                OperationOutcome::Failed {
                    class: FailureClass::Ambiguous,
                    reason: "provider call still running at the operation's deadline".to_owned(),
                },
                None,
            ),
        };
        self.history.remember(d.op, d.request, outcome.clone());
        let result = OperationResult {
            node: d.key.node,
            op: d.op,
            outcome,
        };
        self.send(result, events);
    }
}

fn failed(e: ProviderError) -> OperationOutcome {
    match e {
        // The host keeps the words for people; the kind is counted where
        // the error is seen (`/metrics`).
        ProviderError::Definite(fault) => OperationOutcome::Failed {
            class: FailureClass::Definite,
            reason: fault.to_string(),
        },
        ProviderError::Ambiguous(fault) => OperationOutcome::Failed {
            class: FailureClass::Ambiguous,
            reason: fault.to_string(),
        },
        ProviderError::Gone(fault) => OperationOutcome::Failed {
            class: FailureClass::LeaseGone,
            reason: fault.to_string(),
        },
        // Only a lookup may say "not ready"; from anything else it means the
        // provider is confused, and nothing can be promised about the effect.
        ProviderError::NotReady => OperationOutcome::Failed {
            class: FailureClass::Ambiguous,
            reason: "provider answered 'not ready' to a call that has no such answer".to_owned(),
        },
    }
}

async fn run(p: &dyn Provider, d: &Dispatch) -> (OperationOutcome, Option<BootstrapEvents>) {
    let key = &d.key;
    match &d.request {
        EffectRequest::CreateLease { template } => match p.create_lease(key, template).await {
            Ok(g) => (
                OperationOutcome::LeaseCreated {
                    lease: g.lease,
                    endpoint: g.endpoint,
                },
                None,
            ),
            Err(e) => (failed(e), None),
        },
        EffectRequest::LookupEndpoint { lease } => match p.lookup_endpoint(key, lease).await {
            Ok(endpoint) => (OperationOutcome::EndpointFound { endpoint }, None),
            Err(ProviderError::NotReady) => (OperationOutcome::EndpointNotReady, None),
            Err(e) => (failed(e), None),
        },
        EffectRequest::StartBootstrap {
            lease,
            endpoint,
            template,
        } => match p.start_bootstrap(key, lease, endpoint, template).await {
            Ok(s) => (
                OperationOutcome::BootstrapStarted { session: s.session },
                Some(s.events),
            ),
            Err(e) => (failed(e), None),
        },
        EffectRequest::CancelBootstrap { session } => {
            match p.cancel_bootstrap(key, session).await {
                Ok(release) => (OperationOutcome::cancelled(release), None),
                Err(e) => (failed(e), None),
            }
        }
        EffectRequest::DestroyLease {
            lease,
            failed: failure,
        } => {
            let destroyed = match failure {
                Some(why) => p.destroy_failed_lease(key, lease, why).await,
                None => p.destroy_lease(key, lease).await,
            };
            match destroyed {
                Ok(release) => (OperationOutcome::destroyed(release), None),
                Err(e) => (failed(e), None),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use swactor_provisioning::{LeaseId, NodeAttemptId};

    fn op(attempt: u64, seq: u64) -> OperationId {
        OperationId {
            attempt: NodeAttemptId(attempt),
            seq,
        }
    }

    fn lookup(lease: &str) -> EffectRequest {
        EffectRequest::LookupEndpoint {
            lease: LeaseId::new(lease),
        }
    }

    #[test]
    fn the_history_replays_what_it_keeps_and_lets_the_oldest_go() {
        let mut h = History::new(3);
        for i in 0..5 {
            h.remember(
                op(i, 0),
                lookup(&format!("l{i}")),
                OperationOutcome::LeaseDestroyed,
            );
        }
        assert_eq!(h.len(), 3);
        assert!(h.get(&op(0, 0)).is_none() && h.get(&op(1, 0)).is_none());
        for i in 2..5 {
            let (id, request, outcome) = h.get(&op(i, 0)).expect("kept");
            assert_eq!(*id, op(i, 0));
            assert_eq!(*request, lookup(&format!("l{i}")));
            assert_eq!(*outcome, OperationOutcome::LeaseDestroyed);
        }
        assert_eq!(h.ring.len(), 3, "the ring never outgrows its bound");
    }

    #[test]
    fn a_forgotten_operation_is_not_replayed_and_its_place_still_counts() {
        let mut h = History::new(2);
        h.remember(op(1, 0), lookup("a"), OperationOutcome::LeaseDestroyed);
        h.remember(op(1, 1), lookup("b"), OperationOutcome::LeaseDestroyed);
        h.forget(&op(1, 0));
        assert!(h.get(&op(1, 0)).is_none());
        assert!(h.get(&op(1, 1)).is_some());
        // Remembered again after being forgotten: found at its new place.
        h.remember(op(1, 0), lookup("a"), OperationOutcome::EndpointNotReady);
        assert_eq!(
            h.get(&op(1, 0)).map(|e| &e.2),
            Some(&OperationOutcome::EndpointNotReady)
        );
        assert!(h.get(&op(1, 1)).is_some());
        assert_eq!(h.len(), 2);
        h.remember(op(2, 0), lookup("c"), OperationOutcome::LeaseDestroyed);
        assert!(h.get(&op(1, 1)).is_none(), "the oldest went");
        assert!(h.get(&op(1, 0)).is_some() && h.get(&op(2, 0)).is_some());
    }

    #[test]
    fn an_operation_remembered_twice_is_found_at_its_latest() {
        let mut h = History::new(4);
        h.remember(op(1, 0), lookup("a"), OperationOutcome::LeaseDestroyed);
        h.remember(op(1, 0), lookup("a"), OperationOutcome::EndpointNotReady);
        assert_eq!(h.len(), 1);
        assert_eq!(
            h.get(&op(1, 0)).map(|e| &e.2),
            Some(&OperationOutcome::EndpointNotReady)
        );
        assert!(h.ring[0].is_none(), "the older entry is cleared");
    }

    #[test]
    fn a_history_of_zero_keeps_nothing() {
        let mut h = History::new(0);
        h.remember(op(1, 0), lookup("a"), OperationOutcome::LeaseDestroyed);
        assert!(h.get(&op(1, 0)).is_none());
        assert_eq!(h.len(), 0);
    }
}
