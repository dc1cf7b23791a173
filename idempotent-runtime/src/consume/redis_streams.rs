//! Redis Streams consumer groups.

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::{RedisResult, Value};
use tokio::time::Instant;

use super::{Answer, deadline_after};
use crate::delivery::with_delivery_count;
use crate::metrics::ConsumerMeter;
use crate::{Disposition, DispositionExt, Payload, PayloadRef};

/// The entry field a [`StreamMessage`]'s payload is read from, unless configured.
pub const DEFAULT_PAYLOAD_FIELD: &str = "payload";

/// One stream entry delivered to this consumer.
#[derive(Debug, Clone)]
pub struct StreamMessage {
    /// The entry's id.
    pub id: String,
    /// The entry's fields, names read as UTF-8 (lossily: Redis field names are
    /// binary). A name given twice keeps its last value here; the dead-letter copy
    /// keeps every field exactly as it was.
    pub fields: HashMap<String, Vec<u8>>,
    /// How many times the group has delivered the entry, this time included: 1 for
    /// a new entry; for one reclaimed from another consumer, the pending list's count
    /// (`None` if reading it failed). The attempt of a handler on
    /// [`NoStore`](crate::NoStore).
    pub delivery_count: Option<usize>,
    /// Its last `message-id` field, as
    /// [`publish`](crate::publish::redis_streams::publish) sets it: for
    /// `key = "{message_id}"`. Empty when it has none (or it is not UTF-8), so a key
    /// using it is a key error.
    pub message_id: String,
    payload_field: String,
    /// The fields exactly as Redis holds them, in order.
    raw: Vec<(Vec<u8>, Vec<u8>)>,
}

impl StreamMessage {
    /// The payload field's bytes (empty when the entry has none).
    pub fn body(&self) -> &[u8] {
        let field = self.payload_field.as_bytes();
        self.raw.iter().rev().find(|(name, _)| name == field).map_or(&[], |(_, v)| v.as_slice())
    }
}

/// The payload field is the payload, for `{/json/pointer}` keys and `validate`.
impl Payload for StreamMessage {
    fn payload(&self) -> PayloadRef<'_> {
        PayloadRef::Bytes(self.body())
    }
}

/// What one [`StreamConsumer::poll`] did, by entry id.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Polled {
    /// Acknowledged (`XACK`): processed, or a duplicate of a processed entry.
    pub acked: Vec<String>,
    /// Left pending, to be reclaimed and retried once their retry delay is over.
    pub retried: Vec<String>,
    /// Copied to the dead-letter stream, then acknowledged.
    pub dead_lettered: Vec<String>,
    /// To be dead-lettered, but another consumer had taken the entry over meanwhile:
    /// left to that consumer, not copied.
    pub taken_over: Vec<String>,
}

