//! How long a message left for retry waits before its next attempt.

use std::time::Duration;

/// A retry policy: attempt `n` (from 1) waits a random time in `[d/2, d]`, where
/// `d = min(cap, base · 2^(n−1))`. With `cap == base` every wait is in `[base/2, base]`
/// (a fixed delay, jittered the same way).
///
/// The jitter spreads the retries of messages that failed together (a dependency went
/// down for all of them) instead of sending them back in one wave.
///
/// `#[idempotent(backoff = "1s..5m")]` is `Backoff::exponential(1 s, 5 min)`,
/// `backoff = "2s"` is `Backoff::fixed(2 s)`; without it a handler uses
/// [`Backoff::DEFAULT`].
///
/// ```
/// use std::time::Duration;
/// use idempotent_runtime::Backoff;
///
/// let backoff = Backoff::exponential(Duration::from_secs(1), Duration::from_secs(10));
/// assert_eq!(backoff.ceiling(1), Duration::from_secs(1));
/// assert_eq!(backoff.ceiling(3), Duration::from_secs(4));
/// assert_eq!(backoff.ceiling(9), Duration::from_secs(10));
/// let wait = backoff.delay(3);
/// assert!(wait >= Duration::from_secs(2) && wait <= Duration::from_secs(4));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
}

impl Backoff {
    /// The policy of a handler that does not set `backoff`: exponential from 1 s, up
    /// to 5 minutes. With the default 5 attempts, the four retries wait about 1, 2, 4
    /// and 8 s (each between half that and that).
    pub const DEFAULT: Backoff =
        Backoff::exponential(Duration::from_secs(1), Duration::from_secs(5 * 60));

    /// Doubling from `base` at each attempt, up to `cap` (raised to `base` if lower).
    /// A zero `base` never grows: every retry goes at once (the attribute refuses it).
    pub const fn exponential(base: Duration, cap: Duration) -> Backoff {
        let cap = if cap.as_nanos() < base.as_nanos() { base } else { cap };
        Backoff { base, cap }
    }

    /// The same `delay` at every attempt (jittered down to half of it).
    pub const fn fixed(delay: Duration) -> Backoff {
        Backoff { base: delay, cap: delay }
    }

    /// The first attempt's longest wait.
    pub const fn base(&self) -> Duration {
        self.base
    }

    /// The longest wait of any attempt.
    pub const fn cap(&self) -> Duration {
        self.cap
    }

    /// The longest wait after attempt `attempt` (from 1; 0 counts as 1):
    /// `min(cap, base · 2^(attempt−1))`.
    pub fn ceiling(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(1).min(63);
        let factor = 1u64 << doublings;
        let nanos = self.base.as_nanos().saturating_mul(u128::from(factor));
        if nanos >= self.cap.as_nanos() {
            return self.cap;
        }
        // Below the cap, so within a Duration.
        let secs = u64::try_from(nanos / 1_000_000_000).unwrap_or(u64::MAX);
        Duration::new(secs, (nanos % 1_000_000_000) as u32)
    }

    /// How long to wait after attempt `attempt` failed: a random time in
    /// `[ceiling/2, ceiling]`.
    pub fn delay(&self, attempt: u32) -> Duration {
        jitter(self.ceiling(attempt))
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff::DEFAULT
    }
}

/// A random time in `[d/2, d]`, to the nanosecond.
pub(crate) fn jitter(d: Duration) -> Duration {
    let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
    if nanos < 2 {
        return d;
    }
    Duration::from_nanos(rand::random_range(nanos - nanos / 2..=nanos))
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn ceilings_double_up_to_the_cap() {
        let b = Backoff::exponential(S, 30 * S);
        let ceilings: Vec<_> = (1..=7).map(|n| b.ceiling(n).as_secs()).collect();
        assert_eq!(ceilings, [1, 2, 4, 8, 16, 30, 30]);
        assert_eq!(b.ceiling(0), S, "attempt 0 counts as the first");
        assert_eq!(b.ceiling(u32::MAX), 30 * S, "no overflow at huge attempts");
        let huge = Backoff::exponential(Duration::from_secs(u64::MAX / 4), Duration::MAX);
        assert_eq!(huge.ceiling(40), Duration::MAX, "saturates rather than overflowing");
        let fine = Backoff::exponential(Duration::from_nanos(1), Duration::MAX);
        assert_eq!(fine.ceiling(41), Duration::from_nanos(1 << 40), "past 2^31 doublings' worth");
    }

    #[test]
    fn fixed_is_the_same_ceiling_every_time() {
        let b = Backoff::fixed(2 * S);
        assert!((1..50).all(|n| b.ceiling(n) == 2 * S));
        assert_eq!(Backoff::exponential(5 * S, S), Backoff::fixed(5 * S), "cap raised to base");
    }

    #[test]
    fn delays_stay_within_half_to_whole_and_spread() {
        let b = Backoff::exponential(Duration::from_millis(100), 10 * S);
        for attempt in 1..12 {
            let ceiling = b.ceiling(attempt);
            let delays: Vec<_> = (0..200).map(|_| b.delay(attempt)).collect();
            assert!(delays.iter().all(|d| *d >= ceiling / 2 && *d <= ceiling), "{delays:?}");
            let (min, max) = (delays.iter().min().unwrap(), delays.iter().max().unwrap());
            assert!(*max - *min > ceiling / 4, "jittered over the range: {min:?}..{max:?}");
        }
        assert_eq!(Backoff::fixed(Duration::ZERO).delay(3), Duration::ZERO);
    }
}
