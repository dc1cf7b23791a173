//! Exactly-once consume-transform-produce: the records a handler produces and the
//! offsets it consumed commit in one Kafka transaction.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use futures_util::{FutureExt as _, StreamExt as _};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::{KafkaContext, KafkaMessage, Rewind, dead_letter_headers, skip_behind_rewind};
use crate::consume::{Answer, DEFAULT_CONCURRENCY, deadline_after};
use crate::metrics::ConsumerMeter;
use crate::{Disposition, DispositionExt, Error, Outcome};

/// A record for the transaction to produce.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputRecord {
    /// The topic to produce to.
    pub topic: String,
    /// The partition, or `None` for the producer's partitioner (by key).
    pub partition: Option<i32>,
    /// The key, if any.
    pub key: Option<Vec<u8>>,
    /// The value.
    pub payload: Vec<u8>,
    /// Headers, in order.
    pub headers: Vec<(String, Vec<u8>)>,
}

impl OutputRecord {
    /// A record for `topic`, with no key, an empty value and no headers.
    pub fn to(topic: impl Into<String>) -> OutputRecord {
        OutputRecord {
            topic: topic.into(),
            partition: None,
            key: None,
            payload: Vec::new(),
            headers: Vec::new(),
        }
    }

    /// Sets the key.
    pub fn key(mut self, key: impl Into<Vec<u8>>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Sets the value.
    pub fn payload(mut self, payload: impl Into<Vec<u8>>) -> Self {
        self.payload = payload.into();
        self
    }

    /// Sets the partition.
    pub fn partition(mut self, partition: i32) -> Self {
        self.partition = Some(partition);
        self
    }

    /// Adds a header.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }
}

/// What a handler of an [`ExactlyOnceConsumer`] returns on success: the records to
/// produce for one consumed record, and which record that was.
///
/// Cached by `#[idempotent(cache = true)]`, it is what a duplicate replays: the
/// consumer produces the replayed records again only if the transaction of the record
/// that first produced them did not commit (see [`ExactlyOnceConsumer`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Produced {
    /// The consumed record's topic, partition and offset.
    pub origin: (String, i32, i64),
    /// The records to produce, in order.
    pub records: Vec<OutputRecord>,
}

impl Produced {
    /// Nothing produced yet, for `message`.
    pub fn by(message: &KafkaMessage) -> Produced {
        Produced {
            origin: (message.topic.clone(), message.partition, message.offset),
            records: Vec::new(),
        }
    }

    /// Adds a record to produce.
    pub fn record(mut self, record: OutputRecord) -> Self {
        self.records.push(record);
        self
    }
}

/// A handler's result that an [`ExactlyOnceConsumer`] can settle: its disposition, and
/// the records to produce. Implemented for what an `#[idempotent]` handler returning
/// [`Produced`] answers.
pub trait Transformed: DispositionExt {
    /// The records the call produced, and whether it ran now.
    fn produced(&self) -> Output<'_>;
}

/// The records a call hands the transaction.
#[derive(Debug, Clone, Copy)]
pub enum Output<'a> {
    /// The handler ran now: produce these.
    New(&'a Produced),
    /// A duplicate that replays an earlier call's records.
    Replayed(&'a Produced),
    /// Nothing to produce: a failure, or a duplicate without a cached result.
    Nothing,
}

impl<E> Transformed for Result<Outcome<Produced>, Error<E>> {
    fn produced(&self) -> Output<'_> {
        match self {
            Ok(Outcome::Processed(p) | Outcome::ProcessedNotCached { value: p, .. }) => {
                Output::New(p)
            }
            Ok(Outcome::Replayed(p)) => Output::Replayed(p),
            _ => Output::Nothing,
        }
    }
}

