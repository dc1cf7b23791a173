//! Kafka consumer groups, through `rdkafka` (a bundled librdkafka).

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientContext, Offset, Timestamp, TopicPartitionList};
use tokio::time::Instant;

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
    /// Its headers, in order.
    pub headers: Vec<(String, Option<Vec<u8>>)>,
}

/// The value is the payload, for `{/json/pointer}` keys and `validate`.
impl Payload for KafkaMessage {
    fn payload(&self) -> PayloadRef<'_> {
        PayloadRef::Bytes(&self.payload)
    }
}

/// A consumer-group member that commits offsets only after the outcome is recorded.
///
/// The consumer must be created with `enable.auto.commit=false` and with a
/// [`KafkaContext`] (`create_with_context(KafkaContext::default())`), which tells it
/// about rebalances. [`next`](KafkaConsumer::next) settles each record by its
/// handler's disposition:
///
/// * Ack → commit the record's offset + 1 (asynchronously: a commit lost in a crash
///   only means a redelivery, which the store turns into a duplicate);
/// * Retry → seek the partition back to the record and pause it for the retry delay;
///   the other partitions go on meanwhile, and the consumer keeps polling, so the
///   group does not take the partition away. Records of that partition already
///   fetched behind the record are skipped, neither handled nor committed, until it
///   comes round again: the committed offset never passes a record that has not been
///   processed, and the partition stays in order;
/// * DeadLetter → produce the record (key, value, headers, plus
///   `idempotent-source-topic`, `-partition` and `-offset`) to the dead-letter topic,
///   wait for the broker to confirm (at most [`dead_letter_timeout`](
///   KafkaConsumer::dead_letter_timeout)), then commit past it; a send that fails or
///   times out rewinds the partition instead.
///
/// A partition revoked or assigned in a rebalance forgets its pending retry, and a
/// record received before its partition was revoked is not committed: another member
/// owns the partition now and may have committed further. If the future returned by
/// `next` is dropped mid-record (a `select!`, a timeout), the record's partition is
/// rewound to it, so a later commit cannot pass it.
///
/// A member that dies without committing leaves its records to the member that gets
/// its partitions, from the last committed offset.
///
/// ```no_run
/// # async fn demo() -> Result<(), rdkafka::error::KafkaError> {
/// use idempotent_runtime::consume::kafka::{KafkaConsumer, KafkaContext, KafkaMessage};
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
/// let consumer: StreamConsumer<KafkaContext> = ClientConfig::new()
///     .set("bootstrap.servers", "127.0.0.1:9092")
///     .set("group.id", "billing")
///     .set("enable.auto.commit", "false")
///     .create_with_context(KafkaContext::default())?;
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
    consumer: StreamConsumer<KafkaContext>,
    producer: FutureProducer,
    dead_letter_topic: String,
    retry_delay: Duration,
    dead_letter_timeout: Duration,
}

/// The consumer context a [`KafkaConsumer`] needs: it learns of rebalances, so that a
/// partition that leaves and comes back does not resume from a stale retry, and a
/// record received before its partition was revoked is not committed.
#[derive(Clone, Default)]
pub struct KafkaContext {
    partitions: Arc<Mutex<Partitions>>,
}

/// What the consumer keeps per partition, keyed by (topic, partition).
#[derive(Default)]
struct Partitions {
    /// Partitions left for retry: the offset they resume from, and when.
    rewound: HashMap<(String, i32), Rewind>,
    /// Bumped at each assignment or revocation of the partition.
    epochs: HashMap<(String, i32), u64>,
}

#[derive(Clone, Copy)]
struct Rewind {
    offset: i64,
    due: Instant,
}

impl KafkaContext {
    fn state(&self) -> std::sync::MutexGuard<'_, Partitions> {
        self.partitions.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The partitions in `list` changed hands: forget their retries, and make
    /// records received before this unable to commit.
    fn rebalanced(&self, list: &TopicPartitionList) {
        let mut state = self.state();
        for element in list.elements() {
            let partition = (element.topic().to_owned(), element.partition());
            state.rewound.remove(&partition);
            *state.epochs.entry(partition).or_default() += 1;
        }
    }
}

