//! Bounding a future by an engine deadline, for crates that may not touch timers themselves.

use std::future::Future;

use crate::clock::EngineInstant;

/// The deadline passed before the future finished; the future was dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("deadline passed")]
pub struct DeadlinePassed;

/// Runs `fut` until `deadline`. If the deadline comes first the future is
/// dropped (cancelling it) and [`DeadlinePassed`] is returned, so a late
/// completion can never be observed.
///
/// # Errors
/// [`DeadlinePassed`] when the deadline came first.
pub async fn run_until<F: Future>(
    deadline: EngineInstant,
    fut: F,
) -> Result<F::Output, DeadlinePassed> {
    tokio::time::timeout_at(deadline.into_tokio(), fut)
        .await
        .map_err(|_| DeadlinePassed)
}

/// Lets the other tasks of the runtime run before this one goes on (for a
/// crate that may not touch the scheduler itself).
pub async fn yield_to_others() {
    tokio::task::yield_now().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn a_future_past_its_deadline_is_dropped_and_reported() {
        let now = EngineInstant::now();
        let slow = tokio::time::sleep(Duration::from_secs(10));
        let deadline = now.checked_add(Duration::from_secs(1)).unwrap();
        assert_eq!(run_until(deadline, slow).await, Err(DeadlinePassed));
        let fast = async { 7 };
        let deadline = EngineInstant::now()
            .checked_add(Duration::from_secs(1))
            .unwrap();
        assert_eq!(run_until(deadline, fast).await, Ok(7));
    }
}
