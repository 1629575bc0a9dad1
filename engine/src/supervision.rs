//! Linked children with a restart budget that escalates to the parent when spent.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use ractor::{Actor, ActorCell, ActorId, ActorRef, Message, SpawnErr, SupervisionEvent};

use crate::clock::EngineInstant;

/// How many failures a child may have within a window before escalating.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RestartPolicy {
    /// Restarts allowed within `window`; the next failure inside the window escalates.
    pub restarts_max: u32,
    /// Sliding window over which failures are counted.
    pub window: Duration,
}

impl RestartPolicy {
    /// Checks the policy is usable.
    ///
    /// # Errors
    /// [`PolicyError::ZeroWindow`] if `window` is zero.
    pub fn validate(&self) -> Result<(), PolicyError> {
        if self.window.is_zero() {
            return Err(PolicyError::ZeroWindow);
        }
        Ok(())
    }
}

impl Default for RestartPolicy {
    fn default() -> Self {
        Self {
            restarts_max: 3,
            window: Duration::from_secs(60),
        }
    }
}

/// A restart policy that cannot work.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PolicyError {
    /// A zero window would never count any failure, so nothing would escalate.
    #[error("restart window must be longer than zero")]
    ZeroWindow,
}

/// Why supervision gave up; returned to the parent, which should fail with it.
#[derive(Debug, thiserror::Error)]
pub enum SupervisionError {
    /// The child failed more often than its policy allows.
    #[error("child `{label}` failed {failures} times within {window:?}; escalating")]
    RestartLimit {
        /// The child's label.
        label: String,
        /// Failures counted inside the window, including the last one.
        failures: usize,
        /// The policy window.
        window: Duration,
    },
    /// The child could not be spawned (first start or restart).
    #[error("child `{label}` could not be spawned")]
    Spawn {
        /// The child's label.
        label: String,
        /// What ractor reported.
        #[source]
        source: SpawnErr,
    },
    /// A child with this label is already supervised.
    #[error("a child labelled `{label}` is already running")]
    DuplicateLabel {
        /// The label in use.
        label: String,
    },
    /// The restart policy is invalid.
    #[error("invalid restart policy for child `{label}`")]
    Policy {
        /// The child's label.
        label: String,
        /// What is wrong with it.
        #[source]
        source: PolicyError,
    },
}

/// How to (re)start one child.
pub struct ChildSpec<A: Actor> {
    /// Label for logs and lookups; unique among one parent's children.
    pub label: String,
    /// Optional registry name. Names are process-global, so leave it `None`
    /// unless the child must be found by name.
    pub name: Option<String>,
    /// Restart budget.
    pub policy: RestartPolicy,
    /// Builds a fresh handler and start arguments for each (re)start.
    pub factory: Box<dyn Fn() -> (A, A::Arguments) + Send + Sync>,
}

impl<A: Actor> ChildSpec<A> {
    /// A spec with no registry name.
    pub fn new(
        label: impl Into<String>,
        policy: RestartPolicy,
        factory: impl Fn() -> (A, A::Arguments) + Send + Sync + 'static,
    ) -> Self {
        Self {
            label: label.into(),
            name: None,
            policy,
            factory: Box::new(factory),
        }
    }
}

/// What [`Children::handle_event`] did with a supervision event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChildEvent {
    /// A supervised child finished starting.
    Started {
        /// The child's label.
        label: String,
    },
    /// A supervised child failed and was started again.
    Restarted {
        /// The child's label.
        label: String,
        /// Failures inside the window so far, including this one.
        failures: usize,
    },
    /// A supervised child stopped cleanly (or was killed) and was not restarted.
    Stopped {
        /// The child's label.
        label: String,
    },
    /// The event was not about one of these children; the parent decides.
    Unmanaged,
}

type SpawnFuture = Pin<Box<dyn Future<Output = Result<ActorCell, SpawnErr>> + Send>>;
type Respawn = Box<dyn Fn(ActorCell) -> SpawnFuture + Send + Sync>;

