//! Kafka consumer groups, through `rdkafka` (a bundled librdkafka): at least once
//! ([`KafkaConsumer`], offsets committed after each outcome is recorded) or exactly
//! once for what is produced back to Kafka ([`ExactlyOnceConsumer`], outputs and
//! offsets in one transaction).

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

mod exactly_once;

pub use exactly_once::{ExactlyOnceConsumer, Output, OutputRecord, Produced, Transformed};

use super::DEFAULT_CONCURRENCY;
use super::DEFAULT_GRACE;
use super::concurrent::{Stop, settle_concurrently};
use super::{Answer, deadline_after};
use crate::metrics::ConsumerMeter;
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
    /// Its first `message-id` header, as
    /// [`KafkaPublisher`](crate::publish::kafka::KafkaPublisher) sets it: for
    /// `key = "{message_id}"`. Empty when it has none (or it is not UTF-8), so a key
    /// using it is a key error.
    pub message_id: String,
}

impl KafkaMessage {
    /// A copy of a received record.
    fn of(record: &rdkafka::message::BorrowedMessage<'_>) -> KafkaMessage {
        let headers = headers(record);
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
            message_id: message_id(&headers),
            headers,
        }
    }
}

/// The value is the payload, for `{/json/pointer}` keys and `validate`.
impl Payload for KafkaMessage {
    fn payload(&self) -> PayloadRef<'_> {
        PayloadRef::Bytes(&self.payload)
    }
}

/// A consumer-group member that commits offsets only after the outcome is recorded.
///
/// The consumer must be created with `enable.auto.commit=false` (`run` and `next`
/// refuse one that commits by itself, librdkafka's default) and with a
/// [`KafkaContext`] (`create_with_context(KafkaContext::default())`), which tells it
/// about rebalances. [`run`](KafkaConsumer::run) handles up to
/// [`concurrency`](KafkaConsumer::concurrency) records at once (default 32), across
/// partitions and within each; [`next`](KafkaConsumer::next) handles one. Each record
/// is settled by its handler's disposition:
///
/// * Ack → the partition's commit moves past the record once every record before it
///   is settled too: the committed offset never passes a record still being handled
///   or left for retry. `run` sends the offsets reached every
///   [`commit_interval`](KafkaConsumer::commit_interval) (100 ms), all partitions in
///   one commit; `next` after each record. Commits are asynchronous: a commit lost
///   in a crash only means a redelivery, which the store turns into a duplicate;
/// * Retry → seek the partition back to the record and pause it for the result's
///   [`retry_delay`](DispositionExt::retry_delay) (the handler's `backoff`, or the
///   other claim's lease for `InProgress`; the consumer's
///   [`retry_delay`](KafkaConsumer::retry_delay) for results that don't say); the
///   other partitions go on meanwhile, and the consumer keeps polling, so the
///   group does not take the partition away. Records of that partition already
///   fetched behind the record are skipped, neither handled nor committed, until it
///   comes round again: the committed offset never passes a record that has not been
///   processed. Under `run`, the partition's records already in flight finish, and
///   are read again (as duplicates) when the record comes round; one of them left
///   for retry in turn, before the partition has read up to it again, is neither
///   sought to nor paused for: it comes round as the partition reads on;
/// * DeadLetter → produce the record (key, value, headers, plus
///   `idempotent-source-topic`, `-partition` and `-offset`) to the dead-letter topic,
///   wait for the broker to confirm (at most [`dead_letter_timeout`](
///   KafkaConsumer::dead_letter_timeout)), then commit past it; a send that fails or
///   times out rewinds the partition instead.
///
/// A partition revoked or assigned in a rebalance forgets its pending retry, and a
/// record received before its partition was revoked is not committed: another member
/// owns the partition now and may have committed further. If the future returned by
/// `next` or `run` is dropped mid-record (a `select!`, a timeout), the record's
/// partition is rewound to it, so a later commit cannot pass it.
///
/// Order: `run` handles the records of one partition that share a key one after the
/// other, in offset order, each starting once the one before it is settled, and so
/// the partition's records without a key; records of different keys run side by
/// side. A retried record holds back the records of its key behind it: they are read
/// again after it. So an entity whose updates are keyed by its id sees them in order,
/// as Kafka promises per partition; a handler that needs a whole partition in order,
/// across keys, wants `concurrency(1)`.
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
/// let consumer = KafkaConsumer::new(consumer, producer, "orders.dead").concurrency(32);
/// consumer.run(handle).await
/// # }
/// ```
pub struct KafkaConsumer {
    consumer: StreamConsumer<KafkaContext>,
    producer: FutureProducer,
    dead_letter_topic: String,
    retry_delay: Duration,
    dead_letter_timeout: Duration,
    concurrency: usize,
    commit_interval: Duration,
    grace: Duration,
    /// While [`run_until`](KafkaConsumer::run_until) stops: the records let go then
    /// (topic, partition, offset, assignment), rewound only once the settled offsets
    /// are committed. A rewind would drop the settles of the records in flight beside
    /// them from the commit (the partition reads those again), so a graceful stop
    /// would hand its last records to the next owner to run again.
    stopping: Mutex<Option<Vec<LetGo>>>,
    /// Told of each rewind, so that a receive already waiting for a record works out
    /// again when the paused partition is due to resume.
    rewound: tokio::sync::Notify,
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
    /// What is in hand and settled, for the offset to commit.
    tracks: HashMap<(String, i32), Track>,
    /// When the settled offsets were last committed.
    flushed: Option<Instant>,
}

