//! Keyed, generation-checked actor timers that die with the actor owning them.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ractor::{ActorRef, Message};
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use crate::clock::EngineInstant;

/// The message a timer delivers: which key fired and for which arming.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TimerFired<K> {
    /// The key the timer was armed under.
    pub key: K,
    /// The generation of the arming that fired; compared by [`Timers::accept`].
    pub generation: u64,
}

/// A shared count of things still alive: timer tasks, telemetry
/// subscribers, a router's handshakes under way.
///
/// Each holds a guard that decrements it when dropped, including on abort,
/// so for timers it proves that cancelled ones really released their tasks.
#[derive(Clone, Debug, Default)]
pub struct TaskGauge(Arc<AtomicUsize>);

impl TaskGauge {
    /// Current number of live tasks.
    #[must_use]
    pub fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }

    pub(crate) fn enter(&self) -> TaskGaugeGuard {
        self.0.fetch_add(1, Ordering::SeqCst);
        TaskGaugeGuard(self.0.clone())
    }

    /// Enters only while fewer than `limit` tasks are live.
    pub(crate) fn try_enter(&self, limit: usize) -> Option<TaskGaugeGuard> {
        self.0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |live| {
                (live < limit).then_some(live + 1)
            })
            .ok()
            .map(|_| TaskGaugeGuard(self.0.clone()))
    }
}

/// Decrements its [`TaskGauge`] when dropped.
#[derive(Debug)]
pub(crate) struct TaskGaugeGuard(Arc<AtomicUsize>);

impl Drop for TaskGaugeGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

struct Armed {
    generation: u64,
    periodic: bool,
    task: JoinHandle<()>,
}

/// The timers of one actor, keyed by `K`, delivering `M: From<TimerFired<K>>`.
///
/// An actor keeps a [`Timers`] in its state and arms timers by key. Each
/// arming gets a fresh generation; the firing message carries it, and
/// [`Timers::accept`] drops any firing whose generation is no longer current,
/// so a re-armed or cancelled timer can never reach the handler late.
///
/// ```text
/// enum Msg { Timer(TimerFired<Key>), /* ... */ }
/// impl From<TimerFired<Key>> for Msg { fn from(f: TimerFired<Key>) -> Self { Msg::Timer(f) } }
///
/// // pre_start:  let timers = Timers::new(myself.clone());
/// // anywhere:   state.timers.arm_at(Key::Lease, clock.at_ms(deadline_ms));
/// // handle:     Msg::Timer(fired) if state.timers.accept(&fired) => { /* act */ }
/// //             Msg::Timer(_) => {} // stale: re-armed or cancelled meanwhile
/// ```
///
/// Arming a key that is already armed replaces it (the old task is aborted
/// and its generation goes stale). Dropping the `Timers` aborts every task,
/// so timers kept in an actor's state stop when the actor does: on a panic
/// or kill the state is dropped at once; on a clean stop ractor hands the
/// state to the supervisor in `ActorTerminated`, so it is dropped once the
/// supervisor has handled that event (call [`Timers::cancel_all`] in
/// `post_stop` to stop them even earlier). A firing that reaches a stopped
/// actor is discarded, and a periodic timer ends at its next tick.
pub struct Timers<K, M>
where
    K: Ord + Clone + Send + Sync + 'static,
    M: Message + From<TimerFired<K>>,
{
    target: ActorRef<M>,
    generation_next: u64,
    armed: BTreeMap<K, Armed>,
    gauge: TaskGauge,
}

impl<K, M> fmt::Debug for Timers<K, M>
where
    K: Ord + Clone + Send + Sync + fmt::Debug + 'static,
    M: Message + From<TimerFired<K>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Timers")
            .field("armed", &self.armed.keys().collect::<Vec<_>>())
            .field("generation_next", &self.generation_next)
            .finish_non_exhaustive()
    }
}

