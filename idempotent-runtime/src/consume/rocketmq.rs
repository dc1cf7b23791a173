//! RocketMQ push consumers in clustering mode, through `rocketmq-client-rust`.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt as _;
use futures_util::future::BoxFuture;
use futures_util::stream::FuturesUnordered;
use rocketmq_client_rust::{
    ClientConfig, ClientRuntime, ClientRuntimeConfig, ConsumeConcurrentlyContext,
    ConsumeConcurrentlyStatus, DefaultMQPushConsumer, MQPushConsumer as _, TelemetryHandle,
};
use rocketmq_model::common::consumer::consume_from_where::ConsumeFromWhere;
use rocketmq_model::common::message::message_client_id_setter::MessageClientIDSetter;
use rocketmq_model::common::message::message_ext::MessageExt;
use rocketmq_runtime::{BlockingPoolPolicy, RuntimeContext};
use tokio::sync::{mpsc, oneshot};

use super::{Answer, DEFAULT_CONCURRENCY};
use crate::delivery::with_delivery_count;
use crate::metrics::ConsumerMeter;
use crate::{Disposition, DispositionExt, Payload, PayloadRef};

/// What can go wrong while consuming: starting the consumer, or sending a message back
/// to the broker.
pub type RocketMqError = Box<dyn std::error::Error + Send + Sync>;

/// The broker's delay levels 1 to 18 (its default `messageDelayLevel`), which a
/// message sent back for retry waits.
pub const DELAY_LEVELS: [Duration; 18] = [
    Duration::from_secs(1),
    Duration::from_secs(5),
    Duration::from_secs(10),
    Duration::from_secs(30),
    Duration::from_secs(60),
    Duration::from_secs(2 * 60),
    Duration::from_secs(3 * 60),
    Duration::from_secs(4 * 60),
    Duration::from_secs(5 * 60),
    Duration::from_secs(6 * 60),
    Duration::from_secs(7 * 60),
    Duration::from_secs(8 * 60),
    Duration::from_secs(9 * 60),
    Duration::from_secs(10 * 60),
    Duration::from_secs(20 * 60),
    Duration::from_secs(30 * 60),
    Duration::from_secs(60 * 60),
    Duration::from_secs(2 * 60 * 60),
];

/// The delay level a retry `delay` is sent back with: the first level at least as
/// long, so a retry never comes sooner than its handler asked (sooner, it would meet
/// the other claim still in progress, or skip the backoff); 18 (2 h) for longer.
///
/// ```
/// use std::time::Duration;
/// use idempotent_runtime::consume::rocketmq::delay_level;
///
/// assert_eq!(delay_level(Duration::ZERO), 1); // 1 s
/// assert_eq!(delay_level(Duration::from_secs(7)), 3); // 10 s
/// assert_eq!(delay_level(Duration::from_secs(60)), 5); // 1 min
/// assert_eq!(delay_level(Duration::from_secs(86_400)), 18); // 2 h
/// ```
pub fn delay_level(delay: Duration) -> i32 {
    let level = DELAY_LEVELS.iter().position(|&d| d >= delay).unwrap_or(DELAY_LEVELS.len() - 1);
    level as i32 + 1
}

/// One message from a RocketMQ consumer.
#[derive(Debug, Clone)]
pub struct RocketMqMessage {
    /// Its topic (the original one, also for a message redelivered from the retry topic).
    pub topic: String,
    /// Its tag, or empty.
    pub tags: String,
    /// Its business keys (the `KEYS` property as the producer set it: several keys are
    /// separated by spaces), or empty: for `key = "order:{keys}"`. A producer sets
    /// them from the business event, so they stay the same when it sends the event
    /// again: the safer key.
    pub keys: String,
    /// Its unique message id (the `UNIQ_KEY` property, which the producer's client
    /// sets): for `key = "{message_id}"`. It is the same on every redelivery and
    /// retry of this message, but a producer that sends the event again (after a
    /// timeout, say) makes a new one, so that copy would run again: key on the
    /// business keys where the producer sets them. Empty when it has none, so a key
    /// using it is a key error.
    pub message_id: String,
    /// The body.
    pub body: Bytes,
    /// Its user properties and the broker's (`KEYS`, `TAGS`, `UNIQ_KEY`, ...).
    pub properties: HashMap<String, String>,
    /// The broker that holds it, the queue and the offset there (of the copy in
    /// the retry topic, for a retry).
    pub broker_name: String,
    /// Its queue on that broker.
    pub queue_id: i32,
    /// Its offset in that queue.
    pub queue_offset: i64,
    /// How many times it has been delivered, this time included (the broker's
    /// reconsume count + 1); the attempt of a handler on [`NoStore`](crate::NoStore).
    pub delivery_count: u32,
}