/// A consumer in a Redis Streams consumer group.
///
/// Each [`poll`](StreamConsumer::poll) first reclaims entries that have been pending
/// longer than the reclaim idle time (`XAUTOCLAIM`: entries of consumers that died,
/// and entries left for retry whose delay is over), then reads new ones
/// (`XREADGROUP`), and settles each by its handler's disposition: `XACK` on Ack; on
/// Retry, nothing but its idle time (it stays pending, and is reclaimed, by this
/// consumer or another, once the result's
/// [`retry_delay`](DispositionExt::retry_delay) is over: the handler's `backoff`, or
/// the other claim's lease for `InProgress`; the reclaim idle time for results that
/// don't say); on DeadLetter, `XADD` to the dead-letter stream (the entry's
/// fields plus `idempotent-source-id`) and `XACK`, in one script that copies nothing
/// unless the entry is still this consumer's: no ack without the copy, no copy of an
/// entry another consumer took over. Standalone Redis (the two streams are different
/// keys).
///
/// The consumer opens connections of its own from the [`redis::Client`] it is given:
/// one for its blocking reads, whose reply timeout is the block time plus five
/// seconds, and one for everything else. A blocking read on a shared connection would
/// hold up every other command on it (a store's claims and lease renewals among them)
/// for up to the block time, and a reply timeout shorter than the block time would
/// drop the entries a read delivered into the pending list unseen.
///
/// Up to [`concurrency`](StreamConsumer::concurrency) entries of a batch (default 32)
/// are handled at once. A consumer killed mid-batch leaves that many calls cut short,
/// and any of them between a non-transactional effect and its DONE record runs the
/// effect again when the entry is redelivered: the window every at-least-once
/// consumer has, once per call in flight (`transactional` handlers close it).
///
/// While a batch is being handled, the entries not yet settled are touched (their
/// idle time reset, if they are still this consumer's) every third of the reclaim
/// idle time, so other consumers reclaim only the entries of a consumer that stopped,
/// however long the batch takes.
///
/// A retry's delay is kept in the pending list itself, as the entry's idle time:
/// `XCLAIM ... IDLE` sets it to the reclaim idle time less the delay, so `XAUTOCLAIM`
/// takes the entry once the delay is over, and not before. A delay longer than the
/// reclaim idle time can't be written so (Redis caps an idle time at the present):
/// the consumer keeps such entries touched, at each poll and while batches run,
/// until what is left of the delay fits. If the consumer stops meanwhile, the entry is
/// reclaimed after the reclaim idle time: earlier than its delay, never lost. An
/// entry due is taken at the next poll that reclaims, so a quiet consumer (whose
/// polls wait the [`block`](StreamConsumer::block) time) retries up to that much
/// late.
///
/// ```no_run
/// # async fn demo() -> redis::RedisResult<()> {
/// use idempotent_runtime::consume::redis_streams::{StreamConsumer, StreamMessage};
/// use idempotent_runtime::{Error, Outcome};
///
/// async fn handle(msg: StreamMessage) -> Result<Outcome<()>, Error<std::io::Error>> {
///     // an #[idempotent] function
///     # let _ = msg; Ok(Outcome::Processed(()))
/// }
///
/// let client = redis::Client::open("redis://127.0.0.1:6379")?;
/// let consumer = StreamConsumer::new(&client, "orders", "billing", "billing-1").await?;
/// loop {
///     consumer.poll(handle).await?;
/// }
/// # }
/// ```
#[derive(Clone)]
pub struct StreamConsumer {
    client: redis::Client,
    commands: ConnectionManager,
    /// Opened on the first read, with a reply timeout that fits the block time.
    reader: std::sync::Arc<tokio::sync::OnceCell<ConnectionManager>>,
    stream: String,
    group: String,
    consumer: String,
    dead_letter: String,
    payload_field: String,
    batch: usize,
    concurrency: usize,
    block: Duration,
    reclaim_idle: Duration,
    grace: Duration,
    /// Where the next `XAUTOCLAIM` scan resumes, so entries deep in the pending list
    /// are reached too.
    cursor: std::sync::Arc<std::sync::Mutex<String>>,
    /// Entries left for retry whose delay is longer than the reclaim idle time.
    deferred: std::sync::Arc<std::sync::Mutex<Deferred>>,
}

/// Entries left for retry that must not be reclaimed yet, and can't be kept from it
/// by their idle time alone (see [`StreamConsumer`]).
#[derive(Default)]
struct Deferred {
    /// Each entry's id and when its delay is over.
    entries: Vec<(String, Instant)>,
    /// When they were last touched.
    touched: Option<Instant>,
}

/// Settles an entry whose copy is already on the dead-letter stream: acks it if it is
/// still pending for this consumer (returns 1), else deletes the copy, since another
/// consumer took the entry over (returns 0). KEYS: stream, dead-letter stream. ARGV:
/// group, consumer, entry id, copy id. (The copy is added by the client beforehand,
/// with no limit on the number of fields; a consumer that dies between the two leaves
/// a second copy at worst, never an ack without one.)
const DEAD_LETTER_SCRIPT: &str = r"
local mine = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1, ARGV[2])
if #mine == 0 then
  redis.call('XDEL', KEYS[2], ARGV[4])
  return 0
end
return redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
";

/// Sets the idle time of the entries still pending for this consumer (0 touches an
/// entry), without counting a delivery. KEYS: stream. ARGV: group, consumer, then an
/// id and an idle time in ms for each entry. Returns how many were set.
const IDLE_SCRIPT: &str = r"
local set = 0
for i = 3, #ARGV, 2 do
  if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2]) == 1 then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'IDLE', ARGV[i + 1], 'JUSTID')
    set = set + 1
  end
