//! How many QUIC handshakes an endpoint starts per second.
//!
//! A handshake costs the server its key exchange and signature before it
//! knows who the peer is, so a flood of connection attempts (which needs
//! only the daemon's address) buys CPU time that the event loop folding
//! joined agents' heartbeats needs. [`HandshakeRate`] is a token bucket
//! checked before the handshake starts: within the budget an attempt goes
//! on; past it, it is refused at once with a QUIC `CONNECTION_REFUSED`,
//! which costs one packet and no cryptography. Established connections
//! (every joined agent's link) never pass through it.
//!
//! The bucket is a pure state machine: time is an argument.

use std::time::Instant;

/// A token bucket: `per_second` attempts on average, at most `burst` at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HandshakeRate {
    /// Attempts allowed per second, sustained.
    pub per_second: u32,
    /// Attempts allowed at once after a quiet spell.
    pub burst: u32,
}

impl HandshakeRate {
    /// The default: 20 per second, 100 at once. Measured in a debug build
    /// on two cores with three floods beside four agents, 200 or 50 per
    /// second (bursts of 1,000 or 500) let the handshakes take the CPU the
    /// agents' heartbeats needed, and 20 (bursts of 100) did not. The
    /// daemon raises the agents' budget to what its fleet needs to
    /// reconnect at once.
    pub const DEFAULT: Self = Self {
        per_second: 20,
        burst: 100,
    };

    /// Whether the rate admits anything: both numbers above zero.
    #[must_use]
    pub fn is_valid(&self) -> bool {
        self.per_second > 0 && self.burst > 0
    }
}

impl Default for HandshakeRate {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// The bucket's state: the tokens left at the last refill.
#[derive(Debug)]
pub(crate) struct Bucket {
    rate: HandshakeRate,
    /// Tokens in thousandths, so a slow rate still refills between calls.
    milli_tokens: u64,
    refilled: Option<Instant>,
}

impl Bucket {
    pub(crate) fn new(rate: HandshakeRate) -> Self {
        Self {
            rate,
            milli_tokens: u64::from(rate.burst) * 1_000,
            refilled: None,
        }
    }

    /// Takes a token for an attempt at `now`; `false` when none is left.
    pub(crate) fn try_take(&mut self, now: Instant) -> bool {
        let full = u64::from(self.rate.burst) * 1_000;
        if let Some(last) = self.refilled {
            let elapsed = now.saturating_duration_since(last);
            let earned = elapsed
                .as_micros()
                .saturating_mul(u128::from(self.rate.per_second))
                / 1_000;
            let earned = u64::try_from(earned).unwrap_or(u64::MAX);
            self.milli_tokens = self.milli_tokens.saturating_add(earned).min(full);
        }
        // Only a moment that moved time on counts as a refill point: a
        // clock read out of order must not earn tokens twice.
        if self.refilled.is_none_or(|last| now > last) {
            self.refilled = Some(now);
        }
        if self.milli_tokens >= 1_000 {
            self.milli_tokens -= 1_000;
            true
        } else {
            false
        }
    }

    /// How long until the next token, from the last refill (for tests and
    /// messages).
    #[cfg(test)]
    fn next_token_in(&self) -> std::time::Duration {
        let missing = 1_000u64.saturating_sub(self.milli_tokens);
        std::time::Duration::from_micros(missing * 1_000 / u64::from(self.rate.per_second.max(1)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_burst_is_admitted_then_the_rate_refills_it() {
        let rate = HandshakeRate {
            per_second: 10,
            burst: 5,
        };
        let mut b = Bucket::new(rate);
        let t0 = Instant::now();
        let admitted = (0..20).filter(|_| b.try_take(t0)).count();
        assert_eq!(admitted, 5, "the burst, and no more at one instant");
        assert_eq!(b.next_token_in(), Duration::from_millis(100));
        // 100 ms earns one token at 10 per second.
        assert!(!b.try_take(t0 + Duration::from_millis(99)));
        assert!(b.try_take(t0 + Duration::from_millis(100)));
        assert!(!b.try_take(t0 + Duration::from_millis(100)));
        // A long quiet spell refills to the burst, not beyond.
        let later = t0 + Duration::from_secs(60);
        let admitted = (0..20).filter(|_| b.try_take(later)).count();
        assert_eq!(admitted, 5);
    }

    #[test]
    fn over_a_second_the_rate_is_kept_whatever_the_pace_of_attempts() {
        let rate = HandshakeRate {
            per_second: 200,
            burst: 400,
        };
        let mut b = Bucket::new(rate);
        let t0 = Instant::now();
        // 5,000 attempts spread over 2 s: the burst and 2 s of rate.
        let admitted = (0..5_000u64)
            .filter(|i| b.try_take(t0 + Duration::from_micros(i * 400)))
            .count();
        assert!((790..=801).contains(&admitted), "{admitted}");
    }

    #[test]
    fn a_clock_read_out_of_order_earns_nothing() {
        let rate = HandshakeRate {
            per_second: 1,
            burst: 1,
        };
        let mut b = Bucket::new(rate);
        let t0 = Instant::now() + Duration::from_secs(10);
        assert!(b.try_take(t0));
        assert!(!b.try_take(t0 - Duration::from_secs(5)));
        assert!(!b.try_take(t0));
        assert!(b.try_take(t0 + Duration::from_secs(1)));
    }

    #[test]
    fn zero_is_not_a_rate() {
        assert!(HandshakeRate::DEFAULT.is_valid());
        assert!(
            !HandshakeRate {
                per_second: 0,
                burst: 1
            }
            .is_valid()
        );
    }
}
