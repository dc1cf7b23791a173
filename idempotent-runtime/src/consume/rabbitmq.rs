//! RabbitMQ queues, through `lapin`.

use std::future::Future;

use futures_util::StreamExt as _;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, ConfirmSelectOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, ExchangeKind};

use super::Answer;
use super::DEFAULT_CONCURRENCY;
use super::DEFAULT_GRACE;
use super::concurrent::{Stop, settle_concurrently};
use crate::delivery::with_delivery_count;
use crate::metrics::ConsumerMeter;
use crate::publish::rabbitmq::{confirmed, name, refused};
use crate::{Disposition, DispositionExt, Payload, PayloadRef};

/// One delivery from a queue.
#[derive(Debug, Clone)]
pub struct RabbitMessage {
    /// The body.
    pub body: Vec<u8>,
    /// The routing key it was published with.
    pub routing_key: String,
    /// Its `message_id` property, as
    /// [`RabbitPublisher`](crate::publish::rabbitmq::RabbitPublisher) sets it: for
    /// `key = "{message_id}"`. Empty when it has none, so a key using it is a key
    /// error.
    pub message_id: String,
    /// Whether the broker delivered it before.
    pub redelivered: bool,
    /// How many times the broker has delivered it, this time included: 1 for a
    /// first delivery, `x-delivery-count` plus one on a quorum queue, `None` for a
    /// redelivery from a classic queue (which does not count). The attempt of a
    /// handler on [`NoStore`](crate::NoStore).
    pub delivery_count: Option<u32>,
    /// Its properties and headers.
    pub properties: BasicProperties,
}

/// The body is the payload, for `{/json/pointer}` keys and `validate`.
impl Payload for RabbitMessage {
    fn payload(&self) -> PayloadRef<'_> {
        PayloadRef::Bytes(&self.body)
    }
}

/// Declares `queue` (durable) and the durable queue `{queue}.dead`, which it returns:
/// [`RabbitConsumer`] publishes its dead letters there. The queue also gets the
/// dead-letter exchange `{queue}.dlx`, routing to `{queue}.dead`, so that messages the
/// broker itself dead-letters (expired, over a length limit, rejected by other
/// consumers) end up there too.
pub async fn declare_with_dead_letter(channel: &Channel, queue: &str) -> lapin::Result<String> {
    let (exchange, dead) = (format!("{queue}.dlx"), format!("{queue}.dead"));
    let durable = QueueDeclareOptions { durable: true, ..Default::default() };
    channel
        .exchange_declare(
            name(&exchange)?,
            ExchangeKind::Fanout,
            ExchangeDeclareOptions { durable: true, ..Default::default() },
            FieldTable::default(),
        )
        .await?;
    channel.queue_declare(name(&dead)?, durable, FieldTable::default()).await?;
    let (bound, to, routing) = (name(&dead)?, name(&exchange)?, name("")?);
    channel
        .queue_bind(bound, to, routing, QueueBindOptions::default(), FieldTable::default())
        .await?;
    let mut arguments = FieldTable::default();
    arguments.insert("x-dead-letter-exchange".into(), AMQPValue::LongString(exchange.into()));
    channel.queue_declare(name(queue)?, durable, arguments).await?;
    Ok(dead)
}

