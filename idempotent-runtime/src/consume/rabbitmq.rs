//! RabbitMQ queues, through `lapin`.

use std::future::Future;

use futures_util::StreamExt as _;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicRejectOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, ExchangeKind};

use crate::{Disposition, DispositionExt, Payload, PayloadRef};

/// One delivery from a queue.
#[derive(Debug, Clone)]
pub struct RabbitMessage {
    /// The body.
    pub body: Vec<u8>,
    /// The routing key it was published with.
    pub routing_key: String,
    /// Whether the broker delivered it before.
    pub redelivered: bool,
    /// Its properties and headers.
    pub properties: BasicProperties,
}

/// The body is the payload, for `{/json/pointer}` keys and `validate`.
impl Payload for RabbitMessage {
    fn payload(&self) -> PayloadRef<'_> {
        PayloadRef::Bytes(&self.body)
    }
}

/// Declares `queue` (durable) with a dead-letter exchange `{queue}.dlx` routing to the
/// durable queue `{queue}.dead`, which it returns: what [`RabbitConsumer`] rejects
/// ends up there.
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

/// An AMQP name (at most 255 bytes); a longer one is an error, not a panic.
fn name(name: &str) -> lapin::Result<lapin::types::ShortString> {
    lapin::types::ShortString::try_new(name).map_err(|_| {
        lapin::Error::from(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("AMQP names are at most 255 bytes; this one has {}", name.len()),
        ))
    })
}

/// A consumer on one queue with manual acknowledgements.
///
/// [`next`](RabbitConsumer::next) hands the next delivery to a handler and settles it
/// by the result's disposition: Ack → `basic.ack`; Retry → wait the retry delay
/// (default 1 s), then `basic.nack` with `requeue` (so a short outage does not burn
/// every attempt at once, and a duplicate in progress elsewhere does not spin);
/// DeadLetter → `basic.reject` without requeue, which the queue's dead-letter exchange
/// routes on (see [`declare_with_dead_letter`]). Unacked deliveries of a consumer whose
/// connection dies are redelivered by the broker.
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
/// let mut consumer = RabbitConsumer::new(&channel, "orders", "billing-1").await?;
/// while let Some(settled) = consumer.next(handle).await {
///     settled?;
/// }
/// # Ok(()) }
/// ```
pub struct RabbitConsumer {
    consumer: lapin::Consumer,
    retry_delay: std::time::Duration,
}

impl RabbitConsumer {
    /// Starts consuming `queue` as `tag`, with manual acks. Set the channel's
    /// prefetch (`basic_qos`) to bound how many unacked deliveries it holds.
    pub async fn new(channel: &Channel, queue: &str, tag: &str) -> lapin::Result<RabbitConsumer> {
        let options = BasicConsumeOptions { no_ack: false, ..Default::default() };
        let consumer =
            channel.basic_consume(name(queue)?, name(tag)?, options, FieldTable::default()).await?;
        Ok(RabbitConsumer { consumer, retry_delay: std::time::Duration::from_secs(1) })
    }

    /// How long to hold a delivery left for retry before requeueing it; default 1 s.
    pub fn retry_delay(mut self, delay: std::time::Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// Waits for the next delivery, runs `handler` on it and settles it. `None` when
    /// the consumer was cancelled or its channel closed.
    pub async fn next<F, Fut, R>(&mut self, handler: F) -> Option<lapin::Result<Disposition>>
    where
        F: FnOnce(RabbitMessage) -> Fut,
        Fut: Future<Output = R>,
        R: DispositionExt,
    {
        let delivery = match self.consumer.next().await? {
            Ok(delivery) => delivery,
            Err(e) => return Some(Err(e)),
        };
        let acker = delivery.acker.clone();
        let message = RabbitMessage {
            body: delivery.data,
            routing_key: delivery.routing_key.to_string(),
            redelivered: delivery.redelivered,
            properties: delivery.properties,
        };
        let disposition = handler(message).await.disposition();
        let settled = match disposition {
            Disposition::Ack => acker.ack(BasicAckOptions::default()).await,
            Disposition::Retry => {
                tokio::time::sleep(self.retry_delay).await;
                acker.nack(BasicNackOptions { multiple: false, requeue: true }).await
            }
            Disposition::DeadLetter => acker.reject(BasicRejectOptions { requeue: false }).await,
        };
        Some(settled.map(|_| disposition))
    }
}