impl ClientContext for KafkaContext {}

impl ConsumerContext for KafkaContext {
    fn pre_rebalance(&self, _: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(list) | Rebalance::Revoke(list) = rebalance {
            self.rebalanced(list);
        }
    }

    /// A partition paused for a retry before it was revoked must not come back
    /// paused, now that its retry is forgotten.
    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(list) = rebalance {
            if let Err(error) = consumer.resume(list) {
                tracing::warn!(%error, "resuming newly assigned partitions failed");
            }
        }
    }
}

impl KafkaConsumer {
    /// Wraps a subscribed (or assigned) consumer created with a [`KafkaContext`];
    /// `producer` writes dead letters to `dead_letter_topic`.
    pub fn new(
        consumer: StreamConsumer<KafkaContext>,
        producer: FutureProducer,
        dead_letter_topic: impl Into<String>,
    ) -> KafkaConsumer {
        KafkaConsumer {
            consumer,
            producer,
            dead_letter_topic: dead_letter_topic.into(),
            retry_delay: Duration::from_millis(500),
            dead_letter_timeout: Duration::from_secs(30),
        }
    }

    /// How long a partition with a record left for retry pauses; default 500 ms.
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// How long a dead-letter send may wait for the broker's confirmation before the
    /// record is rewound and the error returned; default 30 s (the producer's own
    /// `message.timeout.ms` is 300 s by default, as long as `max.poll.interval.ms`).
    pub fn dead_letter_timeout(mut self, timeout: Duration) -> Self {
        self.dead_letter_timeout = timeout;
        self
    }

    /// The wrapped consumer.
    pub fn consumer(&self) -> &StreamConsumer<KafkaContext> {
        &self.consumer
    }

    /// Receives the next record and settles it with `handler`'s disposition. `None`
    /// when the record was skipped because its partition is being rewound for a retry.
    /// Partitions whose retry delay is over are resumed first.
    pub async fn next<F, Fut, R>(&mut self, handler: F) -> Result<Option<Disposition>, KafkaError>
    where
        F: FnOnce(KafkaMessage) -> Fut,
        Fut: Future<Output = R>,
        R: DispositionExt,
    {
        let (message, epoch) = loop {
            let wake = self.resume_due()?;
            let record = match wake {
                Some(at) => tokio::select! {
                    record = self.consumer.recv() => record?,
                    () = tokio::time::sleep_until(at) => continue,
                },
                None => self.consumer.recv().await?,
            };
            let message = KafkaMessage {
                topic: record.topic().to_owned(),
                partition: record.partition(),
                offset: record.offset(),
                key: record.key().map(<[u8]>::to_vec),
                payload: record.payload().map(<[u8]>::to_vec).unwrap_or_default(),
                timestamp: match record.timestamp() {
                    Timestamp::NotAvailable => None,
                    Timestamp::CreateTime(t) | Timestamp::LogAppendTime(t) => Some(t),
                },
                headers: headers(&record),
            };
            let partition = (message.topic.clone(), message.partition);
            let mut state = self.consumer.context().state();
            let epoch = state.epochs.get(&partition).copied().unwrap_or(0);
            match state.rewound.get(&partition).copied() {
                Some(rewind) if message.offset > rewind.offset => {
                    // Fetched behind a record left for retry: not handled, not
                    // committed. Seek again, in case the first seek was lost.
                    drop(state);
                    self.seek(&message.topic, message.partition, rewind.offset)?;
                    return Ok(None);
                }
                // The record itself, or an earlier one: handle it normally.
                Some(_) => {
                    state.rewound.remove(&partition);
                }
                None => {}
            }
            break (message, epoch);
        };
        let (topic, index, offset) = (message.topic.clone(), message.partition, message.offset);
        let copy = message.clone();
        // From here until the record is settled, a dropped future, and any early return
        // below, rewinds the partition to it.
        let in_flight = InFlight { consumer: self, topic: &topic, partition: index, offset };
        let disposition = handler(message).await.disposition();
        match disposition {
            Disposition::Ack => self.commit(&topic, index, offset, epoch)?,
            Disposition::Retry => {
                self.rewind(&topic, index, offset, Instant::now() + self.retry_delay)?;
                let mut paused = TopicPartitionList::new();
                paused.add_partition(&topic, index);
                self.consumer.pause(&paused)?;
            }
            Disposition::DeadLetter => {
                // Not dead-lettered, so not committed: the guard rewinds to read it again.
                self.dead_letter(&copy).await?;
                self.commit(&topic, index, offset, epoch)?;
            }
        }
        // Settled: nothing to rewind.
        std::mem::forget(in_flight);
        Ok(Some(disposition))
    }

