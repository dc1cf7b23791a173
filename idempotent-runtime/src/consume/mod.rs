//! Broker consumer loops that ack a delivery only after its outcome is recorded.
//!
//! Each loop reads deliveries, hands each to a handler (usually an `#[idempotent]`
//! function), and settles it by the result's [`Disposition`]:
//! `Ack` acks (commits), `Retry` leaves it for redelivery, `DeadLetter` moves it to the
//! broker's dead-letter destination. Because the handler's future resolves only after
//! the store recorded DONE or FAILED, no delivery is acked before its record is
//! written, and a consumer that dies mid-handler leaves its deliveries unacked for
//! redelivery.

#[cfg(any(feature = "rabbitmq", feature = "nats", feature = "kafka"))]
mod concurrent;

use std::time::Duration;

use crate::{Disposition, DispositionExt};

/// How many deliveries a consumer handles at once unless told otherwise (each
/// consumer's `concurrency`).
pub const DEFAULT_CONCURRENCY: usize = 32;

/// How long a consumer's deliveries in hand have to finish after a graceful
/// shutdown unless told otherwise (each consumer's `shutdown_grace`).
#[cfg(any(feature = "redis-streams", feature = "rabbitmq", feature = "nats", feature = "kafka"))]
pub(crate) const DEFAULT_GRACE: Duration = Duration::from_secs(30);

#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub mod kafka;
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub mod nats;
#[cfg(feature = "rabbitmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
pub mod rabbitmq;
#[cfg(feature = "redis-streams")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis-streams")))]
pub mod redis_streams;
#[cfg(feature = "rocketmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rocketmq")))]
pub mod rocketmq;

/// What a handler call answered: how to settle its delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Answer {
    pub(crate) disposition: Disposition,
    /// For a Retry: how long the delivery should wait, when the result says.
    pub(crate) retry_delay: Option<Duration>,
    in_progress: bool,
}

impl Answer {
    pub(crate) fn of(result: &impl DispositionExt) -> Answer {
        Answer {
            disposition: result.disposition(),
            retry_delay: result.retry_delay(),
            in_progress: result.is_in_progress(),
        }
    }

    /// For a Retry: the result's delay, else `default`.
    pub(crate) fn delay_or(&self, default: Duration) -> Duration {
        self.retry_delay.unwrap_or(default)
    }
}

/// The instant `delay` from now; a delay too long to count waits a year (a deadline
/// that is renewed, or a retry that no one waits that long for, in practice).
#[cfg(any(feature = "redis-streams", feature = "rabbitmq", feature = "nats", feature = "kafka"))]
pub(crate) fn deadline_after(delay: Duration) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    now.checked_add(delay).unwrap_or_else(|| now + Duration::from_secs(365 * 86_400))
}
