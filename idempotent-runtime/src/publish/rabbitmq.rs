//! Publishing to RabbitMQ with a message id, waiting for the broker's confirm.

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::ShortString;
use lapin::{BasicProperties, Channel, Confirmation};

/// Publishes with publisher confirms: a publish answers once the broker has stored
/// the message (for a durable queue and a persistent message: on disk), and a message
/// the broker refuses or no queue takes is an error, never silently dropped.
///
/// RabbitMQ keeps no record of message ids: a publish sent again after its confirm
/// was lost (a dropped connection) stores a second copy. Send it again with the same
/// id (`properties.with_message_id(id)`) and key the consumer's handler on
/// `{message_id}`: the second copy is then a duplicate.
///
/// ```no_run
/// # async fn demo(channel: lapin::Channel) -> lapin::Result<()> {
/// use idempotent_runtime::publish::rabbitmq::RabbitPublisher;
///
/// let publisher = RabbitPublisher::new(&channel).await?;
/// let id = publisher.publish("", "orders", br#"{"order_id":42}"#, Default::default()).await?;
/// assert!(!id.is_empty(), "stored under its message id");
/// # Ok(()) }
/// ```
pub struct RabbitPublisher {
    channel: Channel,
}

impl RabbitPublisher {
    /// Publishes on `channel`, which it puts in confirm mode.
    pub async fn new(channel: &Channel) -> lapin::Result<RabbitPublisher> {
        channel.confirm_select(ConfirmSelectOptions::default()).await?;
        Ok(RabbitPublisher { channel: channel.clone() })
    }

    /// Publishes `body` to `exchange` (`""`: the default exchange, routing to the
    /// queue named `routing_key`) as a persistent message, with `properties`'
    /// `message_id` or a fresh one ([`message_id`](super::message_id)), and waits for
    /// the broker's confirm. Answers the id. A message the broker refuses (a nack) or
    /// cannot route to any queue (published `mandatory`) is an error.
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> lapin::Result<String> {
        let id = match properties.message_id() {
            Some(id) => id.to_string(),
            None => super::message_id(),
        };
        let properties = properties.with_message_id(id.clone().into()).with_delivery_mode(2);
        let destination = format!("exchange `{exchange}`, routing key `{routing_key}`");
        confirmed(&self.channel, exchange, routing_key, body, properties, &destination).await?;
        Ok(id)
    }
}

/// Publishes `mandatory` on a channel in confirm mode and waits for the broker to
/// store the message; refused, unroutable or unconfirmed is an error naming
/// `destination`.
pub(crate) async fn confirmed(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    properties: BasicProperties,
    destination: &str,
) -> lapin::Result<()> {
    let options = BasicPublishOptions { mandatory: true, immediate: false };
    let sent =
        channel.basic_publish(name(exchange)?, name(routing_key)?, options, body, properties);
    match sent.await?.await? {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(_)) => {
            Err(refused(format!("no queue took the message published to {destination}")))
        }
        Confirmation::Nack(_) => {
            Err(refused(format!("the broker refused the message published to {destination}")))
        }
        Confirmation::NotRequested => Err(refused(format!(
            "the channel is not in confirm mode, so the message published to {destination} is \
             unconfirmed"
        ))),
    }
}

/// An AMQP name (at most 255 bytes); a longer one is an error, not a panic.
pub(crate) fn name(name: &str) -> lapin::Result<ShortString> {
    ShortString::try_new(name).map_err(|_| {
        lapin::Error::from(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("AMQP names are at most 255 bytes; this one has {}", name.len()),
        ))
    })
}

/// An error of our own, as lapin reports errors.
pub(crate) fn refused(why: String) -> lapin::Error {
    lapin::Error::from(std::io::Error::other(why))
}
