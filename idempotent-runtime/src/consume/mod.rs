//! Broker consumer loops that ack a delivery only after its outcome is recorded.
//!
//! Each loop reads deliveries, hands each to a handler (usually an `#[idempotent]`
//! function), and settles it by the result's [`Disposition`](crate::Disposition):
//! `Ack` acks (commits), `Retry` leaves it for redelivery, `DeadLetter` moves it to the
//! broker's dead-letter destination. Because the handler's future resolves only after
//! the store recorded DONE or FAILED, no delivery is acked before its record is
//! written, and a consumer that dies mid-handler leaves its deliveries unacked for
//! redelivery.

#[cfg(any(feature = "rabbitmq", feature = "nats", feature = "kafka"))]
mod concurrent;

/// How many deliveries a consumer handles at once unless told otherwise (each
/// consumer's `concurrency`).
pub const DEFAULT_CONCURRENCY: usize = 32;

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