/// A consumer-group member that processes each record exactly once as Kafka sees it:
/// the records its handler produces and the consumed offsets commit together in one
/// Kafka transaction, or neither does (KIP-98), and a member that lost its partitions
/// cannot commit them (KIP-447: the transaction carries the group's generation).
/// Readers downstream must read with `isolation.level=read_committed` (librdkafka's
/// default).
///
/// The consumer is created as for [`KafkaConsumer`](super::KafkaConsumer)
/// (`enable.auto.commit=false`, a [`KafkaContext`]); the producer's settings with a
/// `transactional.id` of its own (one per process: the group's generation fences a
/// zombie, not the id). [`new`](ExactlyOnceConsumer::new) makes the producer and
/// initializes its transactions, fencing an earlier producer with the same id.
///
/// [`run`](ExactlyOnceConsumer::run) reads a batch (up to
/// [`max_batch`](ExactlyOnceConsumer::max_batch) records, or what arrives within
/// [`commit_interval`](ExactlyOnceConsumer::commit_interval) of the first) and hands
/// each record to the handler: the records of one partition one after the other in
/// offset order, up to [`concurrency`](ExactlyOnceConsumer::concurrency) partitions at
/// once. Each record is settled by its result:
///
/// * Ack → the handler's [`Produced`] records are to be produced, and the partition's
///   offset moves past the record;
/// * DeadLetter → the record is to be produced to the dead-letter topic (with
///   `idempotent-source-topic`, `-partition`, `-offset` headers), and the offset moves
///   past it;
/// * Retry → the partition stops at the record for this batch: nothing of it or of
///   its later records is produced, its offset stays before it, and after the
///   transaction the partition is sought back to it and paused for the retry delay;
/// * a panic → nothing of the batch is produced, every partition of the batch reads
///   again from its committed offset, and the panic is resumed.
///
/// Then one transaction begins, takes what the batch produces and the offsets (sent
/// with the consumer's group metadata), and commits. The handlers run before it
/// begins, so their time does not count against the transaction's timeout
/// (`transaction.timeout.ms`, 60 s by default); the batch's time does count against
/// the consumer's `max.poll.interval.ms` (5 min). A transaction that cannot commit
/// (the group rebalanced, a broker failed) is aborted and every partition of the
/// batch reads again from the group's committed offset: its records are handled
/// again, and nothing of the aborted attempt is ever visible to a `read_committed`
/// reader. A producer that met a fatal error (its transaction timed out on the
/// broker, another producer took its `transactional.id`) is made anew from its
/// settings, and the batch read again.
///
/// A duplicate whose `#[idempotent(cache = true)]` result is replayed
/// ([`Output::Replayed`]) produces its records again only if the record that first
/// produced them was never committed (its transaction aborted, as after a crash): if
/// its partition's committed offset is past it, the duplicate produces nothing; if it
/// is this very record, handled again after an abort, the records are produced again;
/// if it is another record not committed yet, the duplicate is retried until that
/// one's transaction is decided. So each record is produced once even when the
/// producer upstream sent the same business message twice. A duplicate without a
/// cached result produces nothing (use `cache = true`).
///
/// ```no_run
/// # async fn demo() -> Result<(), rdkafka::error::KafkaError> {
/// use idempotent_runtime::consume::kafka::{ExactlyOnceConsumer, KafkaContext, KafkaMessage};
/// use idempotent_runtime::consume::kafka::{OutputRecord, Produced};
/// use idempotent_runtime::{Error, Outcome};
/// use rdkafka::ClientConfig;
/// use rdkafka::consumer::{Consumer, StreamConsumer};
///
/// // An #[idempotent(cache = true)] function returning `Result<Produced, E>`.
/// async fn invoice(msg: KafkaMessage) -> Result<Outcome<Produced>, Error<std::io::Error>> {
///     let invoice = OutputRecord::to("invoices").payload(msg.payload.clone());
///     Ok(Outcome::Processed(Produced::by(&msg).record(invoice)))
/// }
///
/// let consumer: StreamConsumer<KafkaContext> = ClientConfig::new()
///     .set("bootstrap.servers", "127.0.0.1:9092")
///     .set("group.id", "invoicing")
///     .set("enable.auto.commit", "false")
///     .create_with_context(KafkaContext::default())?;
/// consumer.subscribe(&["orders"])?;
/// let mut producer = ClientConfig::new();
/// producer
///     .set("bootstrap.servers", "127.0.0.1:9092")
///     .set("transactional.id", format!("invoicing-{}", std::process::id()));
/// let consumer = ExactlyOnceConsumer::new(consumer, &producer, "orders.dead")?;
/// consumer.run(invoice).await
/// # }
/// ```
pub struct ExactlyOnceConsumer {
    consumer: StreamConsumer<KafkaContext>,
    /// The transactional producer, made anew from `producer_config` after a fatal
    /// error.
    producer: Mutex<FutureProducer>,
    producer_config: ClientConfig,
    dead_letter_topic: String,
    retry_delay: Duration,
    concurrency: usize,
    commit_interval: Duration,
    max_batch: usize,
    timeout: Duration,
    state: Mutex<State>,
    /// Held by each blocking call of the transactional producer: a call left running
    /// by a dropped `run` is over before the next `run` touches the transaction.
    calls: std::sync::Arc<Mutex<()>>,
}

