//! Kafka consumer groups, through `rdkafka` (a bundled librdkafka).

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use rdkafka::Offset;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Timestamp, TopicPartitionList};

use crate::{Disposition, DispositionExt, Payload, PayloadRef};

/// One record from a partition.
#[derive(Debug, Clone)]
pub struct KafkaMessage {
    /// Its topic.
    pub topic: String,
    /// Its partition.
    pub partition: i32,
    /// Its offset in the partition.
    pub offset: i64,
    /// Its key, if any.
    pub key: Option<Vec<u8>>,
    /// Its value (empty for a tombstone).
    pub payload: Vec<u8>,
    /// Its timestamp, if any, in milliseconds.
    pub timestamp: Option<i64>,
}

/// The value is the payload, for `{/json/pointer}` keys and `validate`.
impl Payload for KafkaMessage {
    fn payload(&self) -> PayloadRef<'_> {
        PayloadRef::Bytes(&self.payload)
    }
}

/// A consumer-group member that commits offsets only after the outcome is recorded.
///
/// The consumer must be created with `enable.auto.commit=false`.
/// [`next`](KafkaConsumer::next) settles each record by its handler's disposition:
///
/// * Ack → commit the record's offset + 1 (asynchronously: a commit lost in a crash
///   only means a redelivery, which the store turns into a duplicate);
/// * Retry → seek the partition back to the record. Records of that partition that
///   were already fetched behind it are skipped, neither handled nor committed, until
///   the record comes round again: the committed offset never passes a record that
///   has not been processed, and the partition stays in order;
/// * DeadLetter → produce the record (key, value) to the dead-letter topic, wait for
///   the broker to confirm, then commit past it.
///
/// A member that dies without committing leaves its records to the member that gets
/// its partitions, from the last committed offset.
///
/// ```no_run
/// # async fn demo() -> Result<(), rdkafka::error::KafkaError> {
/// use idempotent_runtime::consume::kafka::{KafkaConsumer, KafkaMessage};
/// use idempotent_runtime::{Error, Outcome};
/// use rdkafka::ClientConfig;
/// use rdkafka::consumer::{Consumer, StreamConsumer};
/// use rdkafka::producer::FutureProducer;
///
/// async fn handle(msg: KafkaMessage) -> Result<Outcome<()>, Error<std::io::Error>> {
///     // an #[idempotent] function
///     # let _ = msg; Ok(Outcome::Processed(()))
/// }
///
/// let consumer: StreamConsumer = ClientConfig::new()
///     .set("bootstrap.servers", "127.0.0.1:9092")
///     .set("group.id", "billing")
///     .set("enable.auto.commit", "false")
///     .create()?;
/// consumer.subscribe(&["orders"])?;
/// let producer: FutureProducer =
///     ClientConfig::new().set("bootstrap.servers", "127.0.0.1:9092").create()?;
/// let mut consumer = KafkaConsumer::new(consumer, producer, "orders.dead");
/// loop {
///     consumer.next(handle).await?;
/// }
/// # }
/// ```
pub struct KafkaConsumer {
    consumer: StreamConsumer,
    producer: FutureProducer,
    dead_letter_topic: String,
    retry_delay: Duration,
    /// Partitions rewound for a retry, and the offset they must come back to.
    rewound: HashMap<(String, i32), i64>,
}

impl KafkaConsumer {
    /// Wraps a subscribed (or assigned) consumer; `producer` writes dead letters to
    /// `dead_letter_topic`.
    pub fn new(
        consumer: StreamConsumer,
        producer: FutureProducer,
        dead_letter_topic: impl Into<String>,
    ) -> KafkaConsumer {
        KafkaConsumer {
            consumer,
            producer,
            dead_letter_topic: dead_letter_topic.into(),
            retry_delay: Duration::from_millis(500),
            rewound: HashMap::new(),
        }
    }

    /// How long to wait before re-reading a record left for retry; default 500 ms.
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// The wrapped consumer.
    pub fn consumer(&self) -> &StreamConsumer {
        &self.consumer
    }

    /// Receives the next record and settles it with `handler`'s disposition. `None`
    /// when the record was skipped because its partition is being rewound for a retry.
    pub async fn next<F, Fut, R>(&mut self, handler: F) -> Result<Option<Disposition>, KafkaError>
    where
        F: FnOnce(KafkaMessage) -> Fut,
        Fut: Future<Output = R>,
        R: DispositionExt,
    {
        let message = {
            let record = self.consumer.recv().await?;
            KafkaMessage {
                topic: record.topic().to_owned(),
                partition: record.partition(),
                offset: record.offset(),
                key: record.key().map(<[u8]>::to_vec),
                payload: record.payload().map(<[u8]>::to_vec).unwrap_or_default(),
                timestamp: match record.timestamp() {
                    Timestamp::NotAvailable => None,
                    Timestamp::CreateTime(t) | Timestamp::LogAppendTime(t) => Some(t),
                },
            }
        };
        let partition = (message.topic.clone(), message.partition);
        match self.rewound.get(&partition) {
            Some(&offset) if message.offset > offset => {
                // Fetched behind a record left for retry: not handled, not committed.
                // Seek again, in case the first seek was lost or the partition moved.
                self.rewind(&message.topic, message.partition, offset)?;
                return Ok(None);
            }
            // The record itself, or an earlier one (the partition was reassigned and
            // resumed from its committed offset): handle it normally.
            Some(_) => {
                self.rewound.remove(&partition);
            }
            None => {}
        }
        let (topic, index, offset) = (message.topic.clone(), message.partition, message.offset);
        let dead = (message.key.clone(), message.payload.clone());
        let disposition = handler(message).await.disposition();
        match disposition {
            Disposition::Ack => self.commit(&topic, index, offset)?,
            Disposition::Retry => {
                tokio::time::sleep(self.retry_delay).await;
                self.rewind(&topic, index, offset)?;
            }
            Disposition::DeadLetter => {
                let mut record = FutureRecord::to(&self.dead_letter_topic).payload(&dead.1);
                if let Some(key) = &dead.0 {
                    record = record.key(key);
                }
                let sent = self.producer.send(record, Duration::from_secs(10)).await;
                if let Err((error, _)) = sent {
                    // Not dead-lettered, so not committed: read it again.
                    self.rewind(&topic, index, offset)?;
                    return Err(error);
                }
                self.commit(&topic, index, offset)?;
            }
        }
        Ok(Some(disposition))
    }

    /// Makes `offset` the next record of the partition; until it comes back, records
    /// behind it are skipped. The rewind is recorded before the seek, so a failed seek
    /// still keeps later records from being committed past it.
    fn rewind(&mut self, topic: &str, partition: i32, offset: i64) -> Result<(), KafkaError> {
        self.rewound.insert((topic.to_owned(), partition), offset);
        // A zero timeout makes the seek asynchronous: no blocking in a task.
        self.consumer.seek(topic, partition, Offset::Offset(offset), Duration::ZERO)
    }

    fn commit(&self, topic: &str, partition: i32, offset: i64) -> Result<(), KafkaError> {
        let mut offsets = TopicPartitionList::new();
        offsets.add_partition_offset(topic, partition, Offset::Offset(offset + 1))?;
        self.consumer.commit(&offsets, CommitMode::Async)
    }
}