/// A consumer on one queue with manual acknowledgements.
///
/// [`run`](RabbitConsumer::run) hands deliveries to a handler, up to
/// [`concurrency`](RabbitConsumer::concurrency) at once (default 32), and settles
/// each by its result's disposition as soon as its call returns
/// ([`next`](RabbitConsumer::next) does the same for one delivery):
///
/// * Ack → `basic.ack`.
/// * Retry → `basic.nack` with `requeue` once the result's
///   [`retry_delay`](DispositionExt::retry_delay) is over (the handler's `backoff`, or
///   the other claim's lease for `InProgress`; the consumer's
///   [`retry_delay`](RabbitConsumer::retry_delay) for results that don't say), at most
///   [`MAX_RETRY_HOLD`]. The delivery is held, unacked, by a task of its own, while the
///   consumer goes on with the next ones: it takes no `concurrency` slot, only a unit
///   of the channel's prefetch, so set the prefetch above `concurrency` to leave room
///   for deliveries waiting out their delay.
///
///   Held rather than republished to a delay queue: the broker keeps counting the
///   delivery (`x-delivery-count` on a quorum queue, which its `delivery-limit` and
///   [`NoStore`](crate::NoStore)'s attempts go by), nothing is added to the broker's
///   topology, and there is no window between publishing a delayed copy and acking
///   the original. A consumer that dies while holding a delivery loses nothing: the
///   broker redelivers it at once (earlier than its delay).
/// * DeadLetter → the consumer publishes a copy to the dead-letter queue itself
///   (default `{queue}.dead`; the body, properties and headers, plus
///   `x-idempotent-source-queue`), waits for the broker's publisher confirm, and
///   only then acks. A copy the broker refuses or cannot route is not acked: the
///   delivery is requeued and the error returned. The broker's own dead-lettering is
///   not used for this: with no dead-letter exchange configured a reject discards the
///   message, and classic queues dead-letter without confirms.
///
/// The channel is put in confirm mode, and [`new`](RabbitConsumer::new) checks that
/// the dead-letter queue exists ([`declare_with_dead_letter`] declares both), so a
/// missing one is an error at start-up, not a lost message. A settle the channel could
/// not send is an error, never reported as done. Unacked deliveries of a consumer
/// whose connection dies are redelivered by the broker.
///
/// Each delivery is acked on its own (`basic.ack` without `multiple`): a multiple ack
/// would also ack the deliveries of lower tags that are still being handled or held
/// for a retry, and tags are counted per channel, which other consumers may share. An
/// ack is a frame with no reply, so acking one by one costs no round trips.
///
/// ```no_run
/// # async fn demo() -> lapin::Result<()> {
/// use idempotent_runtime::consume::rabbitmq::{RabbitConsumer, RabbitMessage, declare_with_dead_letter};
/// use idempotent_runtime::{Error, Outcome};
/// use lapin::{Connection, ConnectionProperties};
///
/// async fn handle(msg: RabbitMessage) -> Result<Outcome<()>, Error<std::io::Error>> {
///     // an #[idempotent] function
///     # let _ = msg; Ok(Outcome::Processed(()))
/// }
///
/// let url = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// let connection = Connection::connect(url, ConnectionProperties::default()).await?;
/// let channel = connection.create_channel().await?;
/// declare_with_dead_letter(&channel, "orders").await?;
/// channel.basic_qos(64, Default::default()).await?;
/// let consumer = RabbitConsumer::new(&channel, "orders", "billing-1").await?.concurrency(32);
/// consumer.run(handle).await?;
/// # Ok(()) }
/// ```
pub struct RabbitConsumer {
    consumer: lapin::Consumer,
    channel: Channel,
    queue: String,
    dead_letter: String,
    retry_delay: std::time::Duration,
    concurrency: usize,
    grace: std::time::Duration,
    /// Set once [`run_until`](RabbitConsumer::run_until)'s shutdown cancelled the
    /// consumer: the broker sends it nothing more.
    cancelled: std::sync::atomic::AtomicBool,
}

impl RabbitConsumer {
    /// Starts consuming `queue` as `tag`, with manual acks, dead-lettering to
    /// `{queue}.dead`, which must exist. Set the channel's prefetch (`basic_qos`) to
    /// bound how many unacked deliveries it holds.
    pub async fn new(channel: &Channel, queue: &str, tag: &str) -> lapin::Result<RabbitConsumer> {
        RabbitConsumer::with_dead_letter_queue(channel, queue, tag, &format!("{queue}.dead")).await
    }