/// What the consumer knows of its partitions and its transaction.
#[derive(Default)]
struct State {
    /// Per partition, for the assignment it was learnt in: the first offset received,
    /// and the offset this member last committed.
    partitions: HashMap<(String, i32), Seen>,
    /// The partitions of a batch whose `run` was dropped before its transaction was
    /// decided (the commit may even have gone through): before the next batch, the
    /// transaction is aborted if still open, and they read on from the group's
    /// committed offsets, whichever way it went.
    undecided: Vec<(String, i32, u64)>,
}

#[derive(Clone, Copy)]
struct Seen {
    epoch: u64,
    first: i64,
    committed: Option<i64>,
}

/// A record of the batch, with its partition's assignment when it was received.
struct Taken {
    message: KafkaMessage,
    epoch: u64,
}

/// How a partition's records in a batch were settled.
#[derive(Default)]
struct Settled {
    /// Past the last record settled (acked or dead-lettered), if any.
    next: Option<i64>,
    /// The record left for retry, its partition's assignment, and when it is due.
    retry: Option<(i64, u64, Instant)>,
    /// What the partition's records produce, once the transaction begins.
    produce: Vec<Produce>,
    /// The handler panicked: its payload.
    panic: Option<Box<dyn std::any::Any + Send>>,
}

/// A record for the transaction to produce.
enum Produce {
    Output(OutputRecord),
    DeadLetter(KafkaMessage),
}

impl ExactlyOnceConsumer {
    /// Wraps a subscribed consumer created with a [`KafkaContext`], and makes a
    /// transactional producer from `producer` (its settings must include a
    /// `transactional.id`); dead letters go to `dead_letter_topic`. Initializes the
    /// producer's transactions (blocking, up to 30 s), which fences any earlier
    /// producer with the same id and aborts its open transaction. The consumer makes
    /// the producer anew from the same settings after a fatal error (see
    /// [`run`](ExactlyOnceConsumer::run)).
    pub fn new(
        consumer: StreamConsumer<KafkaContext>,
        producer: &ClientConfig,
        dead_letter_topic: impl Into<String>,
    ) -> Result<ExactlyOnceConsumer, KafkaError> {
        if consumer.group_metadata().is_none() {
            return Err(KafkaError::ClientCreation(
                "exactly-once commits offsets for a consumer group: set the consumer's group.id"
                    .into(),
            ));
        }
        super::refuse_auto_commit(&consumer)?;
        if producer.get("transactional.id").is_none_or(str::is_empty) {
            return Err(KafkaError::ClientCreation(
                "exactly-once produces in transactions: set the producer's transactional.id \
                 (one per process, e.g. the service's name and the process's id)"
                    .into(),
            ));
        }
        let timeout = Duration::from_secs(30);
        let made: FutureProducer = producer.create()?;
        made.init_transactions(timeout)?;
        Ok(ExactlyOnceConsumer {
            consumer,
            producer: Mutex::new(made),
            producer_config: producer.clone(),
            dead_letter_topic: dead_letter_topic.into(),
            retry_delay: Duration::from_millis(500),
            concurrency: DEFAULT_CONCURRENCY,
            commit_interval: Duration::from_millis(100),
            max_batch: 500,
            timeout,
            state: Mutex::new(State::default()),
            calls: std::sync::Arc::default(),
        })
    }

    /// How many partitions a batch handles at once (one record of each at a time);
    /// default [`DEFAULT_CONCURRENCY`] (32).
    pub fn concurrency(mut self, partitions: usize) -> Self {
        self.concurrency = partitions.max(1);
        self
    }

    /// How long a batch gathers records after its first before its transaction
    /// begins; default 100 ms. Longer batches mean fewer transactions (each costs a
    /// few round trips to the broker) and later visibility downstream.
    pub fn commit_interval(mut self, interval: Duration) -> Self {
        self.commit_interval = interval;
        self
    }