end
return set
";

/// How long a command other than a blocking read may wait for its reply.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);

impl StreamConsumer {
    /// Joins `group` on `stream` as `consumer`, creating the group (reading from the
    /// stream's start) and the stream if they do not exist. Opens its own connections
    /// from `client` (see the type's documentation).
    pub async fn new(
        client: &redis::Client,
        stream: impl Into<String>,
        group: impl Into<String>,
        consumer: impl Into<String>,
    ) -> RedisResult<StreamConsumer> {
        let (stream, group) = (stream.into(), group.into());
        let block = Duration::from_millis(500);
        let commands = connect(client, COMMAND_TIMEOUT).await?;
        let created: RedisResult<()> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&stream)
            .arg(&group)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut commands.clone())
            .await;
        match created {
            Err(e) if e.code() == Some("BUSYGROUP") => {}
            other => other?,
        }
        Ok(StreamConsumer {
            client: client.clone(),
            commands,
            reader: Default::default(),
            dead_letter: format!("{stream}:dead"),
            stream,
            group,
            consumer: consumer.into(),
            payload_field: DEFAULT_PAYLOAD_FIELD.to_owned(),
            batch: 32,
            concurrency: super::DEFAULT_CONCURRENCY,
            block,
            reclaim_idle: Duration::from_secs(30),
            grace: super::DEFAULT_GRACE,
            cursor: Default::default(),
            deferred: Default::default(),
        })
    }

    /// Where dead-lettered entries go; default `{stream}:dead`.
    pub fn dead_letter_stream(mut self, stream: impl Into<String>) -> Self {
        self.dead_letter = stream.into();
        self
    }

    /// Which field holds the payload; default [`DEFAULT_PAYLOAD_FIELD`].
    pub fn payload_field(mut self, field: impl Into<String>) -> Self {
        self.payload_field = field.into();
        self
    }

    /// How many entries one read or reclaim takes; default 32.
    pub fn batch(mut self, entries: usize) -> Self {
        self.batch = entries.max(1);
        self
    }

    /// How many entries of a batch are handled at once; default 32. Up to this many
    /// handler calls are in flight, their store round trips overlapping; `1` handles
    /// them one after the other. Memory stays bounded by the batch size.
    pub fn concurrency(mut self, in_flight: usize) -> Self {
        self.concurrency = in_flight.max(1);
        self
    }

    /// How long a read waits for new entries; default 500 ms. Zero does not block
    /// (it is not Redis's `BLOCK 0`, which waits for ever). The read connection's
    /// reply timeout is this plus five seconds.
    pub fn block(mut self, wait: Duration) -> Self {
        self.block = wait;
        self.reader = Default::default();
        self
    }

    /// How long an entry must have been pending, untouched, before this consumer
    /// reclaims it; default 30 s. A live consumer touches its unsettled entries every
    /// third of this, so only a stopped consumer's entries are reclaimed. An entry
    /// left for retry whose result gives no delay waits this long.
    pub fn reclaim_idle(mut self, idle: Duration) -> Self {
        self.reclaim_idle = idle.max(Duration::from_millis(3));
        self
    }

    /// Polls until `shutdown` resolves (a signal, a deploy's stop), then lets the poll
    /// under way finish (its calls return, its entries are acked or left for retry),
    /// and answers `Ok`; or answers a poll's error. A poll still running
    /// [`shutdown_grace`](StreamConsumer::shutdown_grace) after the shutdown is
    /// dropped then: its entries stay pending, for a consumer of the group to reclaim
    /// after [`reclaim_idle`](StreamConsumer::reclaim_idle). A quiet stream's poll
    /// ends within the block time, so a stop waits at most that for it.
    pub async fn run_until<F, Fut, R>(
        &self,
        mut handler: F,
        shutdown: impl Future<Output = ()>,
    ) -> RedisResult<()>
    where
        F: FnMut(StreamMessage) -> Fut,
        Fut: Future<Output = R>,
        R: DispositionExt,
    {
        let mut shutdown = std::pin::pin!(futures_util::FutureExt::fuse(shutdown));
        loop {
            let mut polled = std::pin::pin!(self.poll(&mut handler));
            tokio::select! {
                biased;
                result = &mut polled => {
                    result?;
                }
                () = &mut shutdown => {
                    return match tokio::time::timeout(self.grace, polled).await {
                        Ok(result) => result.map(drop),
                        Err(_) => {
                            tracing::warn!(
                                stream = %self.stream,
                                grace = ?self.grace,
                                "the poll under way at the shutdown outlasted its grace: its \
                                 entries stay pending, to be reclaimed"
                            );
                            Ok(())
                        }
                    };
                }
            }
            if futures_util::FutureExt::now_or_never(&mut shutdown).is_some() {
                return Ok(());
            }
        }
    }

    /// How long the poll under way has to finish after [`run_until`]'s shutdown;
    /// default 30 s. Keep it under what the deploy waits before it kills the process.
    ///
    /// [`run_until`]: StreamConsumer::run_until
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// Reclaims stale entries, reads new ones, and settles each with `handler`'s
    /// disposition. Up to [`concurrency`](StreamConsumer::concurrency) handler calls
    /// run at once; the entries they ack are acknowledged together, in one `XACK`, once
    /// all of the batch's calls have returned (each after recording its outcome). An
    /// entry whose call answered `InProgress` while others ran is handled again once
    /// they are done: it may have met a delivery of the same key in the same batch. A
    /// quiet stream gives an empty [`Polled`] after the block time.
    pub async fn poll<F, Fut, R>(&self, mut handler: F) -> RedisResult<Polled>
    where
        F: FnMut(StreamMessage) -> Fut,
        Fut: Future<Output = R>,
        R: DispositionExt,
    {
        if let Err(error) = self.tend_deferred(false).await {
            tracing::warn!(%error, stream = %self.stream, "keeping retried entries waiting failed");
        }
        let mut entries = self.reclaim().await?;
        if entries.is_empty() {
            entries = self.read().await?;
        }
        let meter = ConsumerMeter::new("redis_streams", &self.stream);
        meter.taken(entries.len());
        // Touched while the batch is handled; those already acked are skipped by the
        // touch script, which only touches entries still pending for this consumer.
        let unsettled: Vec<String> = entries.iter().map(|e| e.id.clone()).collect();
        let settle = async {
            let mut polled = Polled::default();
            let mut settled = self.handle(&mut handler, entries).await;
            if self.concurrency > 1 {
                // Met another delivery of the same key, most likely in this batch;
                // those have settled now, so one more try tells.
                let (busy, done): (Vec<_>, Vec<_>) =
                    settled.into_iter().partition(|s| s.answer.in_progress);
                settled = done;
                for mut busy in busy {
                    let count = busy.entry.deliveries();
                    let result =
                        with_delivery_count(count, handler(self.message(busy.entry.clone()))).await;
                    busy.answer = Answer::of(&result);
                    settled.push(busy);
                }
            }
            // The entries left for retry are kept back for their delay even when
            // an ack or a dead letter below fails, and the poll answers that error.
            let retried: Vec<(String, Duration)> = (settled.iter())
                .filter(|s| s.answer.disposition == Disposition::Retry)
                .map(|s| (s.entry.id.clone(), s.answer.delay_or(self.reclaim_idle)))
                .collect();
            let settling = async {
                let acked: Vec<String> = (settled.iter())
                    .filter(|s| s.answer.disposition == Disposition::Ack)
                    .map(|s| s.entry.id.clone())
                    .collect();
                self.ack(&acked).await?;
                acked.iter().for_each(|_| meter.settled(Disposition::Ack));
                polled.acked = acked;
                for Settled { entry, answer } in settled {
                    match answer.disposition {
                        Disposition::Ack => {}
                        Disposition::Retry => {
                            meter.settled(Disposition::Retry);
                            polled.retried.push(entry.id);
                        }
                        Disposition::DeadLetter => {
                            if self.dead_letter(&entry.id, entry.fields).await? {
                                meter.settled(Disposition::DeadLetter);
                                polled.dead_lettered.push(entry.id);
                            } else {
                                meter.let_go(1);
                                polled.taken_over.push(entry.id);
                            }
                        }
                    }
                }
                RedisResult::Ok(())
            };
            let settled = settling.await;
            // On an error the entries are reclaimed after the reclaim idle time
            // instead: early, not lost.
            if let Err(error) = self.defer(retried).await {
                tracing::warn!(%error, stream = %self.stream, "delaying retried entries failed");
            }
            settled.map(|()| polled)
        };
        let heartbeat = async {
            loop {
                tokio::time::sleep(self.reclaim_idle / 3).await;
                let touched = unsettled.iter().map(|id| (id.clone(), Duration::ZERO));
                if let Err(error) = self.set_idle(touched.collect()).await {
                    tracing::warn!(%error, stream = %self.stream, "touching pending entries failed");
                }
                if let Err(error) = self.tend_deferred(false).await {
                    tracing::warn!(%error, stream = %self.stream, "keeping retried entries waiting failed");
                }
            }
        };
        tokio::select! {
            biased;
            polled = settle => polled,
            never = heartbeat => never,
        }
    }

    /// Runs `handler` on each entry, up to `concurrency` at once, in the batch's
    /// order of starting.
    async fn handle<F, Fut, R>(&self, handler: &mut F, entries: Vec<Entry>) -> Vec<Settled>
    where
        F: FnMut(StreamMessage) -> Fut,
        Fut: Future<Output = R>,
        R: DispositionExt,
    {
        use futures_util::StreamExt as _;
        let calls = entries.into_iter().map(|entry| {
            let count = entry.deliveries();
            let call = with_delivery_count(count, handler(self.message(entry.clone())));
            async move {
                let result = call.await;
                Settled { entry, answer: Answer::of(&result) }
            }
        });
        futures_util::stream::iter(calls).buffer_unordered(self.concurrency).collect().await
    }

    async fn reclaim(&self) -> RedisResult<Vec<Entry>> {
        let start = self.cursor.lock().map(|c| c.clone()).unwrap_or_else(|_| "0-0".to_owned());
        let start = if start.is_empty() { "0-0".to_owned() } else { start };
        let reply: Value = redis::cmd("XAUTOCLAIM")
            .arg(&self.stream)
            .arg(&self.group)
            .arg(&self.consumer)
            .arg(self.reclaim_idle.as_millis() as u64)
            .arg(&start)
            .arg("COUNT")
            .arg(self.batch)
            .query_async(&mut self.commands.clone())
            .await?;
        // [next cursor, [entries], [deleted ids]]
        let parts = items(reply);
        let cursor = parts.first().and_then(text).unwrap_or_default();
        let entries = parts.into_iter().nth(1).map(entries).unwrap_or_default();
        if let Ok(mut saved) = self.cursor.lock() {
            *saved = cursor;
        }
        let mut entries: Vec<Entry> =
            entries.into_iter().map(|e| Entry { delivery_count: None, ..e }).collect();
        self.count_deliveries(&mut entries).await;
        Ok(entries)
    }

    /// Reads reclaimed entries' delivery counts, which `XAUTOCLAIM` does not return,
    /// from the pending list: one pipelined `XPENDING` per entry, in one round trip
    /// (a reclaim is the rare path). On an error the counts stay unknown.
    async fn count_deliveries(&self, entries: &mut [Entry]) {
        if entries.is_empty() {
            return;
        }
        let mut pipe = redis::pipe();
        for entry in entries.iter() {
            pipe.cmd("XPENDING")
                .arg(&self.stream)
                .arg(&self.group)
                .arg(&entry.id)
                .arg(&entry.id)
                .arg(1);
        }
        let Ok(replies) = pipe.query_async::<Vec<Value>>(&mut self.commands.clone()).await else {
            return;
        };
        for (entry, reply) in entries.iter_mut().zip(replies) {
            // [[id, consumer, idle ms, delivery count]]
            let pending = items(reply).into_iter().next().map(items).unwrap_or_default();
            entry.delivery_count = match pending.get(3) {
                Some(Value::Int(n)) => usize::try_from(*n).ok(),
                _ => None,
            };
        }
    }

    async fn read(&self) -> RedisResult<Vec<Entry>> {
        let mut read = redis::cmd("XREADGROUP");
        read.arg("GROUP").arg(&self.group).arg(&self.consumer).arg("COUNT").arg(self.batch);
        if !self.block.is_zero() {
            read.arg("BLOCK").arg(self.block.as_millis().max(1) as u64);
        }
        read.arg("STREAMS").arg(&self.stream).arg(">");
        let reader = (self.reader)
            .get_or_try_init(|| connect(&self.client, self.block + COMMAND_TIMEOUT))
            .await?;
        let reply: Value = read.query_async(&mut reader.clone()).await?;
        // [[stream, [entries]]] (a map of stream to entries under RESP3), or nil.
        let streams: Vec<Value> = match reply {
            Value::Map(pairs) => pairs.into_iter().map(|(_, entries)| entries).collect(),
            other => items(other).into_iter().filter_map(|s| items(s).into_iter().nth(1)).collect(),
        };
        Ok(streams.into_iter().flat_map(entries).collect())
    }

    /// Sets each entry's idle time, if it is still pending for this consumer.
    async fn set_idle(&self, entries: Vec<(String, Duration)>) -> RedisResult<()> {
        if entries.is_empty() {
            return Ok(());
        }
        static SCRIPT: std::sync::LazyLock<redis::Script> =
            std::sync::LazyLock::new(|| redis::Script::new(IDLE_SCRIPT));
        let mut invocation = SCRIPT.prepare_invoke();
        invocation.key(&self.stream).arg(&self.group).arg(&self.consumer);
        for (id, idle) in entries {
            invocation.arg(id).arg(u64::try_from(idle.as_millis()).unwrap_or(u64::MAX));
        }
        let _: i64 = invocation.invoke_async(&mut self.commands.clone()).await?;
        Ok(())
    }

    /// Keeps entries left for retry pending until their delay is over.
    async fn defer(&self, retried: Vec<(String, Duration)>) -> RedisResult<()> {
        if retried.is_empty() {
            return Ok(());
        }
        if let Ok(mut deferred) = self.deferred.lock() {
            for (id, delay) in retried {
                // An entry reclaimed early (its consumer polled too seldom to keep it
                // touched) and retried again waits its new delay only.
                deferred.entries.retain(|(held, _)| *held != id);
                // Touched meanwhile, however long the delay.
                deferred.entries.push((id, deadline_after(delay)));
            }
        }
        self.tend_deferred(true).await
    }

    /// Gives each deferred entry whose delay ends within the reclaim idle time the idle
    /// time that makes it reclaimable when the delay ends, and lets it go; touches the
    /// others, every third of the reclaim idle time (or now, when `now`).
    async fn tend_deferred(&self, now: bool) -> RedisResult<()> {
        let at = Instant::now();
        let idle = self.reclaim_idle;
        let entries = {
            let Ok(mut deferred) = self.deferred.lock() else { return Ok(()) };
            if deferred.entries.is_empty() {
                return Ok(());
            }
            let touch = now || deferred.touched.is_none_or(|t| at.duration_since(t) >= idle / 3);
            let mut entries = Vec::new();
            deferred.entries.retain(|(id, due)| {
                let left = due.saturating_duration_since(at);
                if left < idle {
                    entries.push((id.clone(), idle - left));
                    false
                } else {
                    if touch {
                        entries.push((id.clone(), Duration::ZERO));
                    }
                    true
                }
            });
            if touch {
                deferred.touched = Some(at);
            }
            entries
        };
        self.set_idle(entries).await
    }

    fn message(&self, entry: Entry) -> StreamMessage {
        let fields = (entry.fields.iter())
            .map(|(name, value)| (String::from_utf8_lossy(name).into_owned(), value.clone()))
            .collect();
        let field = crate::publish::redis_streams::MESSAGE_ID_FIELD.as_bytes();
        let message_id = (entry.fields.iter().rev())
            .find(|(name, _)| name == field)
            .map_or_else(String::new, |(_, value)| crate::publish::id_text(value));
        StreamMessage {
            id: entry.id,
            fields,
            delivery_count: entry.delivery_count,
            message_id,
            payload_field: self.payload_field.clone(),
            raw: entry.fields,
        }
    }

    /// Acknowledges `ids` in one `XACK`.
    async fn ack(&self, ids: &[String]) -> RedisResult<()> {
        if ids.is_empty() {
            return Ok(());
        }
        redis::cmd("XACK")
            .arg(&self.stream)
            .arg(&self.group)
            .arg(ids)
            .query_async(&mut self.commands.clone())
            .await
    }

    /// Copies the entry to the dead-letter stream, then acks it; `false` when the entry
    /// is no longer this consumer's (another one took it over): the copy is deleted
    /// again and nothing is acked.
    async fn dead_letter(&self, id: &str, fields: Vec<(Vec<u8>, Vec<u8>)>) -> RedisResult<bool> {
        let mut add = redis::cmd("XADD");
        add.arg(&self.dead_letter).arg("*").arg("idempotent-source-id").arg(id);
        for (name, value) in &fields {
            add.arg(name).arg(value);
        }
        let copy: String = add.query_async(&mut self.commands.clone()).await?;
        static SCRIPT: std::sync::LazyLock<redis::Script> =
            std::sync::LazyLock::new(|| redis::Script::new(DEAD_LETTER_SCRIPT));
        let mut invocation = SCRIPT.prepare_invoke();
        invocation.key(&self.stream).key(&self.dead_letter);
        invocation.arg(&self.group).arg(&self.consumer).arg(id).arg(&copy);
        let acked: i64 = invocation.invoke_async(&mut self.commands.clone()).await?;
        Ok(acked == 1)
    }
}