    /// As [`new`](RabbitConsumer::new), dead-lettering to `dead_letter`, which must
    /// exist (a missing queue is an error here, and the broker closes the channel).
    pub async fn with_dead_letter_queue(
        channel: &Channel,
        queue: &str,
        tag: &str,
        dead_letter: &str,
    ) -> lapin::Result<RabbitConsumer> {
        let passive = QueueDeclareOptions { passive: true, ..Default::default() };
        channel.queue_declare(name(dead_letter)?, passive, FieldTable::default()).await?;
        channel.confirm_select(ConfirmSelectOptions::default()).await?;
        let options = BasicConsumeOptions { no_ack: false, ..Default::default() };
        let consumer =
            channel.basic_consume(name(queue)?, name(tag)?, options, FieldTable::default()).await?;
        Ok(RabbitConsumer {
            consumer,
            channel: channel.clone(),
            queue: queue.to_owned(),
            dead_letter: dead_letter.to_owned(),
            retry_delay: std::time::Duration::from_secs(1),
            concurrency: DEFAULT_CONCURRENCY,
            grace: DEFAULT_GRACE,
            cancelled: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// How long to hold a delivery left for retry before requeueing it, when its
    /// handler's result does not say ([`DispositionExt::retry_delay`] is `None`);
    /// default 1 s. Also how long a delivery met `InProgress` waits for the calls
    /// beside it (see [`run`](RabbitConsumer::run)).
    pub fn retry_delay(mut self, delay: std::time::Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// How many deliveries [`run`](RabbitConsumer::run) handles at once; default
    /// [`DEFAULT_CONCURRENCY`] (32). The channel's prefetch (`basic_qos`) should be at
    /// least this, or the broker hands out fewer.
    pub fn concurrency(mut self, in_flight: usize) -> Self {
        self.concurrency = in_flight.max(1);
        self
    }

    /// Handles deliveries until the consumer is cancelled or its channel closes (then
    /// `Ok`), or a delivery or a settle fails (then that error): up to
    /// [`concurrency`](RabbitConsumer::concurrency) handler calls at once, each
    /// delivery settled by its own result as soon as its call returns, as
    /// [`next`](RabbitConsumer::next) settles one. A delivery whose call answered
    /// `InProgress` while other calls ran is handled once more after them (it may have
    /// met a delivery of the same key here), if they return within the retry delay;
    /// otherwise it is settled by its first answer. After an error the calls in flight
    /// still return and are settled before `run` answers it. Deliveries in hand when
    /// the future is dropped, or waiting for a second call when it fails, are requeued.
    ///
    /// The deliveries are read in the broker's order but handled side by side: where
    /// their order matters, use `concurrency(1)`.
    pub async fn run<F, Fut, R>(&self, handler: F) -> lapin::Result<()>
    where
        F: FnMut(RabbitMessage) -> Fut,
        Fut: Future<Output = R>,
        R: DispositionExt,
    {
        self.run_until(handler, std::future::pending()).await
    }

    /// As [`run`](RabbitConsumer::run), until `shutdown` resolves (a signal, a
    /// deploy's stop): then no more deliveries are taken, those in hand finish and are
    /// settled, the consumer is cancelled (`basic.cancel`: the broker sends no more),
    /// the deliveries the channel had prefetched are requeued at once, and `run_until`
    /// answers `Ok`. Deliveries still in hand
    /// [`shutdown_grace`](RabbitConsumer::shutdown_grace) after the shutdown are
    /// dropped then (their claims released, their deliveries requeued). The consumer
    /// is done then: `run` and `run_until` answer `Ok` at once; make a new one to
    /// consume again.
    ///
    /// The cancel deletes an `auto_delete` queue (its last consumer gone), with the
    /// messages it holds, as closing the channel would. The requeue counts as a
    /// delivery on quorum queues (`x-delivery-count`), so each stop uses one attempt
    /// of up to prefetch − concurrency messages: a prefetch equal to `concurrency`
    /// keeps the count exact.
    ///
    /// ```no_run
    /// # use idempotent_runtime::consume::rabbitmq::{RabbitConsumer, RabbitMessage};
    /// # use idempotent_runtime::{Error, Outcome};
    /// # async fn handle(_: RabbitMessage) -> Result<Outcome<()>, Error<std::io::Error>> {
    /// #     Ok(Outcome::Processed(()))
    /// # }
    /// # async fn demo(consumer: RabbitConsumer) -> lapin::Result<()> {
    /// consumer.run_until(handle, async { tokio::signal::ctrl_c().await.ok(); }).await?;
    /// # Ok(()) }
    /// ```
    pub async fn run_until<F, Fut, R>(
        &self,
        mut handler: F,
        shutdown: impl Future<Output = ()>,
    ) -> lapin::Result<()>
    where
        F: FnMut(RabbitMessage) -> Fut,
        Fut: Future<Output = R>,
        R: DispositionExt,
    {
        if self.cancelled.load(std::sync::atomic::Ordering::SeqCst) {
            return Ok(());
        }
        let deliveries = self.consumer.clone().map(|delivery| delivery.map(Held::new));
        let meter = ConsumerMeter::new("rabbitmq", &self.queue);
        let (stopped_tx, stopped) = tokio::sync::oneshot::channel::<()>();
        let signal = async move {
            shutdown.await;
            let _ = stopped_tx.send(());
        };
        let ran = settle_concurrently(
            deliveries,
            self.concurrency,
            self.retry_delay,
            &meter,
            Stop { signal, grace: self.grace },
            |_| None,
            |held: &Held| {
                with_delivery_count(held.message.delivery_count, handler(held.message.clone()))
            },
            |held, answer| self.settle(held, answer),
        )
        .await;
        if stopped.await.is_ok() {
            self.requeue_prefetched(&meter).await;
        }
        ran
    }

    /// How long the calls in flight have to finish after [`run_until`]'s shutdown;
    /// default 30 s. Keep it under what the deploy waits before it kills the process.
    ///
    /// [`run_until`]: RabbitConsumer::run_until
    pub fn shutdown_grace(mut self, grace: std::time::Duration) -> Self {
        self.grace = grace;
        self
    }

    /// After a shutdown: cancels the consumer, so the broker sends no more, and
    /// requeues the deliveries it had sent before the cancel (up to the prefetch),
    /// which would otherwise stay unacked until the channel closes.
    async fn requeue_prefetched(&self, meter: &ConsumerMeter) {
        self.cancelled.store(true, std::sync::atomic::Ordering::SeqCst);
        let cancel = self.channel.basic_cancel(self.consumer.tag(), Default::default()).await;
        if let Err(error) = cancel {
            tracing::warn!(%error, "cancelling the consumer at shutdown failed");
            return;
        }
        // The consumer's stream ends once the broker confirmed the cancel; what it
        // yields before that was sent earlier. Bounded, should the end not come.
        let mut rest = self.consumer.clone();
        let drain = async {
            while let Some(Ok(delivery)) = rest.next().await {
                meter.let_go(1);
                drop(Held::new(delivery));
            }
        };
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), drain).await;
    }

    /// Waits for the next delivery, runs `handler` on it and settles it (a Retry's
    /// requeue happens after its retry delay, in the background). `None` when the
    /// consumer was cancelled or its channel closed. One delivery at a time; see
    /// [`run`](RabbitConsumer::run) for many.
    pub async fn next<F, Fut, R>(&mut self, handler: F) -> Option<lapin::Result<Disposition>>
    where
        F: FnOnce(RabbitMessage) -> Fut,
        Fut: Future<Output = R>,
        R: DispositionExt,
    {
        let held = match self.consumer.next().await? {
            Ok(delivery) => Held::new(delivery),
            Err(e) => return Some(Err(e)),
        };
        let meter = ConsumerMeter::new("rabbitmq", &self.queue);
        meter.taken(1);
        let call = handler(held.message.clone());
        let answer = Answer::of(&with_delivery_count(held.message.delivery_count, call).await);
        let settled = self.settle(held, answer).await.map(|()| answer.disposition);
        if settled.is_ok() {
            meter.settled(answer.disposition);
        }
        Some(settled)
    }

    async fn settle(&self, mut held: Held, answer: Answer) -> lapin::Result<()> {
        let acker = held.acker.clone();
        let settled = match answer.disposition {
            Disposition::Ack => sent(acker.ack(BasicAckOptions::default()).await),
            Disposition::Retry => {
                requeue_later(acker, answer.delay_or(self.retry_delay).min(MAX_RETRY_HOLD));
                Ok(())
            }
            Disposition::DeadLetter => match self.publish_dead_letter(&held.message).await {
                Ok(()) => sent(acker.ack(BasicAckOptions::default()).await),
                Err(error) => {
                    let requeue = BasicNackOptions { multiple: false, requeue: true };
                    let _ = acker.nack(requeue).await;
                    Err(error)
                }
            },
        };
        held.unsettled.0 = None;
        settled
    }

    /// Publishes `message` to the dead-letter queue and waits for the broker to
    /// confirm it was stored; refused or unroutable is an error.
    async fn publish_dead_letter(&self, message: &RabbitMessage) -> lapin::Result<()> {
        // Without the broker's delivery count: a replayed dead letter starts again.
        let mut headers =
            message.properties.headers().as_ref().map_or_else(Default::default, |h| {
                let mut kept = h.inner().clone();
                kept.remove("x-delivery-count");
                FieldTable::from(kept)
            });
        headers.insert(
            "x-idempotent-source-queue".into(),
            AMQPValue::LongString(self.queue.clone().into()),
        );
        headers.insert(
            "x-idempotent-source-routing-key".into(),
            AMQPValue::LongString(message.routing_key.clone().into()),
        );
        let properties = dead_letter_properties(&message.properties, headers);
        let destination = format!("the dead-letter queue `{}`", self.dead_letter);
        confirmed(&self.channel, "", &self.dead_letter, &message.body, properties, &destination)
            .await
    }
}

/// The delivery's properties for its dead-letter copy: persistent, without the
/// `expiration` (a per-message TTL would let the copy expire in the dead-letter queue
/// after the original was acked) and without the `user_id` (the broker refuses one
/// that is not the publishing connection's user), with `headers`.
fn dead_letter_properties(original: &BasicProperties, headers: FieldTable) -> BasicProperties {
    let mut copy = BasicProperties::default().with_headers(headers).with_delivery_mode(2);
    let text = |value: &Option<lapin::types::ShortString>| value.clone();
    if let Some(v) = text(original.content_type()) {
        copy = copy.with_content_type(v);
    }
    if let Some(v) = text(original.content_encoding()) {
        copy = copy.with_content_encoding(v);
    }
    if let Some(v) = *original.priority() {
        copy = copy.with_priority(v);
    }
    if let Some(v) = text(original.correlation_id()) {
        copy = copy.with_correlation_id(v);
    }
    if let Some(v) = text(original.reply_to()) {
        copy = copy.with_reply_to(v);
    }
    if let Some(v) = text(original.message_id()) {
        copy = copy.with_message_id(v);
    }
    if let Some(v) = *original.timestamp() {
        copy = copy.with_timestamp(v);
    }
    if let Some(v) = text(original.kind()) {
        copy = copy.with_type(v);
    }
    if let Some(v) = text(original.app_id()) {
        copy = copy.with_app_id(v);
    }
    if let Some(v) = text(original.cluster_id()) {
        copy = copy.with_cluster_id(v);
    }
    copy
}

/// The longest a delivery left for retry is held before it is requeued: 15 minutes.
/// A longer delay is cut to this, because RabbitMQ closes a channel that holds a
/// delivery unacked past its `consumer_timeout` (30 minutes by default), and every
/// delivery of that channel comes back at once.
pub const MAX_RETRY_HOLD: std::time::Duration = std::time::Duration::from_secs(15 * 60);

/// A delivery in hand: the message (handed to the handler as a copy, and kept for a
/// dead-letter copy) and its acker.
struct Held {
    message: RabbitMessage,
    acker: lapin::Acker,
    // Until it is settled, a dropped call (a timeout, a `select!`) requeues the
    // delivery instead of leaving it unacked on a channel that stays open.
    unsettled: Unsettled,
}

impl Held {
    fn new(delivery: lapin::message::Delivery) -> Held {
        Held {
            unsettled: Unsettled(Some(delivery.acker.clone())),
            acker: delivery.acker,
            message: RabbitMessage {
                body: delivery.data,
                routing_key: delivery.routing_key.to_string(),
                message_id: (delivery.properties.message_id().as_ref())
                    .map_or_else(String::new, ToString::to_string),
                redelivered: delivery.redelivered,
                delivery_count: delivery_count(delivery.redelivered, &delivery.properties),
                properties: delivery.properties,
            },
        }
    }
}

/// The delivery's count: a first delivery is 1 anywhere; quorum queues count earlier
/// deliveries of a redelivered one in `x-delivery-count`; a classic queue's
/// redelivery is not counted.
fn delivery_count(redelivered: bool, properties: &BasicProperties) -> Option<u32> {
    // A first delivery is 1 whatever its headers say: a producer may have set
    // `x-delivery-count`, or copied it from a dead letter it replays.
    if !redelivered {
        return Some(1);
    }
    let earlier = properties.headers().as_ref().and_then(|h| h.inner().get("x-delivery-count"));
    let earlier = match earlier {
        Some(AMQPValue::LongLongInt(n)) => u32::try_from(*n).ok(),
        Some(AMQPValue::LongInt(n)) => u32::try_from(*n).ok(),
        Some(AMQPValue::LongUInt(n)) => Some(*n),
        Some(AMQPValue::ShortInt(n)) => u32::try_from(*n).ok(),
        Some(AMQPValue::ShortUInt(n)) => Some(u32::from(*n)),
        Some(AMQPValue::ShortShortInt(n)) => u32::try_from(*n).ok(),
        Some(AMQPValue::ShortShortUInt(n)) => Some(u32::from(*n)),
        _ => None,
    };
    earlier.and_then(|n| n.checked_add(1))
}

/// A delivery handed to a handler and not settled yet; dropped unsettled, it is
/// requeued from a task of its own.
struct Unsettled(Option<lapin::Acker>);

impl Drop for Unsettled {
    fn drop(&mut self) {
        if let Some(acker) = self.0.take() {
            requeue_later(acker, std::time::Duration::ZERO);
        }
    }
}

/// Requeues a delivery after `delay`, from a task of its own on the current Tokio
/// runtime. Without a runtime, or if the nack fails, the broker redelivers it when
/// the channel closes.
fn requeue_later(acker: lapin::Acker, delay: std::time::Duration) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
    runtime.spawn(async move {
        tokio::time::sleep(delay).await;
        let requeue = BasicNackOptions { multiple: false, requeue: true };
        if let Err(error) = sent(acker.nack(requeue).await) {
            tracing::warn!(%error, "requeueing a delivery failed; the broker redelivers it when the channel closes");
        }
    });
}

/// A settle lapin reports as not sent (`Ok(false)`) is an error, not a success.
fn sent(result: lapin::Result<bool>) -> lapin::Result<()> {
    match result {
        Ok(true) => Ok(()),
        Ok(false) => Err(refused(
            "the settle was not sent: the delivery was already settled or the channel is closing"
                .to_owned(),
        )),
        Err(error) => Err(error),
    }
}