    /// The most records one transaction handles; default 500.
    pub fn max_batch(mut self, records: usize) -> Self {
        self.max_batch = records.max(1);
        self
    }

    /// How long a partition with a record left for retry pauses when the result does
    /// not say; default 500 ms.
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// The wrapped consumer.
    pub fn consumer(&self) -> &StreamConsumer<KafkaContext> {
        &self.consumer
    }

    /// Handles batches, each in one transaction, until receiving fails, or a
    /// transaction can neither commit nor abort (the broker gone for longer than the
    /// 30 s timeout). A producer that meets a fatal error (its transaction timed out
    /// on the broker, or another producer took its `transactional.id`) is made anew
    /// and the batch read again. Dropped mid-batch, the batch is left undecided: the
    /// next `run` first aborts its transaction if one is still open, and reads the
    /// batch's partitions on from the group's committed offsets.
    pub async fn run<F, Fut, R>(&self, handler: F) -> Result<(), KafkaError>
    where
        F: FnMut(KafkaMessage) -> Fut,
        Fut: Future<Output = R>,
        R: Transformed,
    {
        let meter = ConsumerMeter::new("kafka", &super::subscribed(&self.consumer));
        let handler = Mutex::new(handler);
        self.recover().await?;
        loop {
            let batch = self.gather().await?;
            if batch.is_empty() {
                continue;
            }
            meter.taken(batch.values().map(Vec::len).sum());
            self.transact(batch, &handler, &meter).await?;
        }
    }

