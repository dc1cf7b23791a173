//! Redis Streams consumer groups.

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::streams::{StreamAutoClaimReply, StreamId, StreamReadReply};
use redis::{RedisResult, Value};

use crate::{Disposition, DispositionExt, Payload, PayloadRef};

/// The entry field a [`StreamMessage`]'s payload is read from, unless configured.
pub const DEFAULT_PAYLOAD_FIELD: &str = "payload";

/// One stream entry delivered to this consumer.
#[derive(Debug, Clone)]
pub struct StreamMessage {
    /// The entry's id.
    pub id: String,
    /// All fields of the entry.
    pub fields: HashMap<String, Vec<u8>>,
    /// How many times the group has delivered the entry (1 on first delivery; known
    /// for reclaimed entries).
    pub delivery_count: Option<usize>,
    payload_field: String,
}

impl StreamMessage {
    /// The payload field's bytes (empty when the entry has none).
    pub fn body(&self) -> &[u8] {
        self.fields.get(&self.payload_field).map_or(&[], Vec::as_slice)
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
    /// Left pending, to be reclaimed and retried after the idle time.
    pub retried: Vec<String>,
    /// Copied to the dead-letter stream, then acknowledged.
    pub dead_lettered: Vec<String>,
}

/// A consumer in a Redis Streams consumer group.
///
/// Each [`poll`](StreamConsumer::poll) first reclaims entries that have been pending
/// longer than the reclaim idle time (`XAUTOCLAIM`: entries of consumers that died,
/// and entries left for retry), then reads new ones (`XREADGROUP`), and settles each by
/// its handler's disposition: `XACK` on Ack; nothing on Retry (it stays pending and is
/// reclaimed later); on DeadLetter, `XADD` to the dead-letter stream (the entry's
/// fields plus `idempotent-source-id`) and `XACK`, in one script: no ack without the
/// copy. Standalone Redis (the two streams are different keys).
///
/// ```no_run
/// # async fn demo(redis: redis::aio::ConnectionManager, store: idempotent_runtime::MemoryStore) -> redis::RedisResult<()> {
/// use idempotent_runtime::consume::redis_streams::{StreamConsumer, StreamMessage};
/// use idempotent_runtime::{Error, Outcome};
///
/// async fn handle(msg: StreamMessage) -> Result<Outcome<()>, Error<std::io::Error>> {
///     // an #[idempotent] function
///     # let _ = msg; Ok(Outcome::Processed(()))
/// }
///
/// let consumer = StreamConsumer::new(redis, "orders", "billing", "billing-1").await?;
/// loop {
///     consumer.poll(handle).await?;
/// }
/// # }
/// ```
#[derive(Clone)]
pub struct StreamConsumer {
    connection: ConnectionManager,
    stream: String,
    group: String,
    consumer: String,
    dead_letter: String,
    payload_field: String,
    batch: usize,
    block: Duration,
    reclaim_idle: Duration,
    /// Where the next `XAUTOCLAIM` scan resumes, so entries deep in the pending list
    /// are reached too.
    cursor: std::sync::Arc<std::sync::Mutex<String>>,
}

/// Copies an entry to the dead-letter stream and acks it, atomically: if the copy
/// fails, the ack does not happen. KEYS: stream, dead-letter stream. ARGV: group, id,
/// then field/value pairs.
const DEAD_LETTER_SCRIPT: &str = r"
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
return redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
";

impl StreamConsumer {
    /// Joins `group` on `stream` as `consumer`, creating the group (reading from the
    /// stream's start) and the stream if they do not exist.
    pub async fn new(
        connection: ConnectionManager,
        stream: impl Into<String>,
        group: impl Into<String>,
        consumer: impl Into<String>,
    ) -> RedisResult<StreamConsumer> {
        let (stream, group) = (stream.into(), group.into());
        let mut conn = connection.clone();
        let created: RedisResult<()> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&stream)
            .arg(&group)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut conn)
            .await;
        match created {
            Err(e) if e.code() == Some("BUSYGROUP") => {}
            other => other?,
        }
        Ok(StreamConsumer {
            connection,
            dead_letter: format!("{stream}:dead"),
            stream,
            group,
            consumer: consumer.into(),
            payload_field: DEFAULT_PAYLOAD_FIELD.to_owned(),
            batch: 32,
            block: Duration::from_millis(500),
            reclaim_idle: Duration::from_secs(30),
            cursor: Default::default(),
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

    /// How long a read waits for new entries; default 500 ms.
    pub fn block(mut self, wait: Duration) -> Self {
        self.block = wait;
        self
    }

    /// How long an entry must have been pending before this consumer reclaims it;
    /// default 30 s. Keep it above the handler's lease: a live consumer's entry is
    /// then never taken from it, and one left for retry waits this long.
    pub fn reclaim_idle(mut self, idle: Duration) -> Self {
        self.reclaim_idle = idle;
        self
    }

    /// Reclaims stale entries, reads new ones, and settles each with `handler`'s
    /// disposition, one at a time in order.
    pub async fn poll<F, Fut, R>(&self, mut handler: F) -> RedisResult<Polled>
    where
        F: FnMut(StreamMessage) -> Fut,
        Fut: Future<Output = R>,
        R: DispositionExt,
    {
        let mut entries = self.reclaim().await?;
        if entries.is_empty() {
            entries = self.read().await?;
        }
        let mut polled = Polled::default();
        for entry in entries {
            let message = self.message(entry);
            let id = message.id.clone();
            let fields = message.fields.clone();
            match handler(message).await.disposition() {
                Disposition::Ack => {
                    self.ack(&id).await?;
                    polled.acked.push(id);
                }
                Disposition::Retry => polled.retried.push(id),
                Disposition::DeadLetter => {
                    self.dead_letter(&id, fields).await?;
                    polled.dead_lettered.push(id);
                }
            }
        }
        Ok(polled)
    }

    async fn reclaim(&self) -> RedisResult<Vec<StreamId>> {
        let start = self.cursor.lock().map(|c| c.clone()).unwrap_or_else(|_| "0-0".to_owned());
        let start = if start.is_empty() { "0-0".to_owned() } else { start };
        let reply: StreamAutoClaimReply = redis::cmd("XAUTOCLAIM")
            .arg(&self.stream)
            .arg(&self.group)
            .arg(&self.consumer)
            .arg(self.reclaim_idle.as_millis() as u64)
            .arg(&start)
            .arg("COUNT")
            .arg(self.batch)
            .query_async(&mut self.connection.clone())
            .await?;
        if let Ok(mut cursor) = self.cursor.lock() {
            *cursor = reply.next_stream_id;
        }
        Ok(reply.claimed)
    }

    async fn read(&self) -> RedisResult<Vec<StreamId>> {
        let reply: Option<StreamReadReply> = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(&self.group)
            .arg(&self.consumer)
            .arg("COUNT")
            .arg(self.batch)
            .arg("BLOCK")
            .arg(self.block.as_millis() as u64)
            .arg("STREAMS")
            .arg(&self.stream)
            .arg(">")
            .query_async(&mut self.connection.clone())
            .await?;
        Ok(reply.into_iter().flat_map(|r| r.keys).flat_map(|k| k.ids).collect())
    }

    fn message(&self, entry: StreamId) -> StreamMessage {
        let fields = entry
            .map
            .into_iter()
            .filter_map(|(k, v)| match v {
                Value::BulkString(bytes) => Some((k, bytes)),
                Value::SimpleString(s) => Some((k, s.into_bytes())),
                _ => None,
            })
            .collect();
        StreamMessage {
            id: entry.id,
            fields,
            delivery_count: entry.delivered_count,
            payload_field: self.payload_field.clone(),
        }
    }

    async fn ack(&self, id: &str) -> RedisResult<()> {
        redis::cmd("XACK")
            .arg(&self.stream)
            .arg(&self.group)
            .arg(id)
            .query_async(&mut self.connection.clone())
            .await
    }

    async fn dead_letter(&self, id: &str, fields: HashMap<String, Vec<u8>>) -> RedisResult<()> {
        static SCRIPT: std::sync::LazyLock<redis::Script> =
            std::sync::LazyLock::new(|| redis::Script::new(DEAD_LETTER_SCRIPT));
        let mut invocation = SCRIPT.prepare_invoke();
        invocation.key(&self.stream).key(&self.dead_letter).arg(&self.group).arg(id);
        invocation.arg("idempotent-source-id").arg(id);
        for (k, v) in &fields {
            invocation.arg(k).arg(v);
        }
        let _: i64 = invocation.invoke_async(&mut self.connection.clone()).await?;
        Ok(())
    }
}
