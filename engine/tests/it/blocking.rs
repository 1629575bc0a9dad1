//! The blocking substrate: bound and cancellation.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use swactor_engine::{BlockingConfig, BlockingError, BlockingPool, BlockingTicket};
use tokio::sync::mpsc;

fn pool(concurrency_max: usize) -> BlockingPool {
    BlockingPool::new(&BlockingConfig { concurrency_max }).unwrap()
}

#[tokio::test]
async fn no_more_calls_run_at_once_than_the_bound() {
    let pool = pool(2);
    let running = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let calls: Vec<_> = (0..8)
        .map(|i| {
            let running = running.clone();
            let peak = peak.clone();
            pool.call(move |_token| {
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(now, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(30));
                running.fetch_sub(1, Ordering::SeqCst);
                i * 10
            })
        })
        .collect();
    let mut results = Vec::new();
    for call in calls {
        results.push(
            crate::within(Duration::from_secs(10), "blocking call", call)
                .await
                .unwrap(),
        );
    }
    assert_eq!(results, (0..8).map(|i| i * 10).collect::<Vec<_>>());
    assert_eq!(
        peak.load(Ordering::SeqCst),
        2,
        "bound reached and never exceeded"
    );
    assert_eq!(pool.running(), 0);
}

#[tokio::test]
async fn a_cancelled_call_discards_its_result_and_frees_its_permit() {
    let pool = pool(1);
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let call = pool.call(move |token| {
        let _ = started_tx.send(());
        // Cooperative: poll the token, then produce a result nobody will see.
        while !token.is_cancelled() {
            std::thread::sleep(Duration::from_millis(1));
        }
        "late result"
    });
    crate::within(Duration::from_secs(5), "call start", async {
        while started_rx.try_recv().is_err() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    assert_eq!(pool.running(), 1);
    call.cancel();
    let outcome = crate::within(Duration::from_secs(5), "cancelled call", call).await;
    assert!(
        matches!(outcome, Err(BlockingError::Cancelled)),
        "{outcome:?}"
    );
    crate::eventually(Duration::from_secs(5), "permit freed", || {
        pool.running() == 0
    })
    .await;
    // The freed permit is usable.
    let next = pool.call(|_| 7);
    assert_eq!(
        crate::within(Duration::from_secs(5), "next call", next)
            .await
            .unwrap(),
        7
    );
}

#[tokio::test]
async fn a_call_cancelled_while_queued_never_runs() {
    let pool = pool(1);
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let blocker = pool.call(move |_| release_rx.recv().is_ok());
    let ran = Arc::new(AtomicBool::new(false));
    let ran_in_call = ran.clone();
    let queued = pool.call(move |_| ran_in_call.store(true, Ordering::SeqCst));
    tokio::time::sleep(Duration::from_millis(20)).await;
    drop(queued); // dropping cancels
    release_tx.send(()).unwrap();
    assert!(
        crate::within(Duration::from_secs(5), "blocker", blocker)
            .await
            .unwrap()
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!ran.load(Ordering::SeqCst));
    assert_eq!(pool.running(), 0);
}

#[tokio::test]
async fn a_panicking_call_reports_the_panic_and_frees_its_permit() {
    let pool = pool(1);
    let outcome = pool.call(|_| -> u32 { panic!("boom") }).await;
    assert!(
        matches!(outcome, Err(BlockingError::Panicked { .. })),
        "{outcome:?}"
    );
    assert_eq!(pool.running(), 0);
}

#[test]
fn zero_concurrency_is_rejected() {
    let err = BlockingPool::new(&BlockingConfig { concurrency_max: 0 }).unwrap_err();
    assert!(matches!(err, BlockingError::ZeroConcurrency));
}

struct Asker;

struct AskerState {
    _ticket: BlockingTicket,
    out: mpsc::UnboundedSender<Result<u64, String>>,
}

impl Actor for Asker {
    type Msg = Result<u64, BlockingError>;
    type State = AskerState;
    type Arguments = (BlockingPool, mpsc::UnboundedSender<Result<u64, String>>);

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        (pool, out): Self::Arguments,
    ) -> Result<AskerState, ActorProcessingErr> {
        let ticket = pool.call_for(myself, |_| (1..=10u64).product(), |result| result);
        Ok(AskerState {
            _ticket: ticket,
            out,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut AskerState,
    ) -> Result<(), ActorProcessingErr> {
        let _ = state.out.send(msg.map_err(|e| e.to_string()));
        Ok(())
    }
}

#[tokio::test]
async fn an_actor_gets_the_result_as_a_message() {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let (actor, _) = Actor::spawn(None, Asker, (pool(1), tx)).await.unwrap();
    let got = crate::within(Duration::from_secs(5), "result message", rx.recv()).await;
    assert_eq!(got, Some(Ok(3_628_800)));
    actor.stop(None);
}