    /// After a `run` dropped mid-batch: aborts its transaction if it is still open,
    /// and seeks the batch's partitions (those still assigned) to the group's
    /// committed offsets.
    async fn recover(&self) -> Result<(), KafkaError> {
        let undecided = self.state().undecided.clone();
        if undecided.is_empty() {
            return Ok(());
        }
        if self.producer_is_dead() {
            self.renew_producer().await?;
        }
        match self.blocking(|p, t| p.abort_transaction(t)).await {
            // No transaction was open: it had committed, or aborted, or never begun.
            Err(KafkaError::Transaction(e)) if e.code() == RDKafkaErrorCode::State => {}
            Err(_) if self.producer_is_dead() => self.renew_producer().await?,
            other => other?,
        }
        let mut list = TopicPartitionList::new();
        for (topic, partition, _) in &undecided {
            list.add_partition(topic, *partition);
        }
        let committed = super::blocking(|| self.consumer.committed_offsets(list, self.timeout))?;
        for (topic, partition, epoch) in undecided.iter().cloned() {
            let offset = committed.find_partition(&topic, partition).map(|e| e.offset());
            let offset = match offset {
                Some(Offset::Offset(offset)) => offset,
                // Nothing committed yet: where the group starts a new member.
                _ => match super::blocking(|| {
                    self.consumer.fetch_watermarks(&topic, partition, self.timeout)
                }) {
                    Ok((low, _)) => low,
                    Err(error) => return Err(error),
                },
            };
            self.rewind(&topic, partition, offset, epoch, Instant::now(), false);
        }
        self.state().undecided.retain(|entry| !undecided.contains(entry));
        Ok(())
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn producer(&self) -> FutureProducer {
        self.producer.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Whether the producer met a fatal error, after which it can do nothing more.
    fn producer_is_dead(&self) -> bool {
        self.producer().client().fatal_error().is_some()
    }

    /// Makes the producer anew and initializes its transactions, which aborts what the
    /// dead one left open.
    async fn renew_producer(&self) -> Result<(), KafkaError> {
        if let Some((code, reason)) = self.producer().client().fatal_error() {
            tracing::error!(?code, %reason, "the transactional producer died: making it anew");
        }
        let made: FutureProducer = self.producer_config.create()?;
        let (calls, timeout, fresh) = (self.calls.clone(), self.timeout, made.clone());
        let init = move || {
            let _one_at_a_time = calls.lock().unwrap_or_else(PoisonError::into_inner);
            fresh.init_transactions(timeout)
        };
        match tokio::task::spawn_blocking(init).await {
            Ok(result) => result?,
            Err(joined) => std::panic::resume_unwind(joined.into_panic()),
        }
        *self.producer.lock().unwrap_or_else(PoisonError::into_inner) = made;
        Ok(())
    }

    /// Runs a blocking call of the transactional producer off the async threads.
    async fn blocking<T: Send + 'static>(
        &self,
        call: impl FnOnce(&FutureProducer, Duration) -> Result<T, KafkaError> + Send + 'static,
    ) -> Result<T, KafkaError> {
        let (producer, timeout, calls) = (self.producer(), self.timeout, self.calls.clone());
        let call = move || {
            let _one_at_a_time = calls.lock().unwrap_or_else(PoisonError::into_inner);
            call(&producer, timeout)
        };
        match tokio::task::spawn_blocking(call).await {
            Ok(result) => result,
            Err(joined) => std::panic::resume_unwind(joined.into_panic()),
        }
    }

    /// The records of one batch, by partition in offset order: from the first record
    /// received, what arrives within the commit interval, up to `max_batch`. Records
    /// of a partition reassigned meanwhile are left out.
    async fn gather(&self) -> Result<BTreeMap<(String, i32), Vec<Taken>>, KafkaError> {
        // The partitions have read past these: dropped here, they are left to the
        // next `run`, like a batch whose transaction is undecided.
        let mut taken = Gathering { consumer: self, records: Vec::new() };
        let first = loop {
            if let Some(record) = self.receive().await? {
                break record;
            }
        };
        taken.records.push(first);
        let deadline = Instant::now() + self.commit_interval;
        while taken.records.len() < self.max_batch {
            match tokio::time::timeout_at(deadline, self.receive()).await {
                Ok(Ok(Some(record))) => taken.records.push(record),
                Ok(Ok(None)) => {}
                Ok(Err(error)) => return Err(error),
                Err(_) => break,
            }
        }
        let taken = std::mem::take(&mut taken.records);
        let epochs = self.consumer.context().state().epochs.clone();
        let mut batch: BTreeMap<(String, i32), Vec<Taken>> = BTreeMap::new();
        for record in taken {
            let key = (record.message.topic.clone(), record.message.partition);
            if epochs.get(&key).copied().unwrap_or(0) != record.epoch {
                continue;
            }
            let records = batch.entry(key).or_default();
            // A partition sought back mid-gather hands out its records again.
            records.retain(|r| r.message.offset < record.message.offset);
            records.push(record);
        }
        Ok(batch)
    }

    /// The next record, resuming the partitions whose retry delay is over first;
    /// `None` for a record fetched behind a rewind (skipped).
    async fn receive(&self) -> Result<Option<Taken>, KafkaError> {
        let record = loop {
            let wake = super::resume_due(&self.consumer)?;
            let due = async {
                match wake {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                record = self.consumer.recv() => break record?,
                () = due => continue,
            }
        };
        let message = KafkaMessage::of(&record);
        drop(record);
        let key = (message.topic.clone(), message.partition);
        let epoch = {
            let mut context = self.consumer.context().state();
            let epoch = context.epochs.get(&key).copied().unwrap_or(0);
            match context.rewound.get(&key).copied() {
                Some(rewind) if message.offset > rewind.offset => {
                    drop(context);
                    skip_behind_rewind(&self.consumer, &message.topic, message.partition)?;
                    return Ok(None);
                }
                Some(_) => {
                    context.rewound.remove(&key);
                }
                None => {}
            }
            epoch
        };
        let mut state = self.state();
        let seen = state.partitions.entry(key).or_insert(Seen {
            epoch,
            first: message.offset,
            committed: None,
        });
        if seen.epoch != epoch {
            *seen = Seen { epoch, first: message.offset, committed: None };
        }
        Ok(Some(Taken { message, epoch }))
    }

    fn seek(&self, topic: &str, partition: i32, offset: i64) -> Result<(), KafkaError> {
        // A zero timeout makes the seek asynchronous: no blocking in a task.
        self.consumer.seek(topic, partition, Offset::Offset(offset), Duration::ZERO)
    }

    /// Makes `offset` the partition's next record, from `due` on, unless its
    /// assignment changed since `epoch`; paused until then when `pause`.
    fn rewind(
        &self,
        topic: &str,
        partition: i32,
        offset: i64,
        epoch: u64,
        due: Instant,
        pause: bool,
    ) {
        let key = (topic.to_owned(), partition);
        {
            let mut context = self.consumer.context().state();
            if context.epochs.get(&key).copied().unwrap_or(0) != epoch {
                return;
            }
            let rewind = context.rewound.entry(key).or_insert(Rewind::new(offset, due));
            rewind.offset = rewind.offset.min(offset);
            rewind.due = rewind.due.max(due);
        }
        let mut list = TopicPartitionList::new();
        list.add_partition(topic, partition);
        let done = self
            .seek(topic, partition, offset)
            .and_then(|()| if pause { self.consumer.pause(&list) } else { Ok(()) });
        if let Err(error) = done {
            tracing::warn!(%error, topic, partition, offset, "rewinding a partition failed");
        }
    }

    /// Handles a batch, then produces what it settled to and its offsets in one
    /// transaction and commits it; or leaves the batch to be read again.
    ///
    /// The handlers run before the transaction begins: a handler's time does not
    /// count against the transaction's timeout, and a panic leaves nothing to abort.
    async fn transact<F, Fut, R>(
        &self,
        batch: BTreeMap<(String, i32), Vec<Taken>>,
        handler: &Mutex<F>,
        meter: &ConsumerMeter,
    ) -> Result<(), KafkaError>
    where
        F: FnMut(KafkaMessage) -> Fut,
        Fut: Future<Output = R>,
        R: Transformed,
    {
        // Until the batch is committed or rewound, a drop leaves it to the next `run`.
        let mut pending = Pending { consumer: self, batch: &batch, decided: false };
        // Made up front, not in a stream adapter's closure: a future borrowing through
        // such a closure is not `Send` (its lifetimes can't be named).
        let partitions: Vec<_> = (batch.iter())
            .map(|(key, records)| async move {
                (key.clone(), self.settle_partition(records, handler, meter).await)
            })
            .collect();
        let settled: Vec<((String, i32), Settled)> = futures_util::stream::iter(partitions)
            .buffer_unordered(self.concurrency)
            .collect()
            .await;

        let mut panic = None;
        let mut offsets = TopicPartitionList::new();
        let mut produce = Vec::new();
        let mut retries = Vec::new();
        for ((topic, partition), mut outcome) in settled {
            panic = panic.or(outcome.panic.take());
            produce.append(&mut outcome.produce);
            if let Some(next) = outcome.next {
                offsets.add_partition_offset(&topic, partition, Offset::Offset(next))?;
            }
            if let Some(retry) = outcome.retry {
                retries.push((topic, partition, retry));
            }
        }
        let committed = match panic {
            Some(_) => Err(KafkaError::Canceled),
            None => self.produce_and_commit(produce, offsets.clone()).await,
        };
        if committed.is_ok() {
            pending.decided = true;
            self.committed(&offsets);
            for (topic, partition, (offset, epoch, due)) in retries {
                self.rewind(&topic, partition, offset, epoch, due, true);
            }
            return Ok(());
        }
        // Aborted, never begun, or committed without an answer: either way the
        // group's committed offsets say where each partition reads on.
        self.state().undecided.extend(undecided(&batch));
        pending.decided = true;
        let recovered = self.recover().await;
        if let Some(panic) = panic {
            std::panic::resume_unwind(panic);
        }
        let error = committed.err().unwrap_or(KafkaError::Canceled);
        if let Err(failed) = recovered {
            // The broker gone for longer than the timeout: the next `run` tries again.
            tracing::error!(%failed, %error, "a transaction could not be aborted");
            return Err(failed);
        }
        tracing::warn!(%error, "transaction aborted; its records are read again");
        Ok(())
    }

    /// Begins a transaction, produces `records` in it, sends `offsets` with the
    /// group's metadata, and commits.
    async fn produce_and_commit(
        &self,
        records: Vec<Produce>,
        offsets: TopicPartitionList,
    ) -> Result<(), KafkaError> {
        let producer = self.producer();
        producer.begin_transaction()?;
        let mut deliveries = Vec::with_capacity(records.len());
        for record in &records {
            deliveries.push(match record {
                Produce::Output(output) => self.send(&producer, output).await?,
                Produce::DeadLetter(message) => self.send_dead_letter(&producer, message).await?,
            });
        }
        self.commit(offsets, deliveries).await
    }

    /// Hands a partition's records of the batch to the handler one after the other,
    /// producing what each settles to, until one is left for retry.
    async fn settle_partition<F, Fut, R>(
        &self,
        records: &[Taken],
        handler: &Mutex<F>,
        meter: &ConsumerMeter,
    ) -> Settled
    where
        F: FnMut(KafkaMessage) -> Fut,
        Fut: Future<Output = R>,
        R: Transformed,
    {
        let mut out = Settled::default();
        for taken in records {
            let message = &taken.message;
            let call = {
                let mut handler = handler.lock().unwrap_or_else(PoisonError::into_inner);
                (*handler)(message.clone())
            };
            let result = match AssertUnwindSafe(call).catch_unwind().await {
                Ok(result) => result,
                Err(panic) => {
                    out.panic = Some(panic);
                    return out;
                }
            };
            let answer = Answer::of(&result);
            let mut disposition = answer.disposition;
            let mut delay = answer.delay_or(self.retry_delay);
            let mut produce: &[OutputRecord] = &[];
            if disposition == Disposition::Ack {
                match result.produced() {
                    Output::New(produced) => produce = &produced.records,
                    Output::Replayed(produced) => match self.replay(produced, taken).await {
                        Replay::Produce => produce = &produced.records,
                        Replay::Skip => {}
                        Replay::Wait => {
                            disposition = Disposition::Retry;
                            delay = self.retry_delay;
                        }
                    },
                    Output::Nothing => {}
                }
            }
            meter.settled(disposition);
            match disposition {
                Disposition::Ack => {
                    out.produce.extend(produce.iter().cloned().map(Produce::Output));
                }
                Disposition::DeadLetter => out.produce.push(Produce::DeadLetter(message.clone())),
                Disposition::Retry => {
                    out.retry = Some((message.offset, taken.epoch, deadline_after(delay)));
                    return out;
                }
            }
            out.next = Some(message.offset + 1);
        }
        out
    }

    /// Whether a replayed result's records are produced again: only if the record
    /// that first produced them never committed.
    async fn replay(&self, produced: &Produced, taken: &Taken) -> Replay {
        let (topic, partition, offset) = &produced.origin;
        let message = &taken.message;
        if (topic, *partition, *offset) == (&message.topic, message.partition, message.offset) {
            // This record, handled again after its transaction was aborted.
            return Replay::Produce;
        }
        let key = (topic.clone(), *partition);
        let epoch = self.consumer.context().state().epochs.get(&key).copied().unwrap_or(0);
        if let Some(seen) = self.state().partitions.get(&key).copied().filter(|s| s.epoch == epoch)
        {
            // A partition of this member's: below its first record of this assignment
            // (at or past the group's committed offset then) or its own last commit,
            // the origin is committed; between those and this record of the same
            // partition, it is in this very transaction.
            if *offset < seen.first || seen.committed.is_some_and(|c| *offset < c) {
                return Replay::Skip;
            }
            if key == (message.topic.clone(), message.partition) && *offset < message.offset {
                return Replay::Skip;
            }
        }
        // Another member's partition: ask the group.
        let mut list = TopicPartitionList::new();
        list.add_partition(topic, *partition);
        let asked = super::blocking(|| self.consumer.committed_offsets(list, self.timeout));
        let committed = asked.ok().and_then(|list| {
            list.find_partition(topic, *partition).and_then(|e| match e.offset() {
                Offset::Offset(o) => Some(o),
                _ => None,
            })
        });
        match committed {
            Some(committed) if *offset < committed => Replay::Skip,
            _ => Replay::Wait,
        }
    }

    /// Produces `record` in the open transaction, waiting while the producer's queue
    /// is full.
    async fn send(
        &self,
        producer: &FutureProducer,
        record: &OutputRecord,
    ) -> Result<DeliveryFuture, KafkaError> {
        let mut headers = OwnedHeaders::new();
        for (name, value) in &record.headers {
            headers = headers.insert(Header { key: name, value: Some(value) });
        }
        let mut future = FutureRecord::to(&record.topic).payload(&record.payload).headers(headers);
        if let Some(key) = &record.key {
            future = future.key(key);
        }
        if let Some(partition) = record.partition {
            future = future.partition(partition);
        }
        self.enqueue(producer, future).await
    }

    /// Produces `message` to the dead-letter topic in the open transaction.
    async fn send_dead_letter(
        &self,
        producer: &FutureProducer,
        message: &KafkaMessage,
    ) -> Result<DeliveryFuture, KafkaError> {
        let mut record = FutureRecord::to(&self.dead_letter_topic)
            .payload(&message.payload)
            .headers(dead_letter_headers(message, true));
        if let Some(key) = &message.key {
            record = record.key(key);
        }
        self.enqueue(producer, record).await
    }

    /// Hands `record` to the producer; while its queue is full, waits for room (up to
    /// the timeout).
    async fn enqueue(
        &self,
        producer: &FutureProducer,
        mut record: FutureRecord<'_, Vec<u8>, Vec<u8>>,
    ) -> Result<DeliveryFuture, KafkaError> {
        let deadline = Instant::now() + self.timeout;
        loop {
            match producer.send_result(record) {
                Ok(delivery) => return Ok(delivery),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), again))
                    if Instant::now() < deadline =>
                {
                    record = again;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err((error, _)) => return Err(error),
            }
        }
    }