impl RocketMqMessage {
    fn of(message: &MessageExt) -> RocketMqMessage {
        let properties: HashMap<String, String> =
            message.properties().iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let property = |name: &str| properties.get(name).cloned().unwrap_or_default();
        RocketMqMessage {
            topic: message.topic().to_string(),
            tags: property("TAGS"),
            keys: property("KEYS"),
            message_id: MessageClientIDSetter::get_uniq_id(message)
                .map_or_else(String::new, |id| id.to_string()),
            body: message.body().unwrap_or_default(),
            broker_name: message.broker_name().to_owned(),
            queue_id: message.queue_id(),
            queue_offset: message.queue_offset(),
            delivery_count: u32::try_from(message.reconsume_times()).unwrap_or(0).saturating_add(1),
            properties,
        }
    }
}

/// The body is the payload, for `{/json/pointer}` keys and `validate`.
impl Payload for RocketMqMessage {
    fn payload(&self) -> PayloadRef<'_> {
        PayloadRef::Bytes(&self.body)
    }
}

/// A RocketMQ push consumer in clustering mode (the group's members share the topic's
/// queues) that settles each message by its handler's disposition, up to
/// [`concurrency`](RocketMqConsumer::concurrency) at once (default 32):
///
/// * Ack → `CONSUME_SUCCESS`: the client commits the queue's offset up to the oldest
///   message still in hand.
/// * Retry → the message is sent back to the broker with the delay level
///   ([`delay_level`]) of the result's [`retry_delay`](DispositionExt::retry_delay)
///   (the handler's `backoff`, or the other claim's lease for `InProgress`; the
///   consumer's [`retry_delay`](RocketMqConsumer::retry_delay) for results that
///   don't say), then `CONSUME_SUCCESS`. The broker redelivers the copy through the
///   group's retry topic `%RETRY%{group}` after that delay; at the last of
///   [`max_reconsume_times`](RocketMqConsumer::max_reconsume_times) the broker puts it
///   in the dead-letter queue instead.
/// * DeadLetter → the message is sent back with delay level −1, which the broker
///   stores in the group's dead-letter queue `%DLQ%{group}` at once, then
///   `CONSUME_SUCCESS`. That is RocketMQ's own route, the one retries exhausted by
///   `max_reconsume_times` also take, so a group's dead letters are in one place,
///   kept with their properties, and readable by a consumer of that topic; no
///   producer or topic of ours is needed.
///
/// A send-back that fails answers `RECONSUME_LATER`, so the client sends it back
/// itself or, failing that, consumes it again in a few seconds: the message stays in
/// hand either way, and its offset is not committed past it. Where the broker refuses
/// a send-back, the client publishes the copy to the retry topic instead (RocketMQ's
/// own fallback, which this consumer keeps): a dead letter taking that way comes back
/// once more and goes to the dead-letter queue at that delivery (its record is
/// FAILED, so its handler does not run again); and a send-back whose answer was lost
/// can leave two copies, so the dead-letter queue may hold a message twice (its
/// readers should key on the message id). Send-backs of one consumer go out one at a
/// time (the client takes the consumer exclusively for each).
///
/// The handler is called on the caller's task (inside the future
/// [`run`](RocketMqConsumer::run) returns), not on the client's threads. The client
/// hands each message over from one of its consume threads, which waits for the
/// answer: that thread pool is sized to `concurrency`.
///
/// A message stays in hand until its handler returns, however long that takes: the
/// client's consume timeout (15 minutes in RocketMQ, after which it sends a message
/// back, ignoring a failure, and stops holding its queue's offset, so a process
/// dying then would lose it) is turned off. A handler that never returns holds its
/// queue's offset, and once that queue's messages in hand span 2,000 offsets the
/// client stops fetching from it: bound handlers that may hang with
/// `tokio::time::timeout`.
///
/// A consumer whose process dies has its queues' offsets where its last committed
/// message left them: the queues go to the group's other members at the next
/// rebalance (within 20 s), which redeliver what it held.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use idempotent_runtime::consume::rocketmq::{RocketMqConsumer, RocketMqMessage};
/// use idempotent_runtime::{Error, Outcome};
///
/// async fn handle(msg: RocketMqMessage) -> Result<Outcome<()>, Error<std::io::Error>> {
///     // an #[idempotent] function, keyed on `{keys}` or `{message_id}`
///     # let _ = msg; Ok(Outcome::Processed(()))
/// }
///
/// let consumer = RocketMqConsumer::new("127.0.0.1:9876", "billing", "orders").concurrency(32);
/// consumer.run(handle).await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct RocketMqConsumer {
    name_server: String,
    group: String,
    topic: String,
    tags: String,
    concurrency: usize,
    max_reconsume_times: i32,
    retry_delay: Duration,
    from_first_offset: bool,
    route_refresh: Duration,
}