    /// Resumes the partitions whose retry delay is over; returns when the next one is.
    fn resume_due(&self) -> Result<Option<Instant>, KafkaError> {
        let now = Instant::now();
        let mut due = TopicPartitionList::new();
        let mut next = None::<Instant>;
        {
            let state = self.consumer.context().state();
            for ((topic, partition), rewind) in &state.rewound {
                if rewind.due <= now {
                    due.add_partition(topic, *partition);
                } else {
                    next = Some(next.map_or(rewind.due, |n| n.min(rewind.due)));
                }
            }
        }
        if due.count() > 0 {
            self.consumer.resume(&due)?;
        }
        Ok(next)
    }

    /// Makes `offset` the next record of the partition, from `due` on; until it comes
    /// back, records behind it are skipped. Recorded before the seek, so a failed seek
    /// still keeps later records from being committed past it.
    fn rewind(
        &self,
        topic: &str,
        partition: i32,
        offset: i64,
        due: Instant,
    ) -> Result<(), KafkaError> {
        let key = (topic.to_owned(), partition);
        self.consumer.context().state().rewound.insert(key, Rewind { offset, due });
        self.seek(topic, partition, offset)
    }

    fn seek(&self, topic: &str, partition: i32, offset: i64) -> Result<(), KafkaError> {
        // A zero timeout makes the seek asynchronous: no blocking in a task.
        self.consumer.seek(topic, partition, Offset::Offset(offset), Duration::ZERO)
    }

    /// Commits past the record, unless the partition changed hands since it was
    /// received: the new owner may have committed further, and the record will be
    /// seen again (a duplicate, for an idempotent handler).
    fn commit(
        &self,
        topic: &str,
        partition: i32,
        offset: i64,
        epoch: u64,
    ) -> Result<(), KafkaError> {
        let key = (topic.to_owned(), partition);
        let now = self.consumer.context().state().epochs.get(&key).copied().unwrap_or(0);
        if now != epoch {
            tracing::warn!(
                topic,
                partition,
                offset,
                "not committed: the partition was reassigned while the record was handled"
            );
            return Ok(());
        }
        let mut offsets = TopicPartitionList::new();
        offsets.add_partition_offset(topic, partition, Offset::Offset(offset + 1))?;
        self.consumer.commit(&offsets, CommitMode::Async)
    }