/// A partition's records in hand and settled since it was assigned.
#[derive(Default)]
struct Track {
    /// Offsets received and not settled yet: the commit stays below the lowest.
    in_hand: std::collections::BTreeSet<i64>,
    /// Past the highest record settled (acked or dead-lettered) since the last
    /// rewind; records received before that rewind do not move it, since the
    /// partition reads them again.
    settled: Option<i64>,
    /// Bumped at each rewind.
    rewinds: u64,
    /// The offset the partition reads next: past the last record received, or the
    /// offset it was rewound to since. A rewind never seeks past it.
    next: Option<i64>,
    /// The offset last committed, or to commit at the next flush.
    committed: Option<i64>,
    /// `committed` is not sent yet.
    dirty: bool,
}

impl Partitions {
    /// A record is in hand; answers the partition's rewinds so far.
    fn received(&mut self, partition: (String, i32), offset: i64) -> u64 {
        let track = self.tracks.entry(partition).or_default();
        track.in_hand.insert(offset);
        track.next = Some(offset + 1);
        track.rewinds
    }

    /// A record was acked or dead-lettered: the partition's commit may move on.
    /// `false` if the partition was reassigned since the record was received (its
    /// new owner commits).
    fn settled(
        &mut self,
        topic: &str,
        partition: i32,
        offset: i64,
        epoch: u64,
        rewinds: u64,
    ) -> bool {
        let key = (topic.to_owned(), partition);
        if self.epochs.get(&key).copied().unwrap_or(0) != epoch {
            return false;
        }
        let rewind = self.rewound.get(&key).map(|r| r.offset);
        let track = self.tracks.entry(key).or_default();
        track.in_hand.remove(&offset);
        if rewinds == track.rewinds {
            track.settled = Some(track.settled.map_or(offset + 1, |s| s.max(offset + 1)));
        }
        if let Some(offset) = track.committable(rewind) {
            if track.committed.is_none_or(|committed| offset > committed) {
                track.committed = Some(offset);
                track.dirty = true;
            }
        }
        true
    }

    /// The record at `offset` is to be read again from `due` on; answers what that
    /// asks of the partition (a rewind already pending to an earlier offset is kept,
    /// and a pending rewind is due at the later of the two instants).
    fn rewind(
        &mut self,
        topic: &str,
        partition: i32,
        offset: i64,
        epoch: u64,
        due: Instant,
    ) -> Rewound {
        let key = (topic.to_owned(), partition);
        if self.epochs.get(&key).copied().unwrap_or(0) != epoch {
            return Rewound::Stale;
        }
        let track = self.tracks.entry(key.clone()).or_default();
        track.in_hand.remove(&offset);
        track.rewinds += 1;
        track.settled = track.settled.map(|settled| settled.min(offset));
        let pending = self.rewound.contains_key(&key);
        if !pending && track.next.is_some_and(|next| offset >= next) {
            return Rewound::Ahead;
        }
        let rewind = self.rewound.entry(key).or_insert(Rewind::new(offset, due));
        // The partition reads both records again once it resumes, one right after
        // the other: it waits until the later of their delays is over, so neither is
        // retried before its own.
        rewind.offset = rewind.offset.min(offset);
        rewind.due = rewind.due.max(due);
        track.next = Some(rewind.offset);
        Rewound::Seek(rewind.offset)
    }
}

/// What a record left for retry asks of its partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rewound {
    /// A record of an earlier assignment: nothing, the partition is no longer its to
    /// rewind.
    Stale,
    /// Seek to this offset, and pause until the rewind is due.
    Seek(i64),
    /// The partition has not read up to the record again since an earlier rewind (it
    /// was in hand from before): the record comes round as the partition reads on.
    /// Seeking to it would jump over the records between, among them any left for
    /// retry before; seeking to where the partition is would name an offset that may
    /// hold no record (a transaction marker, a compacted one), which the skip of
    /// records behind a rewind would wait for for ever.
    Ahead,
}

impl Track {
    /// The offset every record below which is settled: past the highest settled
    /// record, but not past a record still in hand nor a rewind.
    fn committable(&self, rewind: Option<i64>) -> Option<i64> {
        let limit = [self.in_hand.first().copied(), rewind].into_iter().flatten().min();
        let settled = self.settled?;
        Some(limit.map_or(settled, |limit| settled.min(limit)))
    }
}

#[derive(Clone, Copy)]
struct Rewind {
    offset: i64,
    due: Instant,
    /// When the log start was last asked for, to see whether the record is gone.
    checked: Option<Instant>,
}

impl Rewind {
    fn new(offset: i64, due: Instant) -> Rewind {
        Rewind { offset, due, checked: None }
    }
}

/// The topics `consumer` is subscribed to, joined by commas (empty if it can't tell).
fn subscribed(consumer: &StreamConsumer<KafkaContext>) -> String {
    match consumer.subscription() {
        Ok(list) => {
            let mut topics: Vec<String> =
                list.elements().iter().map(|e| e.topic().to_owned()).collect();
            topics.dedup();
            topics.join(",")
        }
        Err(_) => String::new(),
    }
}