/// The client's consume timeout, in minutes: a year, so it never sends back a
/// message whose handler still runs (its send-back ignores failures, and the message
/// would no longer hold its queue's offset). Small enough that the client's arithmetic
/// on it in milliseconds does not overflow.
const NO_CONSUME_TIMEOUT_MINUTES: u64 = 365 * 24 * 60;

/// Client instance names must differ between the clients of one process: the client
/// id (address @ instance) tells a group's members apart.
static INSTANCES: AtomicU64 = AtomicU64::new(0);

/// A client configuration for `name_server`, with an instance name of its own.
pub(crate) fn client_config(name_server: &str, route_refresh: Duration) -> ClientConfig {
    let instance = INSTANCES.fetch_add(1, Ordering::Relaxed);
    let mut client = ClientConfig::new();
    client.set_namesrv_addr(name_server.into());
    client.set_instance_name(format!("idempotent-{}-{instance}", std::process::id()).into());
    let millis = u32::try_from(route_refresh.as_millis()).unwrap_or(u32::MAX);
    client.set_poll_name_server_interval(millis);
    client
}

/// A client runtime on the current tokio runtime, whose blocking work runs under
/// `policy`.
pub(crate) fn client_runtime(
    policy: BlockingPoolPolicy,
) -> Result<Arc<ClientRuntime>, RocketMqError> {
    let context = RuntimeContext::try_from_current_with_blocking_policy("idempotent", policy)?;
    let runtime = ClientRuntime::try_new(
        context.service_context("rocketmq"),
        ClientRuntimeConfig::default(),
        TelemetryHandle::noop(),
    )?;
    Ok(runtime)
}

impl RocketMqConsumer {
    /// A member of consumer group `group` on the cluster whose name server is at
    /// `name_server` (`host:port`, several separated by `;`), subscribed to every
    /// message of `topic`.
    pub fn new(
        name_server: impl Into<String>,
        group: impl Into<String>,
        topic: impl Into<String>,
    ) -> RocketMqConsumer {
        RocketMqConsumer {
            name_server: name_server.into(),
            group: group.into(),
            topic: topic.into(),
            tags: "*".to_owned(),
            concurrency: DEFAULT_CONCURRENCY,
            max_reconsume_times: 16,
            retry_delay: Duration::from_secs(1),
            from_first_offset: false,
            route_refresh: Duration::from_secs(30),
        }
    }

    /// Only messages with these tags (`"a || b"`); default every message (`"*"`).
    pub fn tags(mut self, expression: impl Into<String>) -> Self {
        self.tags = expression.into();
        self
    }

    /// How many messages are handled at once; default [`DEFAULT_CONCURRENCY`] (32).
    /// Messages of one queue are handled side by side too (clustering consumers give
    /// no order): where order matters, use `concurrency(1)`.
    pub fn concurrency(mut self, in_flight: usize) -> Self {
        self.concurrency = in_flight.clamp(1, 1_000);
        self
    }

    /// How many times a message is sent back for retry before the broker puts it in
    /// the dead-letter queue instead; default 16, RocketMQ's. Keep it above the
    /// handlers' `max_attempts`: deliveries answered `InProgress` count too.
    pub fn max_reconsume_times(mut self, times: u32) -> Self {
        self.max_reconsume_times = i32::try_from(times).unwrap_or(i32::MAX);
        self
    }

    /// How long a retry waits when its handler's result does not say
    /// ([`DispositionExt::retry_delay`] is `None`); default 1 s. Rounded up to a
    /// delay level ([`delay_level`]).
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// A group with no committed offset starts at the first message each queue still
    /// holds, instead of RocketMQ's default, the end of each queue (messages
    /// published before the group first started are then not consumed).
    pub fn from_first_offset(mut self) -> Self {
        self.from_first_offset = true;
        self
    }