    /// Waits for the batch's records to be produced, sends the offsets with the
    /// group's metadata, and commits; retries a retriable commit.
    async fn commit(
        &self,
        offsets: TopicPartitionList,
        deliveries: Vec<DeliveryFuture>,
    ) -> Result<(), KafkaError> {
        for delivery in deliveries {
            match delivery.await {
                Ok(Ok(_)) => {}
                Ok(Err((error, _))) => return Err(error),
                Err(_) => return Err(KafkaError::Canceled),
            }
        }
        if offsets.count() > 0 {
            let metadata = (self.consumer.group_metadata())
                .ok_or(KafkaError::ConsumerCommit(RDKafkaErrorCode::InvalidGroupId))?;
            self.blocking(move |p, t| p.send_offsets_to_transaction(&offsets, &metadata, t))
                .await?;
        }
        let mut tries = 0;
        loop {
            match self.blocking(|p, t| p.commit_transaction(t)).await {
                Err(KafkaError::Transaction(e)) if e.is_retriable() && tries < 3 => tries += 1,
                other => return other,
            }
        }
    }

    /// The transaction committed: remember how far this member committed.
    fn committed(&self, offsets: &TopicPartitionList) {
        let mut state = self.state();
        for element in offsets.elements() {
            let key = (element.topic().to_owned(), element.partition());
            if let (Some(seen), Offset::Offset(next)) =
                (state.partitions.get_mut(&key), element.offset())
            {
                seen.committed = Some(next);
            }
        }
    }
}