/// Resumes the partitions whose retry delay is over; returns when the next one is.
fn resume_due(consumer: &StreamConsumer<KafkaContext>) -> Result<Option<Instant>, KafkaError> {
    let now = Instant::now();
    let mut due = TopicPartitionList::new();
    let mut next = None::<Instant>;
    for ((topic, partition), rewind) in &consumer.context().state().rewound {
        if rewind.due <= now {
            due.add_partition(topic, *partition);
        } else {
            next = Some(next.map_or(rewind.due, |n| n.min(rewind.due)));
        }
    }
    if due.count() > 0 {
        consumer.resume(&due)?;
    }
    Ok(next)
}

/// Skips a record fetched behind its partition's pending rewind, seeking back to the
/// rewind again (the first seek may not have been applied yet).
///
/// A rewind whose record is no longer in the log (retention or DeleteRecords removed
/// it while the partition was paused) would skip every record for ever: the seek to
/// it lands on the log start, past it. So once the partition skips for a second past
/// the rewind's due time, its log start is asked for (at most once a second); if it is
/// past the record, the partition is sought to the log start and waits for that seek
/// (every record received after it is read anew), and the rewind is dropped.
fn skip_behind_rewind(
    consumer: &StreamConsumer<KafkaContext>,
    topic: &str,
    partition: i32,
) -> Result<(), KafkaError> {
    let key = (topic.to_owned(), partition);
    let now = Instant::now();
    let (offset, check) = {
        let mut state = consumer.context().state();
        let Some(rewind) = state.rewound.get_mut(&key) else { return Ok(()) };
        let second = Duration::from_secs(1);
        let check =
            now >= rewind.due + second && rewind.checked.is_none_or(|at| now >= at + second);
        if check {
            rewind.checked = Some(now);
        }
        (rewind.offset, check)
    };
    if check {
        let timeout = Duration::from_secs(5);
        let (low, _) = blocking(|| consumer.fetch_watermarks(topic, partition, timeout))?;
        if low > offset {
            tracing::warn!(
                topic,
                partition,
                offset,
                log_start = low,
                "a record left for retry is no longer in the log (retention or DeleteRecords \
                 removed it): the partition goes on from its log start"
            );
            blocking(|| consumer.seek(topic, partition, Offset::Offset(low), timeout))?;
            consumer.context().state().rewound.remove(&key);
            return Ok(());
        }
    }
    // A zero timeout makes the seek asynchronous: no blocking in a task.
    consumer.seek(topic, partition, Offset::Offset(offset), Duration::ZERO)
}

/// Runs a blocking librdkafka call from a task: on a multi-threaded runtime without
/// holding up the other tasks of its thread.
fn blocking<T>(call: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(call),
        _ => call(),
    }
}

impl KafkaContext {
    fn state(&self) -> std::sync::MutexGuard<'_, Partitions> {
        self.partitions.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Commits, synchronously, the settled offsets of `list`'s partitions not sent yet.
    fn commit_revoked(&self, consumer: &BaseConsumer<Self>, list: &TopicPartitionList) {
        let mut offsets = TopicPartitionList::new();
        {
            let mut state = self.state();
            for element in list.elements() {
                let key = (element.topic().to_owned(), element.partition());
                let Some(track) = state.tracks.get_mut(&key) else { continue };
                if let (true, Some(offset)) = (track.dirty, track.committed) {
                    let added = offsets.add_partition_offset(&key.0, key.1, Offset::Offset(offset));
                    track.dirty = added.is_err();
                }
            }
        }
        if offsets.count() > 0 {
            if let Err(error) = consumer.commit(&offsets, CommitMode::Sync) {
                tracing::warn!(%error, "committing revoked partitions' settled offsets failed");
            }
        }
    }

    /// The partitions in `list` changed hands: forget their retries, and make
    /// records received before this unable to commit.
    fn rebalanced(&self, list: &TopicPartitionList) {
        let mut state = self.state();
        for element in list.elements() {
            let partition = (element.topic().to_owned(), element.partition());
            state.rewound.remove(&partition);
            state.tracks.remove(&partition);
            *state.epochs.entry(partition).or_default() += 1;
        }
    }
}

impl ClientContext for KafkaContext {}