    /// How often the client asks the name server for topic routes; default 30 s,
    /// RocketMQ's, and between 10 s and 10 min (the client's limits). Until a route is
    /// known a topic is not read: the group's retry topic, which the broker creates at
    /// the first retry, is read from the next refresh on.
    pub fn route_refresh(mut self, every: Duration) -> Self {
        self.route_refresh = every.clamp(Duration::from_secs(10), Duration::from_secs(600));
        self
    }

    /// Starts the consumer and handles messages until the returned future is dropped
    /// (then the consumer shuts down in the background; the calls not yet returned are
    /// dropped and their messages sent back by the client, while settles already
    /// begun finish on their own tasks), or fails to start (then that error).
    ///
    /// Each message in hand holds one of the tokio runtime's blocking threads while
    /// its handler runs (the client's consume thread waits there): keep the sum of the
    /// process's consumers' `concurrency` well under the runtime's
    /// `max_blocking_threads` (512 by default), which `spawn_blocking` work of the
    /// handlers (DNS lookups, `tokio::fs`) also needs.
    pub async fn run<F, Fut, R>(&self, mut handler: F) -> Result<(), RocketMqError>
    where
        F: FnMut(RocketMqMessage) -> Fut,
        Fut: Future<Output = R>,
        R: DispositionExt,
    {
        let (handed, mut deliveries) = mpsc::channel::<Handed>(self.concurrency);
        // The client's futures are deep types: boxed, they don't make every caller's
        // `Send` check recurse through them.
        let start: BoxFuture<'_, _> = Box::pin(self.start(handed));
        let mut running = start.await?;
        let mut calls = FuturesUnordered::new();
        let mut open = true;
        let meter = Arc::new(ConsumerMeter::new("rocketmq", &self.topic));
        loop {
            tokio::select! {
                handed = deliveries.recv(), if open => match handed {
                    Some(Handed { message, reply }) => {
                        meter.taken(1);
                        let copy = RocketMqMessage::of(&message);
                        let count = Some(copy.delivery_count);
                        let call = with_delivery_count(count, handler(copy));
                        calls.push(async move { (Answer::of(&call.await), message, reply) });
                    }
                    None => open = false,
                },
                // A settle runs on a task of its own: once a message is sent back, its
                // status must reach the client even if this future is dropped, or the
                // client would send it back a second time.
                Some((answer, message, reply)) = calls.next() => {
                    let (client, meter) = (running.client.clone(), meter.clone());
                    let settle = settle(client, self.retry_delay, answer, message, reply, meter);
                    drop(tokio::spawn(settle));
                }
                else => break,
            }
        }
        running.stop().await;
        Ok(())
    }

    /// Builds, subscribes and starts the client's consumer, whose listener hands each
    /// message to `handed` and waits for its status.
    async fn start(&self, handed: mpsc::Sender<Handed>) -> Result<Running, RocketMqError> {
        // The listener runs on the client's blocking pool and waits there for the
        // handler: room for `concurrency` waits beside the client's own blocking work,
        // and no time limit (the client answers RECONSUME_LATER for a listener past
        // the limit, with the handler still running).
        let policy = BlockingPoolPolicy {
            name: "idempotent-rocketmq".to_owned(),
            max_concurrency: self.concurrency + 4,
            max_queue_depth: self.concurrency * 4 + 16,
            queue_timeout: Duration::from_secs(365 * 86_400),
            task_timeout: Duration::from_secs(365 * 86_400),
            warn_after: Duration::from_secs(365 * 86_400),
        };
        let runtime = client_runtime(policy)?;
        let client = client_config(&self.name_server, self.route_refresh);
        let mut builder = DefaultMQPushConsumer::builder(runtime)
            .client_config(client)
            .consumer_group(self.group.as_str())
            .consume_thread_min(self.concurrency as u32)
            .consume_thread_max(self.concurrency as u32)
            .consume_message_batch_max_size(1)
            .consume_timeout(NO_CONSUME_TIMEOUT_MINUTES)
            .max_reconsume_times(self.max_reconsume_times);
        if self.from_first_offset {
            builder = builder.consume_from_where(ConsumeFromWhere::ConsumeFromFirstOffset);
        }
        let mut consumer = builder.build();
        consumer.subscribe(self.topic.as_str(), self.tags.as_str()).await?;
        consumer.register_message_listener_concurrently(
            move |messages: &[&MessageExt], _: &ConsumeConcurrentlyContext| {
                Ok(hand_over(&handed, messages))
            },
        );
        consumer.start().await?;
        let client: Arc<dyn Client> = Arc::new(Arc::new(tokio::sync::Mutex::new(consumer)));
        Ok(Running { client, stopped: false })
    }
}

