//! Actor timers under paused time.

use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use swactor_engine::{Clock, TaskGauge, TimerFired, Timers};
use tokio::sync::mpsc;

type Key = &'static str;

enum Msg {
    Timer(TimerFired<Key>),
    ArmAfter(Key, Duration),
    ArmPeriodic(Key, Duration),
    Cancel(Key),
    /// Stays busy for a while (so firings queue up), then re-arms or cancels.
    BusyThen(Duration, Option<(Key, Duration)>, Option<Key>),
    RearmMany(Key, usize, Duration),
    Inspect(RpcReplyPort<(usize, TaskGauge, u64)>),
}

impl From<TimerFired<Key>> for Msg {
    fn from(fired: TimerFired<Key>) -> Self {
        Msg::Timer(fired)
    }
}

struct TimerActor;

struct State {
    timers: Timers<Key, Msg>,
    clock: Clock,
    fired: mpsc::UnboundedSender<(Key, u64)>,
    stale: u64,
}

impl Actor for TimerActor {
    type Msg = Msg;
    type State = State;
    type Arguments = (Clock, mpsc::UnboundedSender<(Key, u64)>);

    async fn pre_start(
        &self,
        myself: ActorRef<Msg>,
        (clock, fired): Self::Arguments,
    ) -> Result<State, ActorProcessingErr> {
        Ok(State {
            timers: Timers::new(myself),
            clock,
            fired,
            stale: 0,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Msg>,
        msg: Msg,
        state: &mut State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            Msg::Timer(fired) => {
                if state.timers.accept(&fired) {
                    let _ = state.fired.send((fired.key, state.clock.now_ms()));
                } else {
                    state.stale += 1;
                }
            }
            Msg::ArmAfter(key, delay) => {
                state.timers.arm_after(key, delay);
            }
            Msg::ArmPeriodic(key, period) => {
                state.timers.arm_periodic(key, period);
            }
            Msg::Cancel(key) => {
                state.timers.cancel(&key);
            }
            Msg::BusyThen(busy, rearm, cancel) => {
                tokio::time::sleep(busy).await;
                if let Some((key, delay)) = rearm {
                    state.timers.arm_after(key, delay);
                }
                if let Some(key) = cancel {
                    state.timers.cancel(&key);
                }
            }
            Msg::RearmMany(key, n, delay) => {
                for _ in 0..n {
                    state.timers.arm_after(key, delay);
                }
            }
            Msg::Inspect(reply) => {
                let _ = reply.send((
                    state.timers.armed_count(),
                    state.timers.task_gauge(),
                    state.stale,
                ));
            }
        }
        Ok(())
    }
}

async fn start() -> (
    ActorRef<Msg>,
    tokio::task::JoinHandle<()>,
    mpsc::UnboundedReceiver<(Key, u64)>,
    Clock,
) {
    let clock = Clock::new();
    let (tx, rx) = mpsc::unbounded_channel();
    let (actor, join) = Actor::spawn(None, TimerActor, (clock, tx)).await.unwrap();
    (actor, join, rx, clock)
}

async fn inspect(actor: &ActorRef<Msg>) -> (usize, TaskGauge, u64) {
    ractor::call!(actor, Msg::Inspect).unwrap()
}

fn drain(rx: &mut mpsc::UnboundedReceiver<(Key, u64)>) -> Vec<(Key, u64)> {
    let mut out = Vec::new();
    while let Ok(item) = rx.try_recv() {
        out.push(item);
    }
    out
}

#[tokio::test(start_paused = true)]
async fn timers_fire_in_deadline_order_at_their_deadlines() {
    let (actor, _join, mut rx, _clock) = start().await;
    actor
        .cast(Msg::ArmAfter("c", Duration::from_millis(30)))
        .unwrap();
    actor
        .cast(Msg::ArmAfter("a", Duration::from_millis(10)))
        .unwrap();
    actor
        .cast(Msg::ArmAfter("b", Duration::from_millis(20)))
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(drain(&mut rx), vec![("a", 10), ("b", 20), ("c", 30)]);
    let (armed, gauge, stale) = inspect(&actor).await;
    assert_eq!((armed, gauge.get(), stale), (0, 0, 0));
    actor.stop(None);
}

#[tokio::test(start_paused = true)]
async fn rearming_drops_a_firing_already_in_the_mailbox() {
    let (actor, _join, mut rx, _clock) = start().await;
    actor
        .cast(Msg::ArmAfter("lease", Duration::from_millis(10)))
        .unwrap();
    // While the actor is busy for 50 ms the 10 ms firing lands in its mailbox;
    // then it re-arms, so that queued firing must be rejected as stale.
    actor
        .cast(Msg::BusyThen(
            Duration::from_millis(50),
            Some(("lease", Duration::from_millis(100))),
            None,
        ))
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(drain(&mut rx), vec![("lease", 150)]);
    let (armed, _gauge, stale) = inspect(&actor).await;
    assert_eq!((armed, stale), (0, 1));
    actor.stop(None);
}

#[tokio::test(start_paused = true)]
async fn cancelling_stops_a_pending_timer_and_a_queued_firing() {
    let (actor, _join, mut rx, _clock) = start().await;
    actor
        .cast(Msg::ArmAfter("a", Duration::from_millis(10)))
        .unwrap();
    actor
        .cast(Msg::ArmAfter("b", Duration::from_millis(10)))
        .unwrap();
    actor.cast(Msg::Cancel("a")).unwrap();
    actor
        .cast(Msg::BusyThen(Duration::from_millis(50), None, Some("b")))
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(drain(&mut rx), vec![]);
    let (armed, gauge, stale) = inspect(&actor).await;
    assert_eq!((armed, gauge.get(), stale), (0, 0, 1));
    actor.stop(None);
}

#[tokio::test(start_paused = true)]
async fn periodic_ticks_repeat_until_cancelled() {
    let (actor, _join, mut rx, _clock) = start().await;
    actor
        .cast(Msg::ArmPeriodic("tick", Duration::from_millis(100)))
        .unwrap();
    tokio::time::sleep(Duration::from_millis(350)).await;
    actor.cast(Msg::Cancel("tick")).unwrap();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(
        drain(&mut rx),
        vec![("tick", 100), ("tick", 200), ("tick", 300)]
    );
    let (armed, gauge, _) = inspect(&actor).await;
    assert_eq!((armed, gauge.get()), (0, 0));
    actor.stop(None);
}

#[tokio::test(start_paused = true)]
async fn stopping_the_actor_cancels_all_its_timers() {
    let (actor, join, mut rx, _clock) = start().await;
    for key in ["a", "b", "c"] {
        actor
            .cast(Msg::ArmAfter(key, Duration::from_secs(60)))
            .unwrap();
    }
    actor
        .cast(Msg::ArmPeriodic("tick", Duration::from_secs(1)))
        .unwrap();
    let (armed, gauge, _) = inspect(&actor).await;
    assert_eq!((armed, gauge.get()), (4, 4));
    actor.stop(None);
    join.await.unwrap();
    // The tasks were aborted with the state, long before any deadline.
    crate::eventually(Duration::from_millis(100), "timer tasks gone", || {
        gauge.get() == 0
    })
    .await;
    tokio::time::sleep(Duration::from_secs(120)).await;
    assert_eq!(drain(&mut rx), vec![]);
}

#[tokio::test(start_paused = true)]
async fn ten_thousand_rearms_leave_exactly_one_pending_timer() {
    let (actor, _join, mut rx, _clock) = start().await;
    actor
        .cast(Msg::RearmMany("k", 10_000, Duration::from_secs(1)))
        .unwrap();
    let (armed, gauge, _) = inspect(&actor).await;
    assert_eq!(armed, 1);
    crate::eventually(Duration::from_millis(100), "aborted tasks dropped", || {
        gauge.get() == 1
    })
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(drain(&mut rx), vec![("k", 1000)]);
    let (armed, gauge, stale) = inspect(&actor).await;
    assert_eq!((armed, gauge.get(), stale), (0, 0, 0));
    actor.stop(None);
}
