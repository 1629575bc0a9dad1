//! Bounded, cancellable execution of blocking calls off the actor threads.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use ractor::{ActorRef, Message};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

pub use tokio_util::sync::CancellationToken as CancelToken;

/// Settings of a [`BlockingPool`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockingConfig {
    /// Most blocking closures running at once; later calls wait their turn.
    pub concurrency_max: usize,
}

impl BlockingConfig {
    /// Checks the settings.
    ///
    /// # Errors
    /// [`BlockingError::ZeroConcurrency`] if `concurrency_max` is zero, since
    /// nothing would ever run.
    pub fn validate(&self) -> Result<(), BlockingError> {
        if self.concurrency_max == 0 {
            return Err(BlockingError::ZeroConcurrency);
        }
        if self.concurrency_max > Semaphore::MAX_PERMITS {
            return Err(BlockingError::ConcurrencyTooLarge {
                concurrency_max: self.concurrency_max,
            });
        }
        Ok(())
    }
}

impl Default for BlockingConfig {
    fn default() -> Self {
        Self { concurrency_max: 8 }
    }
}

/// Why a blocking call produced no result.
#[derive(Debug, thiserror::Error)]
pub enum BlockingError {
    /// The call was cancelled; any result it produced was discarded.
    #[error("blocking call cancelled")]
    Cancelled,
    /// The closure panicked.
    #[error("blocking call panicked")]
    Panicked {
        /// The join error carrying the panic.
        #[source]
        source: tokio::task::JoinError,
    },
    /// The pool was configured with zero concurrency.
    #[error("blocking pool concurrency must be at least 1")]
    ZeroConcurrency,
    /// The configured concurrency exceeds what a semaphore can hold.
    #[error("blocking pool concurrency {concurrency_max} is too large")]
    ConcurrencyTooLarge {
        /// The configured value.
        concurrency_max: usize,
    },
}

/// Runs blocking closures with a concurrency bound; cheap to clone.
///
/// Actors must never block their runtime thread. A [`BlockingPool`] runs a
/// closure on tokio's blocking threads, at most `concurrency_max` at a time,
/// and hands the closure a [`CancelToken`] it should poll. Cancelling a call
/// discards its result at once; its permit is released when the closure
/// returns, so the bound counts closures that really run (a cooperative
/// closure returns promptly after cancellation).
#[derive(Clone, Debug)]
pub struct BlockingPool {
    permits: Arc<Semaphore>,
    concurrency_max: usize,
}

impl BlockingPool {
    /// Creates a pool.
    ///
    /// # Errors
    /// An invalid configuration.
    pub fn new(config: &BlockingConfig) -> Result<Self, BlockingError> {
        config.validate()?;
        Ok(Self {
            permits: Arc::new(Semaphore::new(config.concurrency_max)),
            concurrency_max: config.concurrency_max,
        })
    }

    /// The configured bound.
    #[must_use]
    pub fn concurrency_max(&self) -> usize {
        self.concurrency_max
    }

    /// Closures holding a permit right now (running, or finishing after a cancel).
    #[must_use]
    pub fn running(&self) -> usize {
        self.concurrency_max - self.permits.available_permits()
    }

    /// Starts `f` once a permit is free; the returned call resolves to its result.
    ///
    /// Dropping the [`BlockingCall`] cancels it. Must be called inside a tokio runtime.
    pub fn call<F, R>(&self, f: F) -> BlockingCall<R>
    where
        F: FnOnce(&CancelToken) -> R + Send + 'static,
        R: Send + 'static,
    {
        let token = CancelToken::new();
        let permits = self.permits.clone();
        let task_token = token.clone();
        let task = tokio::spawn(async move {
            let permit = tokio::select! {
                biased;
                () = task_token.cancelled() => return Err(BlockingError::Cancelled),
                permit = permits.acquire_owned() => match permit {
                    Ok(permit) => permit,
                    // The semaphore is never closed; treat it like a cancel.
                    Err(_) => return Err(BlockingError::Cancelled),
                },
            };
            let closure_token = task_token.clone();
            let blocking = tokio::task::spawn_blocking(move || {
                // The permit lives exactly as long as the closure runs.
                let _permit = permit;
                f(&closure_token)
            });
            tokio::select! {
                biased;
                () = task_token.cancelled() => Err(BlockingError::Cancelled),
                joined = blocking => match joined {
                    Ok(value) if !task_token.is_cancelled() => Ok(value),
                    Ok(_) => Err(BlockingError::Cancelled),
                    Err(source) => Err(BlockingError::Panicked { source }),
                },
            }
        });
        BlockingCall { token, task }
    }

    /// Like [`BlockingPool::call`], but delivers the outcome to `actor` as
    /// `wrap(result)` instead of being awaited, which suits actor handlers.
    ///
    /// Keep the returned [`BlockingTicket`] in the actor state: dropping it
    /// (e.g. when the actor stops) cancels the call.
    pub fn call_for<F, R, M>(
        &self,
        actor: ActorRef<M>,
        f: F,
        wrap: impl FnOnce(Result<R, BlockingError>) -> M + Send + 'static,
    ) -> BlockingTicket
    where
        F: FnOnce(&CancelToken) -> R + Send + 'static,
        R: Send + 'static,
        M: Message,
    {
        let call = self.call(f);
        let token = call.cancel_token();
        let task = tokio::spawn(async move {
            let outcome = call.await;
            if !matches!(outcome, Err(BlockingError::Cancelled)) {
                // The actor may be gone; then nobody wants the result.
                let _ = actor.send_message(wrap(outcome));
            }
        });
        BlockingTicket { token, task }
    }
}

/// A blocking call in flight; await it for the result.
#[derive(Debug)]
#[must_use = "dropping a BlockingCall cancels it"]
pub struct BlockingCall<R> {
    token: CancelToken,
    task: JoinHandle<Result<R, BlockingError>>,
}

impl<R> BlockingCall<R> {
    /// Cancels the call: its result is discarded and the closure's token fires.
    pub fn cancel(&self) {
        self.token.cancel();
    }

    /// The token handed to the closure.
    #[must_use]
    pub fn cancel_token(&self) -> CancelToken {
        self.token.clone()
    }
}

impl<R> Future for BlockingCall<R> {
    type Output = Result<R, BlockingError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match Pin::new(&mut self.task).poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(outcome)) => Poll::Ready(outcome),
            // The wrapper task is only aborted by our own Drop, so a join
            // error here can only be a panic or a runtime shutdown.
            Poll::Ready(Err(source)) if source.is_panic() => {
                Poll::Ready(Err(BlockingError::Panicked { source }))
            }
            Poll::Ready(Err(_)) => Poll::Ready(Err(BlockingError::Cancelled)),
        }
    }
}

impl<R> Drop for BlockingCall<R> {
    fn drop(&mut self) {
        self.token.cancel();
    }
}

/// Handle to a call started with [`BlockingPool::call_for`]; cancels on drop.
#[derive(Debug)]
#[must_use = "dropping a BlockingTicket cancels the call"]
pub struct BlockingTicket {
    token: CancelToken,
    task: JoinHandle<()>,
}

impl BlockingTicket {
    /// Cancels the call; no message will be delivered.
    pub fn cancel(&self) {
        self.token.cancel();
    }

    /// Whether the outcome has been delivered (or dropped after a cancel).
    #[must_use]
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

impl Drop for BlockingTicket {
    fn drop(&mut self) {
        self.token.cancel();
    }
}