impl<K, M> Timers<K, M>
where
    K: Ord + Clone + Send + Sync + 'static,
    M: Message + From<TimerFired<K>>,
{
    /// Creates an empty timer set delivering to `target` (usually `myself`).
    #[must_use]
    pub fn new(target: ActorRef<M>) -> Self {
        Self {
            target,
            generation_next: 1,
            armed: BTreeMap::new(),
            gauge: TaskGauge::default(),
        }
    }

    /// Arms (or re-arms) `key` to fire once at `deadline`; returns the generation.
    pub fn arm_at(&mut self, key: K, deadline: EngineInstant) -> u64 {
        let generation = self.next_generation();
        let fired = TimerFired {
            key: key.clone(),
            generation,
        };
        let target = self.target.clone();
        let guard = self.gauge.enter();
        let task = tokio::spawn(async move {
            let _guard = guard;
            tokio::time::sleep_until(deadline.into_tokio()).await;
            // A dead target just means the actor stopped first; nothing to do.
            let _ = target.send_message(M::from(fired));
        });
        self.replace(key, generation, false, task);
        generation
    }

    /// Arms (or re-arms) `key` to fire once after `delay`; returns the generation.
    pub fn arm_after(&mut self, key: K, delay: Duration) -> u64 {
        let now = EngineInstant::now();
        // A delay too long to represent is as good as "never"; clamp it.
        let deadline = now
            .checked_add(delay)
            .unwrap_or_else(|| now + Duration::from_secs(30 * 365 * 24 * 3600));
        self.arm_at(key, deadline)
    }

    /// Arms (or re-arms) `key` to fire every `period`, first one period from now.
    ///
    /// Every tick carries the same generation. If the actor falls behind,
    /// missed ticks are skipped rather than bunched up. A zero period is
    /// treated as one millisecond.
    pub fn arm_periodic(&mut self, key: K, period: Duration) -> u64 {
        let period = period.max(Duration::from_millis(1));
        let generation = self.next_generation();
        let target = self.target.clone();
        let tick_key = key.clone();
        let guard = self.gauge.enter();
        let task = tokio::spawn(async move {
            let _guard = guard;
            let start = tokio::time::Instant::now() + period;
            let mut ticks = tokio::time::interval_at(start, period);
            ticks.set_missed_tick_behavior(MissedTickBehavior::Skip);
            loop {
                ticks.tick().await;
                let fired = TimerFired {
                    key: tick_key.clone(),
                    generation,
                };
                if target.send_message(M::from(fired)).is_err() {
                    break;
                }
            }
        });
        self.replace(key, generation, true, task);
        generation
    }

    /// Cancels `key`; returns whether it was armed. A firing already in the
    /// mailbox is rejected later by [`Timers::accept`].
    pub fn cancel(&mut self, key: &K) -> bool {
        match self.armed.remove(key) {
            Some(armed) => {
                armed.task.abort();
                true
            }
            None => false,
        }
    }

    /// Cancels every timer.
    pub fn cancel_all(&mut self) {
        for (_, armed) in std::mem::take(&mut self.armed) {
            armed.task.abort();
        }
    }

    /// Decides whether a firing is current. Call it first thing on every
    /// [`TimerFired`]; `false` means the firing is stale and must be ignored.
    ///
    /// A current one-shot firing disarms its key; periodic timers stay armed.
    pub fn accept(&mut self, fired: &TimerFired<K>) -> bool {
        match self.armed.get(&fired.key) {
            Some(armed) if armed.generation == fired.generation => {
                if !armed.periodic {
                    self.armed.remove(&fired.key);
                }
                true
            }
            _ => false,
        }
    }

    /// Whether `key` is armed (and not yet accepted, if one-shot).
    #[must_use]
    pub fn is_armed(&self, key: &K) -> bool {
        self.armed.contains_key(key)
    }

    /// Number of armed timers.
    #[must_use]
    pub fn armed_count(&self) -> usize {
        self.armed.len()
    }

    /// A handle counting this set's live timer tasks, which outlives the set.
    #[must_use]
    pub fn task_gauge(&self) -> TaskGauge {
        self.gauge.clone()
    }

    fn next_generation(&mut self) -> u64 {
        let generation = self.generation_next;
        self.generation_next += 1;
        generation
    }

    fn replace(&mut self, key: K, generation: u64, periodic: bool, task: JoinHandle<()>) {
        let armed = Armed {
            generation,
            periodic,
            task,
        };
        if let Some(old) = self.armed.insert(key, armed) {
            old.task.abort();
        }
    }
}

impl<K, M> Drop for Timers<K, M>
where
    K: Ord + Clone + Send + Sync + 'static,
    M: Message + From<TimerFired<K>>,
{
    fn drop(&mut self) {
        self.cancel_all();
    }
}
