//! Publishing to Kafka from an idempotent producer, with a `message-id` header.

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

/// The header that carries the message id.
pub const MESSAGE_ID_HEADER: &str = "message-id";

/// Sends records with a `message-id` header from a producer with
/// `enable.idempotence=true`: the broker numbers each producer's records per
/// partition and drops a batch it already has, so the producer's own retries (after a
/// lost acknowledgement, a leader change) never store a record twice nor out of order
/// (`acks=all` is implied). A record the application sends again (after a
/// [`send`](KafkaPublisher::send) error, or from a restarted process) is a second
/// record: send it with the same id and key the consumer's handler on
/// `{message_id}`.
///
/// ```no_run
/// # async fn demo() -> Result<(), rdkafka::error::KafkaError> {
/// use idempotent_runtime::publish::kafka::KafkaPublisher;
/// use rdkafka::ClientConfig;
///
/// let mut config = ClientConfig::new();
/// config.set("bootstrap.servers", "127.0.0.1:9092");
/// let publisher = KafkaPublisher::create(&config)?;
/// let sent = publisher.send("orders", Some(b"42"), br#"{"order_id":42}"#, None).await?;
/// assert!(sent.offset >= 0, "stored at {}/{}", sent.partition, sent.offset);
/// # Ok(()) }
/// ```
pub struct KafkaPublisher {
    producer: FutureProducer,
    timeout: Duration,
}

/// Where a record was stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sent {
    /// The record's message id.
    pub id: String,
    /// Its partition.
    pub partition: i32,
    /// Its offset.
    pub offset: i64,
}

impl KafkaPublisher {
    /// Creates the producer from `config`, with `enable.idempotence=true` whatever
    /// `config` says.
    pub fn create(config: &ClientConfig) -> Result<KafkaPublisher, KafkaError> {
        let mut config = config.clone();
        config.set("enable.idempotence", "true");
        Ok(KafkaPublisher { producer: config.create()?, timeout: Duration::from_secs(30) })
    }

    /// How long a send may wait in the producer's queue (when it is full) before it
    /// fails; default 30 s. The delivery itself is bounded by the producer's
    /// `message.timeout.ms` (300 s by default).
    pub fn queue_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The producer, for flushing, transactions or metadata.
    pub fn producer(&self) -> &FutureProducer {
        &self.producer
    }

    /// Sends `payload` (with `key`, if any) to `topic` with the header `message-id`:
    /// `id`, or a fresh [`message_id`](super::message_id). Answers once the broker
    /// has stored it.
    pub async fn send(
        &self,
        topic: &str,
        key: Option<&[u8]>,
        payload: &[u8],
        id: Option<&str>,
    ) -> Result<Sent, KafkaError> {
        let id = id.map_or_else(super::message_id, str::to_owned);
        let headers =
            OwnedHeaders::new().insert(Header { key: MESSAGE_ID_HEADER, value: Some(&id) });
        let mut record = FutureRecord::to(topic).payload(payload).headers(headers);
        if let Some(key) = key {
            record = record.key(key);
        }
        let delivery = self.producer.send(record, self.timeout).await;
        let delivery = delivery.map_err(|(error, _)| error)?;
        Ok(Sent { id, partition: delivery.partition, offset: delivery.offset })
    }
}