impl ConsumerContext for KafkaContext {
    /// Commits what was settled on partitions being revoked before forgetting them:
    /// their new owner would otherwise read those records again.
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(list) = rebalance {
            self.commit_revoked(consumer, list);
        }
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
            concurrency: DEFAULT_CONCURRENCY,
            commit_interval: Duration::from_millis(100),
            grace: DEFAULT_GRACE,
            stopping: Mutex::new(None),
            rewound: tokio::sync::Notify::new(),
        }
    }

    /// How many records [`run`](KafkaConsumer::run) handles at once, across the
    /// assigned partitions and within each; default [`DEFAULT_CONCURRENCY`] (32).
    pub fn concurrency(mut self, in_flight: usize) -> Self {
        self.concurrency = in_flight.max(1);
        self
    }

    /// How long the calls in flight have to finish after [`run_until`]'s shutdown;
    /// default 30 s. Keep it under what the deploy waits before it kills the process.
    ///
    /// [`run_until`]: KafkaConsumer::run_until
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// How often [`run`](KafkaConsumer::run) commits the offsets its settled records
    /// reached, in one commit for all partitions; default 100 ms. A crash loses at
    /// most this much of commits, which means redeliveries the store answers as
    /// duplicates. `Duration::ZERO` commits after each record, as
    /// [`next`](KafkaConsumer::next) does.
    pub fn commit_interval(mut self, interval: Duration) -> Self {
        self.commit_interval = interval;
        self
    }

    /// How long a partition with a record left for retry pauses when the handler's
    /// result does not say ([`DispositionExt::retry_delay`] is `None`); default 500 ms.
    /// Also how long a record met `InProgress` waits for the calls beside it (see
    /// [`run`](KafkaConsumer::run)).
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

    /// Handles records until receiving, a settle or a commit fails, with that error: up
    /// to [`concurrency`](KafkaConsumer::concurrency) handler calls at once, across
    /// partitions and within one, each record settled by its own result as soon as its
    /// call returns, as [`next`](KafkaConsumer::next) settles one. A partition's
    /// committed offset never passes a record that is not settled: the commit is the
    /// lowest offset below which every record is acked or dead-lettered, sent every
    /// [`commit_interval`](KafkaConsumer::commit_interval) for all partitions at once.
    /// A record left for retry rewinds its partition as `next` does; its records
    /// already in flight finish, and are read again (duplicates) once the record comes
    /// round. Records of one partition with the same key run one after the other, in
    /// offset order (see the type's documentation). A record whose call answered
    /// `InProgress` while other calls ran is handled once more after them (it may have met a record of the same key here), if
    /// they return within the retry delay; otherwise it is settled by its first answer.
    /// After an error the calls in flight still return and are settled before `run`
    /// answers it. Records in hand when the future is dropped, or waiting for a second
    /// call when it fails, rewind their partitions to the lowest of them; settled
    /// offsets not yet committed are committed then.
    pub async fn run<F, Fut, R>(&self, handler: F) -> Result<(), KafkaError>
    where
        F: FnMut(KafkaMessage) -> Fut,
        Fut: Future<Output = R>,
        R: DispositionExt,
    {
        self.run_until(handler, std::future::pending()).await
    }

    /// As [`run`](KafkaConsumer::run), until `shutdown` resolves (a signal, a deploy's
    /// stop): then no more records are taken, the records in hand (in flight, queued
    /// behind a record of their key, waiting for a second call) finish and are
    /// settled, the offsets settled are committed and the broker's answer awaited, and
    /// `run_until` answers `Ok`. Records fetched but not taken are not committed: the
    /// partition's next owner reads them; the same consumer can run again. Calls still running
    /// [`shutdown_grace`](KafkaConsumer::shutdown_grace) after the shutdown are dropped
    /// then (their claims released, their records read again). Drop the consumer
    /// afterwards to leave the group at once rather than after its session timeout.
    pub async fn run_until<F, Fut, R>(
        &self,
        mut handler: F,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), KafkaError>
    where
        F: FnMut(KafkaMessage) -> Fut,
        Fut: Future<Output = R>,
        R: DispositionExt,
    {
        refuse_auto_commit(&self.consumer)?;
        // Dropped after the flush below (locals drop in reverse): however this future
        // ends (returned, dropped during the grace, unwound by a handler's panic), the
        // records let go while stopping are rewound once their commit is made.
        let _rewind_at_exit = RewindLetGo(self);
        let _flush_at_exit = FlushOnDrop(self);
        let meter = self.meter();
        let deliveries = futures_util::stream::unfold((), move |()| async move {
            loop {
                match self.receive().await {
                    Ok(Some(held)) => return Some((Ok(held), ())),
                    Ok(None) => {}
                    Err(error) => return Some((Err(error), ())),
                }
            }
        });
        let (stopped_tx, stopped) = tokio::sync::oneshot::channel::<()>();
        let signal = async move {
            shutdown.await;
            *lock(&self.stopping) = Some(Vec::new());
            let _ = stopped_tx.send(());
        };
        let settle = settle_concurrently(
            deliveries,
            self.concurrency,
            self.retry_delay,
            &meter,
            Stop { signal, grace: self.grace },
            |held: &Held<'_>| Some(lane(&held.message, held.epoch)),
            |held: &Held<'_>| handler(held.message.clone()),
            |held, answer| async move {
                self.settle(held, answer).await?;
                if self.flush_due() { self.flush() } else { Ok(()) }
            },
        );
        // Commits on a timer of its own, beside the settle loop, which polls for
        // records only while it has room: settled offsets are committed within the
        // interval while the partitions are idle and while every slot is busy. One
        // timer for the whole run (each timer made and dropped takes a lock of Tokio's
        // timer driver). With a zero interval every settle commits.
        let interval = self.commit_interval;
        let commits = async {
            if interval.is_zero() {
                return std::future::pending().await;
            }
            let mut timer = Box::pin(tokio::time::sleep(interval));
            loop {
                timer.as_mut().await;
                timer.as_mut().reset(Instant::now() + interval);
                if self.flush_due() {
                    if let Err(error) = self.flush() {
                        // The next flush sends the same offsets again.
                        tracing::warn!(%error, "committing settled offsets failed");
                    }
                }
            }
        };
        let ran = tokio::select! {
            biased;
            result = settle => result,
            never = commits => never,
        };
        if stopped.await.is_ok() {
            // Stopped: the settled offsets reach the broker before the caller drops the
            // consumer and leaves the group, so the next owner starts after them; then
            // the records let go are rewound, for a consumer that runs again.
            self.flush_with(CommitMode::Sync)?;
        }
        ran
    }

    /// Receives the next record and settles it with `handler`'s disposition,
    /// committing at once. `None` when the record was skipped because its partition
    /// is being rewound for a retry. Partitions whose retry delay is over are resumed
    /// first. One record at a time; see [`run`](KafkaConsumer::run) for many.
    pub async fn next<F, Fut, R>(&mut self, handler: F) -> Result<Option<Disposition>, KafkaError>
    where
        F: FnOnce(KafkaMessage) -> Fut,
        Fut: Future<Output = R>,
        R: DispositionExt,
    {
        refuse_auto_commit(&self.consumer)?;
        let Some(held) = self.receive().await? else { return Ok(None) };
        let meter = self.meter();
        meter.taken(1);
        let answer = Answer::of(&handler(held.message.clone()).await);
        self.settle(held, answer).await?;
        self.flush()?;
        meter.settled(answer.disposition);
        Ok(Some(answer.disposition))
    }

    /// Counts this consumer's deliveries under the topics it is subscribed to.
    fn meter(&self) -> ConsumerMeter {
        ConsumerMeter::new("kafka", &subscribed(&self.consumer))
    }

    /// Receives the next record, resuming the partitions whose retry delay is over
    /// first; `None` for a record fetched behind a record left for retry (skipped:
    /// neither handled nor committed).
    async fn receive(&self) -> Result<Option<Held<'_>>, KafkaError> {
        let record = loop {
            // Made before the due partitions are resumed: a rewind recorded from here
            // on, while this waits (the settle loop runs beside it), wakes it.
            let rewound = self.rewound.notified();
            let wake = self.resume_due()?;
            let due = async {
                match wake {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                record = self.consumer.recv() => break record?,
                () = due => continue,
                () = rewound => continue,
            }
        };
        let message = KafkaMessage::of(&record);
        drop(record);
        let partition = (message.topic.clone(), message.partition);
        let mut state = self.consumer.context().state();
        let epoch = state.epochs.get(&partition).copied().unwrap_or(0);
        match state.rewound.get(&partition).copied() {
            Some(rewind) if message.offset > rewind.offset => {
                // Fetched behind a record left for retry: not handled, not
                // committed.
                drop(state);
                skip_behind_rewind(&self.consumer, &message.topic, message.partition)?;
                return Ok(None);
            }
            // The record itself, or an earlier one: handle it normally.
            Some(_) => {
                state.rewound.remove(&partition);
            }
            None => {}
        }
        let rewinds = state.received(partition, message.offset);
        drop(state);
        Ok(Some(Held { consumer: self, message, epoch, rewinds, settled: false }))
    }

    /// Settles a received record by its disposition (a commit, if any, is left to the
    /// next flush). On an error the record is unsettled, and dropping it rewinds its
    /// partition to it.
    async fn settle(&self, mut held: Held<'_>, answer: Answer) -> Result<(), KafkaError> {
        let (topic, partition, offset) =
            (held.message.topic.as_str(), held.message.partition, held.message.offset);
        match answer.disposition {
            Disposition::Ack => self.settled(&held),
            Disposition::Retry => {
                // The partition is polled meanwhile, so the group keeps it.
                let due = deadline_after(answer.delay_or(self.retry_delay));
                // A record of an earlier assignment pauses nothing: the partition is
                // another assignment's now (maybe this member's again), and with no
                // retry of its own pending nothing would resume it. Nor does one the
                // partition reads again anyway.
                if self.rewind(topic, partition, offset, held.epoch, due)? {
                    let mut paused = TopicPartitionList::new();
                    paused.add_partition(topic, partition);
                    self.consumer.pause(&paused)?;
                }
            }
            Disposition::DeadLetter => {
                // Not dead-lettered, so not settled: the held record rewinds.
                self.dead_letter(&held.message).await?;
                self.settled(&held);
            }
        }
        held.settled = true;
        Ok(())
    }

    /// Marks the record acked or dead-lettered, moving its partition's commit on.
    fn settled(&self, held: &Held<'_>) {
        let m = &held.message;
        let mut state = self.consumer.context().state();
        if !state.settled(&m.topic, m.partition, m.offset, held.epoch, held.rewinds) {
            tracing::warn!(
                topic = %m.topic,
                partition = m.partition,
                offset = m.offset,
                "not committed: the partition was reassigned while the record was handled"
            );
        }
    }

    fn flush_due(&self) -> bool {
        let state = self.consumer.context().state();
        state.flushed.is_none_or(|at| at.elapsed() >= self.commit_interval)
    }

    /// Commits, in one asynchronous commit, the offsets the settled records of each
    /// partition reached since the last flush.
    fn flush(&self) -> Result<(), KafkaError> {
        self.flush_with(CommitMode::Async)
    }

    /// [`flush`](Self::flush), the commit sent as `mode` says (`Sync` waits for the
    /// broker's answer, blocking the thread meanwhile).
    fn flush_with(&self, mode: CommitMode) -> Result<(), KafkaError> {
        let mut offsets = TopicPartitionList::new();
        {
            let mut state = self.consumer.context().state();
            state.flushed = Some(Instant::now());
            for ((topic, partition), track) in &mut state.tracks {
                if let (true, Some(offset)) = (track.dirty, track.committed) {
                    offsets.add_partition_offset(topic, *partition, Offset::Offset(offset))?;
                    track.dirty = false;
                }
            }
        }
        if offsets.count() == 0 {
            return Ok(());
        }
        self.consumer.commit(&offsets, mode)
    }

    /// Resumes the partitions whose retry delay is over; returns when the next one is.
    fn resume_due(&self) -> Result<Option<Instant>, KafkaError> {
        resume_due(&self.consumer)
    }

    /// Makes `offset` the next record of the partition, from `due` on; until it comes
    /// back, records behind it are skipped, and the partition's commit stays below
    /// it. A rewind already pending to an earlier offset is kept. Recorded before the
    /// seek, so a failed seek still keeps later records from being committed past
    /// it. Answers whether it sought: nothing happens for a record of an earlier
    /// assignment (`epoch`), whose partition is no longer its to rewind, nor for one
    /// the partition has yet to read again since an earlier rewind ([`Rewound::Ahead`]).
    fn rewind(
        &self,
        topic: &str,
        partition: i32,
        offset: i64,
        epoch: u64,
        due: Instant,
    ) -> Result<bool, KafkaError> {
        let rewound = self.consumer.context().state().rewind(topic, partition, offset, epoch, due);
        let Rewound::Seek(target) = rewound else { return Ok(false) };
        self.rewound.notify_one();
        self.seek(topic, partition, target)?;
        Ok(true)
    }

    fn seek(&self, topic: &str, partition: i32, offset: i64) -> Result<(), KafkaError> {
        // A zero timeout makes the seek asynchronous: no blocking in a task.
        self.consumer.seek(topic, partition, Offset::Offset(offset), Duration::ZERO)
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
        let headers = dead_letter_headers(message, source);
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

/// A dead letter's headers: the record's own, and (with `source`) where it came from,
/// as `idempotent-source-topic`, `-partition` and `-offset`.
fn dead_letter_headers(message: &KafkaMessage, source: bool) -> OwnedHeaders {
    let mut headers = OwnedHeaders::new();
    for (key, value) in &message.headers {
        headers = headers.insert(Header { key, value: value.as_deref() });
    }
    if source {
        let (partition, offset) = (message.partition.to_string(), message.offset.to_string());
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
    headers
}

/// The records handled one after the other, in offset order: those of one partition
/// with the same key, or, for records without a key, the partition's keyless ones,
/// within one assignment of the partition (a record still in flight from an earlier
/// one cannot commit, and must not hold up the new owner's records). Two lanes whose
/// numbers collide are merely kept in one order.
fn lane(message: &KafkaMessage, epoch: u64) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::hash::DefaultHasher::new();
    (&message.topic, message.partition, &message.key, epoch).hash(&mut hasher);
    hasher.finish()
}

/// What a created client was configured with for `name` (librdkafka's default when
/// the settings did not say); `None` for a setting librdkafka does not know.
fn configured<C: ClientContext>(client: &rdkafka::client::Client<C>, name: &str) -> Option<String> {
    use rdkafka::bindings as rd;
    let name = std::ffi::CString::new(name).ok()?;
    let mut value = [0u8; 64];
    let mut size = value.len();
    // SAFETY: `rd_kafka_conf` answers the live client's own configuration, which
    // lives as long as `client`; `rd_kafka_conf_get` writes at most `size` bytes,
    // NUL-terminated, into `value` and the length needed into `size`.
    let answer = unsafe {
        let conf = rd::rd_kafka_conf(client.native_ptr());
        rd::rd_kafka_conf_get(conf, name.as_ptr(), value.as_mut_ptr().cast(), &mut size)
    };
    if answer != rd::rd_kafka_conf_res_t::RD_KAFKA_CONF_OK {
        return None;
    }
    std::ffi::CStr::from_bytes_until_nul(&value).ok()?.to_str().ok().map(str::to_owned)
}

/// Refuses a consumer created with `enable.auto.commit` on, librdkafka's default: it
/// commits the offsets of records as they are polled, past records still being
/// handled or left for a retry, which a crash or a rebalance then loses for good.
pub(super) fn refuse_auto_commit(
    consumer: &StreamConsumer<KafkaContext>,
) -> Result<(), KafkaError> {
    match configured(consumer.client(), "enable.auto.commit").as_deref() {
        Some("false") => Ok(()),
        _ => Err(KafkaError::ClientCreation(
            "the consumer commits by itself (enable.auto.commit is true, librdkafka's default): it would commit records before their outcome is recorded, and a crash or a rebalance would lose them. Create it with .set(\"enable.auto.commit\", \"false\")".into(),
        )),
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

/// The first `message-id` header's value, if it is UTF-8.
fn message_id(headers: &[(String, Option<Vec<u8>>)]) -> String {
    (headers.iter())
        .find(|(name, _)| name == crate::publish::kafka::MESSAGE_ID_HEADER)
        .and_then(|(_, value)| value.as_deref())
        .map_or_else(String::new, crate::publish::id_text)
}

/// A record received and not settled yet: dropped unsettled (a dropped future, a
/// failed dead-letter send), it rewinds its partition to itself, and its partition's
/// later records are skipped until it is back.
struct Held<'a> {
    consumer: &'a KafkaConsumer,
    message: KafkaMessage,
    /// The partition's assignment when the record was received.
    epoch: u64,
    /// The partition's rewinds when the record was received.
    rewinds: u64,
    settled: bool,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        let m = &self.message;
        if let Some(left) = lock(&self.consumer.stopping).as_mut() {
            left.push((m.topic.clone(), m.partition, m.offset, self.epoch));
            return;
        }
        let rewound =
            self.consumer.rewind(&m.topic, m.partition, m.offset, self.epoch, Instant::now());
        if let Err(error) = rewound {
            tracing::warn!(%error, "rewinding a dropped record's partition failed");
        }
    }
}

/// `mutex`'s value, poisoned or not (what it guards is whole between statements).
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A record let go while [`KafkaConsumer::run_until`] stopped: topic, partition,
/// offset and the partition's assignment then.
type LetGo = (String, i32, i64, u64);

/// Rewinds the records let go while [`KafkaConsumer::run_until`] stopped, and ends
/// the stop, when `run_until` ends or is dropped.
struct RewindLetGo<'a>(&'a KafkaConsumer);