    /// Produces the record to the dead-letter topic and waits for the broker, at most
    /// the dead-letter timeout. A copy that the source headers make too large for the
    /// broker goes without them.
    async fn dead_letter(&self, message: &KafkaMessage) -> Result<(), KafkaError> {
        match self.send_dead_letter(message, true).await {
            Err(KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge)) => {
                self.send_dead_letter(message, false).await
            }
            other => other,
        }
    }

    async fn send_dead_letter(
        &self,
        message: &KafkaMessage,
        source: bool,
    ) -> Result<(), KafkaError> {
        let mut headers = OwnedHeaders::new();
        for (key, value) in &message.headers {
            headers = headers.insert(Header { key, value: value.as_deref() });
        }
        let (partition, offset) = (message.partition.to_string(), message.offset.to_string());
        if source {
            headers = headers
                .insert(Header {
                    key: "idempotent-source-topic",
                    value: Some(message.topic.as_bytes()),
                })
                .insert(Header {
                    key: "idempotent-source-partition",
                    value: Some(partition.as_bytes()),
                })
                .insert(Header { key: "idempotent-source-offset", value: Some(offset.as_bytes()) });
        }
        let mut record =
            FutureRecord::to(&self.dead_letter_topic).payload(&message.payload).headers(headers);
        if let Some(key) = &message.key {
            record = record.key(key);
        }
        let send = self.producer.send(record, self.dead_letter_timeout);
        match tokio::time::timeout(self.dead_letter_timeout, send).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err((error, _))) => Err(error),
            Err(_) => Err(KafkaError::MessageProduction(RDKafkaErrorCode::MessageTimedOut)),
        }
    }
}

/// The record's headers, with keys read as UTF-8 lossily. rdkafka's own header
/// accessors unwrap each key as UTF-8 and panic on one that is not, which any
/// producer can write: read through librdkafka instead.
fn headers(record: &rdkafka::message::BorrowedMessage<'_>) -> Vec<(String, Option<Vec<u8>>)> {
    use rdkafka::bindings as rd;
    let mut list: *mut rd::rd_kafka_headers_t = std::ptr::null_mut();
    // SAFETY: `record.ptr()` is the live message `record` borrows; librdkafka hands
    // back headers owned by that message, valid while `record` is, and writes only
    // through the out-pointers given.
    let found = unsafe { rd::rd_kafka_message_headers(record.ptr(), &mut list) };
    if found != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || list.is_null() {
        return Vec::new();
    }
    let mut out = Vec::new();
    for index in 0.. {
        let (mut name, mut value, mut size) = (std::ptr::null(), std::ptr::null(), 0usize);
        // SAFETY: as above; `index` past the last header answers an error, which
        // ends the loop, and the pointers are only read while `record` lives.
        let got =
            unsafe { rd::rd_kafka_header_get_all(list, index, &mut name, &mut value, &mut size) };
        if got != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || name.is_null() {
            break;
        }
        // SAFETY: librdkafka's header names are NUL-terminated, and values `size`
        // bytes long, owned by the message.
        let key = unsafe { std::ffi::CStr::from_ptr(name) }.to_string_lossy().into_owned();
        let value = (!value.is_null())
            .then(|| unsafe { std::slice::from_raw_parts(value.cast::<u8>(), size) }.to_vec());
        out.push((key, value));
    }
    out
}

/// A record being handled: if the future is dropped before the record is settled,
/// its partition is rewound to it (and its later records skipped until it is back).
struct InFlight<'a> {
    consumer: &'a KafkaConsumer,
    topic: &'a str,
    partition: i32,
    offset: i64,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let rewound = self.consumer.rewind(self.topic, self.partition, self.offset, Instant::now());
        if let Err(error) = rewound {
            tracing::warn!(%error, "rewinding a dropped record's partition failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A partition that changes hands forgets its pending retry (it would otherwise
    /// seek a returning partition back to a stale offset), and records received
    /// before can no longer commit.
    #[test]
    fn a_rebalance_forgets_retries_and_fences_older_records() {
        let context = KafkaContext::default();
        let rewind = Rewind { offset: 7, due: Instant::now() };
        context.state().rewound.insert(("orders".to_owned(), 0), rewind);
        context.state().rewound.insert(("orders".to_owned(), 1), rewind);
        let mut moved = TopicPartitionList::new();
        moved.add_partition("orders", 0);
        context.rebalanced(&moved);
        let state = context.state();
        assert!(!state.rewound.contains_key(&("orders".to_owned(), 0)));
        assert!(state.rewound.contains_key(&("orders".to_owned(), 1)));
        assert_eq!(state.epochs.get(&("orders".to_owned(), 0)), Some(&1));
        assert_eq!(state.epochs.get(&("orders".to_owned(), 1)), None);
    }
}