/// Sends `message` back as its answer says (with `retry_delay` for a Retry whose
/// result does not say), and tells the client's thread how it went.
async fn settle(
    consumer: Arc<dyn Client>,
    retry_delay: Duration,
    answer: Answer,
    message: MessageExt,
    reply: oneshot::Sender<ConsumeConcurrentlyStatus>,
    meter: Arc<ConsumerMeter>,
) {
    let level = match answer.disposition {
        Disposition::Ack => None,
        Disposition::Retry => Some(delay_level(answer.delay_or(retry_delay))),
        Disposition::DeadLetter => Some(-1),
    };
    let status = match level {
        None => ConsumeConcurrentlyStatus::ConsumeSuccess,
        Some(level) => {
            let broker = message.broker_name().to_owned();
            match consumer.send_back(message, level, broker).await {
                Ok(()) => ConsumeConcurrentlyStatus::ConsumeSuccess,
                Err(error) => {
                    tracing::warn!(%error, level, "sending a message back failed");
                    ConsumeConcurrentlyStatus::ReconsumeLater
                }
            }
        }
    };
    if status == ConsumeConcurrentlyStatus::ConsumeSuccess {
        meter.settled(answer.disposition);
    } else {
        meter.let_go(1);
    }
    // A client thread that stopped waiting has nothing left to tell.
    let _ = reply.send(status);
}

/// A message the client's listener handed over, and where its status goes.
struct Handed {
    message: MessageExt,
    reply: oneshot::Sender<ConsumeConcurrentlyStatus>,
}

/// On a client consume thread: hands each message to the running consumer and waits
/// for its status. A message the consumer can no longer take (it stopped) is
/// answered `RECONSUME_LATER`, as is a batch where any message was (the batch is one
/// message unless the client is configured otherwise).
fn hand_over(handed: &mpsc::Sender<Handed>, messages: &[&MessageExt]) -> ConsumeConcurrentlyStatus {
    let mut status = ConsumeConcurrentlyStatus::ConsumeSuccess;
    for &message in messages {
        let (reply, answer) = oneshot::channel();
        let sent = handed.blocking_send(Handed { message: message.clone(), reply });
        let answered = sent.ok().and_then(|()| answer.blocking_recv().ok());
        if answered != Some(ConsumeConcurrentlyStatus::ConsumeSuccess) {
            status = ConsumeConcurrentlyStatus::ReconsumeLater;
        }
    }
    status
}

/// The started client consumer, behind a trait object: the client's types are deep,
/// and as a concrete type every caller's `Send` check would recurse through them.
trait Client: Send + Sync {
    /// Sends `message` back to `broker` with delay `level`.
    fn send_back(
        &self,
        message: MessageExt,
        level: i32,
        broker: String,
    ) -> BoxFuture<'static, rocketmq_client_rust::ClientResult<()>>;

    /// Shuts the consumer down.
    fn shut_down(&self) -> BoxFuture<'static, ()>;
}

impl Client for Arc<tokio::sync::Mutex<DefaultMQPushConsumer>> {
    fn send_back(
        &self,
        message: MessageExt,
        level: i32,
        broker: String,
    ) -> BoxFuture<'static, rocketmq_client_rust::ClientResult<()>> {
        let consumer = self.clone();
        Box::pin(
            async move { consumer.lock().await.send_message_back(message, level, &broker).await },
        )
    }

    fn shut_down(&self) -> BoxFuture<'static, ()> {
        let consumer = self.clone();
        Box::pin(async move { consumer.lock().await.shutdown().await })
    }
}

/// The started client consumer: shut down by [`Running::stop`], or in the background
/// when dropped.
struct Running {
    client: Arc<dyn Client>,
    stopped: bool,
}

impl Running {
    async fn stop(&mut self) {
        if !std::mem::replace(&mut self.stopped, true) {
            self.client.shut_down().await;
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if !self.stopped {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(self.client.shut_down());
            }
        }
    }
}