impl Drop for RewindLetGo<'_> {
    fn drop(&mut self) {
        let left = lock(&self.0.stopping).take().unwrap_or_default();
        for (topic, partition, offset, epoch) in left {
            if let Err(error) = self.0.rewind(&topic, partition, offset, epoch, Instant::now()) {
                tracing::warn!(%error, "rewinding a record let go at shutdown failed");
            }
        }
    }
}

/// Commits what the settled records reached when [`KafkaConsumer::run`] ends or is
/// dropped.
struct FlushOnDrop<'a>(&'a KafkaConsumer);

impl Drop for FlushOnDrop<'_> {
    fn drop(&mut self) {
        if let Err(error) = self.0.flush() {
            tracing::warn!(%error, "committing settled offsets failed");
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
        let rewind = Rewind::new(7, Instant::now());
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

    /// The commit a sequence of receives, settles and rewinds leaves pending.
    fn committed(state: &Partitions) -> Option<i64> {
        state.tracks.get(&("t".to_owned(), 0)).and_then(|track| track.committed)
    }

    /// Records settled out of order: the commit is the lowest offset below which
    /// every record is settled, never past one still in hand.
    #[test]
    fn the_commit_stays_below_the_lowest_record_in_hand() {
        let mut state = Partitions::default();
        let rewinds: Vec<u64> = (0..5).map(|o| state.received(("t".to_owned(), 0), o)).collect();
        assert!(state.settled("t", 0, 3, 0, rewinds[3]));
        assert_eq!(committed(&state), Some(0), "offset 0 is in hand");
        state.settled("t", 0, 0, 0, rewinds[0]);
        assert_eq!(committed(&state), Some(1));
        state.settled("t", 0, 1, 0, rewinds[1]);
        state.settled("t", 0, 2, 0, rewinds[2]);
        assert_eq!(committed(&state), Some(4), "3 was settled before");
        state.settled("t", 0, 4, 0, rewinds[4]);
        assert_eq!(committed(&state), Some(5));
    }

    /// Offsets 10 and 12 are left for retry while 13 is acked: the partition reads
    /// again from 10, and the commit must not pass 12 when 10 comes back and is
    /// acked before 11 and 12 are read again, even though 13 was acked.
    #[test]
    fn a_rewind_holds_the_commit_until_the_partition_reads_past_it_again() {
        let mut state = Partitions::default();
        let now = Instant::now();
        let first: Vec<u64> = (10..14).map(|o| state.received(("t".to_owned(), 0), o)).collect();
        assert_eq!(state.rewind("t", 0, 12, 0, now), Rewound::Seek(12));
        assert_eq!(state.rewind("t", 0, 10, 0, now), Rewound::Seek(10), "the earlier wins");
        assert_eq!(state.rewind("t", 0, 12, 0, now), Rewound::Seek(10), "and stays");
        state.settled("t", 0, 13, 0, first[3]);
        state.settled("t", 0, 11, 0, first[1]);
        assert_eq!(committed(&state), None, "nothing below 10 was settled");
        // The partition comes back at 10 (the receive drops the rewind).
        state.rewound.remove(&("t".to_owned(), 0));
        let again = state.received(("t".to_owned(), 0), 10);
        state.settled("t", 0, 10, 0, again);
        assert_eq!(committed(&state), Some(11), "12 is not read again yet");
        for o in 11..14 {
            let again = state.received(("t".to_owned(), 0), o);
            state.settled("t", 0, o, 0, again);
        }
        assert_eq!(committed(&state), Some(14));
    }

    /// Offset 11 is left for retry with a long delay, then offset 10 (in flight beside
    /// it, another key) with a short one: the partition reads again from 10, and so
    /// reads 11 right after it. The pause must last until 11's delay is over too, or
    /// 11 is retried long before its backoff allows.
    #[test]
    fn an_earlier_rewind_keeps_the_later_records_delay() {
        let mut state = Partitions::default();
        let now = Instant::now();
        for offset in 10..12 {
            state.received(("t".to_owned(), 0), offset);
        }
        let long = now + Duration::from_secs(60);
        assert_eq!(state.rewind("t", 0, 11, 0, long), Rewound::Seek(11));
        assert_eq!(state.rewind("t", 0, 10, 0, now + Duration::from_secs(1)), Rewound::Seek(10));
        let rewind = state.rewound[&("t".to_owned(), 0)];
        assert_eq!(rewind.offset, 10);
        assert!(rewind.due >= long, "offset 11 comes back {:?} early", long - rewind.due);
    }

    /// A record received before its partition was reassigned neither commits nor
    /// rewinds.
    #[test]
    fn a_record_of_an_earlier_assignment_neither_commits_nor_rewinds() {
        let mut state = Partitions::default();
        let rewinds = state.received(("t".to_owned(), 0), 5);
        let mut moved = TopicPartitionList::new();
        moved.add_partition("t", 0);
        let context = KafkaContext::default();
        context.rebalanced(&moved);
        state.epochs = context.state().epochs.clone();
        assert!(!state.settled("t", 0, 5, 0, rewinds));
        assert_eq!(state.rewind("t", 0, 5, 0, Instant::now()), Rewound::Stale);
        assert_eq!(committed(&state), None);
    }

    /// A partition read by a model of `run`: records received in order (with records
    /// fetched before a seek still arriving after it, as librdkafka may hand them
    /// out), up to `concurrency` in hand, settled in any order, some left for retry
    /// a few times before they succeed; with every other offset holding no record
    /// (transaction markers), or none. Whatever the interleaving, the commit never
    /// passes a record that has not succeeded, and once every record succeeded the
    /// commit reaches the end.
    #[test]
    fn the_commit_never_passes_a_record_that_has_not_succeeded() {
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut random = move |below: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % below
        };
        for case in 0..4_000 {
            const N: i64 = 10;
            // Records at every offset, or at every other one.
            let step = 1 + (case % 2) as i64;
            let end = N * step;
            let concurrency = 1 + random(5) as usize;
            let mut failures: Vec<u64> = (0..N).map(|_| random(4).saturating_sub(1)).collect();
            let mut state = Partitions::default();
            let mut done = std::collections::BTreeSet::new();
            let mut queue = std::collections::VecDeque::<i64>::new();
            let mut position = 0_i64;
            let mut in_hand: Vec<(i64, u64)> = Vec::new();
            let mut log = Vec::new();
            let seek = |queue: &mut std::collections::VecDeque<i64>,
                        position: &mut i64,
                        target: i64,
                        stale: u64| {
                queue.truncate(stale as usize);
                *position = target;
            };
            for _ in 0..4_000 {
                // The fetch goes on from the first record at or after the position.
                position = (position + step - 1) / step * step;
                let can_receive =
                    in_hand.len() < concurrency && (!queue.is_empty() || position < end);
                if can_receive && (in_hand.is_empty() || random(2) == 0) {
                    if queue.is_empty() {
                        for _ in 0..1 + random(3) {
                            if position < end {
                                queue.push_back(position);
                                position += step;
                            }
                        }
                    }
                    let offset = queue.pop_front().unwrap();
                    let key = ("t".to_owned(), 0);
                    match state.rewound.get(&key).copied() {
                        Some(rewind) if offset > rewind.offset => {
                            log.push(format!("skip {offset}"));
                            let stale = random(4);
                            seek(&mut queue, &mut position, rewind.offset, stale);
                            continue;
                        }
                        Some(_) => {
                            state.rewound.remove(&key);
                        }
                        None => {}
                    }
                    let rewinds = state.received(key, offset);
                    log.push(format!("receive {offset}"));
                    in_hand.push((offset, rewinds));
                } else if !in_hand.is_empty() {
                    let (offset, rewinds) = in_hand.remove(random(in_hand.len() as u64) as usize);
                    let failing = &mut failures[(offset / step) as usize];
                    if !done.contains(&offset) && *failing > 0 {
                        *failing -= 1;
                        log.push(format!("retry {offset}"));
                        match state.rewind("t", 0, offset, 0, Instant::now()) {
                            Rewound::Seek(target) => {
                                let stale = random(4);
                                seek(&mut queue, &mut position, target, stale);
                            }
                            Rewound::Ahead => {}
                            Rewound::Stale => unreachable!(),
                        }
                    } else {
                        log.push(format!("ack {offset}"));
                        done.insert(offset);
                        assert!(state.settled("t", 0, offset, 0, rewinds));
                    }
                } else {
                    break;
                }
                if let Some(committed) = committed(&state) {
                    let missing: Vec<i64> =
                        (0..committed).filter(|o| o % step == 0 && !done.contains(o)).collect();
                    assert!(
                        missing.is_empty(),
                        "case {case}: committed {committed} passes {missing:?} unsucceeded: {log:?}"
                    );
                }
            }
            assert_eq!(done.len() as i64, N, "case {case}: not every record succeeded: {log:?}");
            let last = end - step + 1;
            assert_eq!(committed(&state), Some(last), "case {case}: the commit stopped: {log:?}");
        }
    }
}