/// An entry whose handler call has returned.
struct Settled {
    entry: Entry,
    answer: Answer,
}

/// A stream entry as read: its id and its fields, exactly as Redis holds them.
#[derive(Clone)]
struct Entry {
    id: String,
    fields: Vec<(Vec<u8>, Vec<u8>)>,
    delivery_count: Option<usize>,
}

impl Entry {
    /// The delivery count, as `with_delivery_count` takes it.
    fn deliveries(&self) -> Option<u32> {
        self.delivery_count.and_then(|n| u32::try_from(n).ok())
    }
}

/// The items of an array reply (empty for nil or anything else).
fn items(value: Value) -> Vec<Value> {
    match value {
        Value::Array(items) | Value::Set(items) => items,
        _ => Vec::new(),
    }
}

/// A string reply as text.
fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

/// A string reply as bytes.
fn bytes(value: Value) -> Option<Vec<u8>> {
    match value {
        Value::BulkString(bytes) => Some(bytes),
        Value::SimpleString(s) => Some(s.into_bytes()),
        Value::Int(n) => Some(n.to_string().into_bytes()),
        _ => None,
    }
}

/// `[[id, [field, value, ...]], ...]` (a deleted entry, `[id, nil]` or nil, is left
/// out), with field names and values as bytes: nothing a producer writes into an
/// entry can fail the parsing of a whole batch.
fn entries(value: Value) -> Vec<Entry> {
    items(value)
        .into_iter()
        .filter_map(|entry| {
            let mut parts = items(entry).into_iter();
            let id = text(&parts.next()?)?;
            let flat: Vec<Vec<u8>> = match parts.next()? {
                Value::Map(pairs) => {
                    pairs.into_iter().flat_map(|(k, v)| [k, v]).filter_map(bytes).collect()
                }
                other => items(other).into_iter().filter_map(bytes).collect(),
            };
            if flat.is_empty() {
                return None;
            }
            let fields =
                flat.chunks_exact(2).map(|pair| (pair[0].clone(), pair[1].clone())).collect();
            Some(Entry { id, fields, delivery_count: Some(1) })
        })
        .collect()
}

/// A connection manager whose replies may take up to `timeout`.
async fn connect(client: &redis::Client, timeout: Duration) -> RedisResult<ConnectionManager> {
    let config = redis::aio::ConnectionManagerConfig::new()
        .set_response_timeout(Some(timeout))
        .set_connection_timeout(Some(COMMAND_TIMEOUT));
    ConnectionManager::new_with_config(client.clone(), config).await
}
