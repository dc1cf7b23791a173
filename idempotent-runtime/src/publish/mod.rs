//! Publishing helpers, one per broker: every message gets a unique id in the broker's
//! own place for it, and the broker's own safeguards against producer retries are on.
//!
//! The consumer side keys on that id: each consumer's message type has a
//! `message_id` field, so `#[idempotent(key = "{message_id}")]` deduplicates by it.
//! A message without an id (or with one that is not UTF-8) has an empty
//! `message_id`, and a key using it is a key error: the message is dead-lettered
//! rather than taken for a duplicate of another id-less message.
//!
//! | broker | where the id goes | what the broker itself does about a resent publish |
//! | --- | --- | --- |
//! | RabbitMQ | the `message_id` property | nothing: publisher confirms make "sent" mean "stored", and a resend after a lost confirm stores a second copy |
//! | NATS JetStream | the `Nats-Msg-Id` header | stores it once within the stream's duplicate window (2 minutes by default) and answers the resend as a duplicate |
//! | Kafka | the `message-id` header | the idempotent producer (`enable.idempotence`) makes its own retries exactly-once per partition; a resend by the application is a second record |
//! | Redis Streams | the `message-id` field | nothing: a resent `XADD` is a second entry |
//! | RocketMQ | the `UNIQ_KEY` property (the client's own id), business keys in `KEYS` | nothing: the client keeps the id across its own retries of a send, but a resend by the application is a second message with a new id |
//!
//! Broker-side dedupe covers a producer's retries of one publish, within a window.
//! It does not cover a consumer's redeliveries (a crash before the ack, a rebalance,
//! a retry), nor two publishes of the same business event by different code paths,
//! nor a resend after the window: that is the consumer side's job, which is why the
//! handler still keys on the id.

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

/// A fresh message id: a UUIDv7 in its hyphenated text form. Version 7 ids start with
/// the time they were made, so one producer's ids sort by creation and index well.
///
/// ```
/// let (a, b) = (idempotent_runtime::publish::message_id(), idempotent_runtime::publish::message_id());
/// assert_ne!(a, b);
/// assert_eq!(a.len(), 36);
/// ```
pub fn message_id() -> String {
    uuid::Uuid::now_v7().hyphenated().to_string()
}

/// A message id read from the broker as bytes: the text when it is UTF-8, else empty
/// (so that two ids that differ only in invalid bytes can never read the same).
#[cfg(any(feature = "kafka", feature = "redis-streams"))]
pub(crate) fn id_text(bytes: &[u8]) -> String {
    std::str::from_utf8(bytes).map(str::to_owned).unwrap_or_default()
}