struct Child {
    cell: ActorCell,
    policy: RestartPolicy,
    failures: VecDeque<EngineInstant>,
    respawn: Respawn,
}

/// The supervised children of one parent actor.
///
/// A parent keeps a [`Children`] in its state, starts children with
/// [`Children::start`], and forwards every supervision event to
/// [`Children::handle_event`] from its `handle_supervisor_evt` (which it
/// must override: ractor's default stops the parent on any child exit):
///
/// ```text
/// async fn handle_supervisor_evt(&self, myself: ActorRef<Msg>, evt: SupervisionEvent,
///                                state: &mut State) -> Result<(), ActorProcessingErr> {
///     // An error here is the escalation: the parent fails and its own
///     // supervisor hears about it.
///     state.children.handle_event(&myself.get_cell(), &evt).await?;
///     Ok(())
/// }
/// ```
#[derive(Default)]
pub struct Children {
    by_label: BTreeMap<String, Child>,
    label_of: BTreeMap<ActorId, String>,
}

impl fmt::Debug for Children {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Children")
            .field("labels", &self.by_label.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Children {
    /// No children yet.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Spawns a child linked to `supervisor` and puts it under supervision.
    ///
    /// # Errors
    /// An invalid policy, a duplicate label, or a failed spawn.
    pub async fn start<A>(
        &mut self,
        supervisor: &ActorCell,
        spec: ChildSpec<A>,
    ) -> Result<ActorRef<A::Msg>, SupervisionError>
    where
        A: Actor,
    {
        let ChildSpec {
            label,
            name,
            policy,
            factory,
        } = spec;
        policy
            .validate()
            .map_err(|source| SupervisionError::Policy {
                label: label.clone(),
                source,
            })?;
        if self.by_label.contains_key(&label) {
            return Err(SupervisionError::DuplicateLabel { label });
        }
        let factory: std::sync::Arc<dyn Fn() -> (A, A::Arguments) + Send + Sync> =
            std::sync::Arc::from(factory);
        let respawn: Respawn = Box::new(move |supervisor: ActorCell| {
            let factory = factory.clone();
            let name = name.clone();
            Box::pin(async move {
                let (handler, args) = factory();
                let (actor, _join) = A::spawn_linked(name, handler, args, supervisor).await?;
                Ok(actor.get_cell())
            })
        });
        let cell = respawn(supervisor.clone())
            .await
            .map_err(|source| SupervisionError::Spawn {
                label: label.clone(),
                source,
            })?;
        tracing::info!(child = %label, id = %cell.get_id(), "child started");
        self.label_of.insert(cell.get_id(), label.clone());
        let actor = ActorRef::from(cell.clone());
        self.by_label.insert(
            label,
            Child {
                cell,
                policy,
                failures: VecDeque::new(),
                respawn,
            },
        );
        Ok(actor)
    }

    /// Applies a supervision event: restarts a failed child within its
    /// budget, forgets a stopped one, and ignores events about other actors.
    ///
    /// The event is inspected before the returned future is first polled, so
    /// the future does not borrow it (ractor's events are not `Sync`).
    ///
    /// # Errors
    /// [`SupervisionError::RestartLimit`] when the budget is spent (the child
    /// stays down), or [`SupervisionError::Spawn`] when a restart fails.
    /// The parent escalates by returning the error from its handler.
    pub fn handle_event<'a>(
        &'a mut self,
        supervisor: &ActorCell,
        event: &SupervisionEvent,
    ) -> impl Future<Output = Result<ChildEvent, SupervisionError>> + Send + 'a {
        let decided = self.classify(event);
        let supervisor = supervisor.clone();
        async move {
            match decided {
                Ok(event) => Ok(event),
                Err(label) => self.restart(&supervisor, label).await,
            }
        }
    }