/// Whether a replayed result is produced again.
enum Replay {
    Produce,
    Skip,
    /// The record that first produced it is in a transaction not decided yet.
    Wait,
}

/// A batch whose transaction is not decided yet: dropped so (its `run` was dropped),
/// it leaves the batch's partitions to the next `run` (see
/// [`ExactlyOnceConsumer::recover`]).
struct Pending<'a> {
    consumer: &'a ExactlyOnceConsumer,
    batch: &'a BTreeMap<(String, i32), Vec<Taken>>,
    decided: bool,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if !self.decided {
            self.consumer.state().undecided.extend(undecided(self.batch));
        }
    }
}

/// A batch's partitions, with their assignment when the batch was read.
fn undecided(
    batch: &BTreeMap<(String, i32), Vec<Taken>>,
) -> impl Iterator<Item = (String, i32, u64)> + '_ {
    (batch.iter()).filter_map(|((topic, partition), records)| {
        Some((topic.clone(), *partition, records.first()?.epoch))
    })
}

/// Records received for a batch not yet handed to its transaction: dropped (its `run`
/// was), they are left to the next `run`, which reads their partitions on from the
/// group's committed offsets.
struct Gathering<'a> {
    consumer: &'a ExactlyOnceConsumer,
    records: Vec<Taken>,
}

impl Drop for Gathering<'_> {
    fn drop(&mut self) {
        let mut state = self.consumer.state();
        for record in &self.records {
            let entry = (record.message.topic.clone(), record.message.partition, record.epoch);
            if !state.undecided.contains(&entry) {
                state.undecided.push(entry);
            }
        }
    }
}