    /// Settles an event that needs no restart (`Ok`), or names the failed
    /// child to restart (`Err(label)`).
    fn classify(&mut self, event: &SupervisionEvent) -> Result<ChildEvent, String> {
        match event {
            SupervisionEvent::ActorStarted(cell) => Ok(match self.label_of.get(&cell.get_id()) {
                Some(label) => ChildEvent::Started {
                    label: label.clone(),
                },
                None => ChildEvent::Unmanaged,
            }),
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                let Some(label) = self.label_of.remove(&cell.get_id()) else {
                    return Ok(ChildEvent::Unmanaged);
                };
                self.by_label.remove(&label);
                tracing::info!(child = %label, ?reason, "child stopped; not restarted");
                Ok(ChildEvent::Stopped { label })
            }
            SupervisionEvent::ActorFailed(cell, error) => {
                let Some(label) = self.label_of.remove(&cell.get_id()) else {
                    return Ok(ChildEvent::Unmanaged);
                };
                tracing::warn!(child = %label, %error, "child failed");
                Err(label)
            }
            _ => Ok(ChildEvent::Unmanaged),
        }
    }

    /// The current actor of the child labelled `label`, if it is running.
    ///
    /// The reference changes on every restart, so look it up rather than
    /// keeping it. `None` if `M` is not the child's message type.
    #[must_use]
    pub fn get<M: Message>(&self, label: &str) -> Option<ActorRef<M>> {
        let child = self.by_label.get(label)?;
        // `Some(false)` means a different message type; `None` means ractor
        // cannot tell (remote actors), which supervised children never are.
        match child.cell.is_message_type_of::<M>() {
            Some(true) => Some(ActorRef::from(child.cell.clone())),
            _ => None,
        }
    }

    /// Labels of the supervised children.
    pub fn labels(&self) -> impl Iterator<Item = &str> {
        self.by_label.keys().map(String::as_str)
    }

    /// Number of supervised children.
    #[must_use]
    pub fn len(&self) -> usize {
        self.by_label.len()
    }

    /// Whether there are no supervised children.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.by_label.is_empty()
    }

    /// Stops every child and stops supervising them.
    pub fn stop_all(&mut self, reason: Option<String>) {
        for (_, child) in std::mem::take(&mut self.by_label) {
            child.cell.stop(reason.clone());
        }
        self.label_of.clear();
    }

    async fn restart(
        &mut self,
        supervisor: &ActorCell,
        label: String,
    ) -> Result<ChildEvent, SupervisionError> {
        loop {
            let Some(child) = self.by_label.get_mut(&label) else {
                return Ok(ChildEvent::Unmanaged);
            };
            let now = EngineInstant::now();
            let window = child.policy.window;
            while child
                .failures
                .front()
                .is_some_and(|at| now.saturating_duration_since(*at) >= window)
            {
                child.failures.pop_front();
            }
            child.failures.push_back(now);
            let failures = child.failures.len();
            let allowed = usize::try_from(child.policy.restarts_max).unwrap_or(usize::MAX);
            if failures > allowed {
                tracing::error!(child = %label, failures, ?window, "restart limit reached; escalating");
                self.by_label.remove(&label);
                return Err(SupervisionError::RestartLimit {
                    label,
                    failures,
                    window,
                });
            }
            match (child.respawn)(supervisor.clone()).await {
                Ok(cell) => {
                    tracing::warn!(child = %label, failures, id = %cell.get_id(), "child restarted");
                    self.label_of.insert(cell.get_id(), label.clone());
                    child.cell = cell;
                    return Ok(ChildEvent::Restarted { label, failures });
                }
                Err(SpawnErr::StartupFailed(error)) => {
                    // A child that cannot even start counts as another failure
                    // against the same budget.
                    tracing::warn!(child = %label, %error, "child restart failed during startup");
                }
                Err(source) => {
                    self.by_label.remove(&label);
                    return Err(SupervisionError::Spawn { label, source });
                }
            }
        }
    }
}
