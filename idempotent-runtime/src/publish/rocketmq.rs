//! Publishing to RocketMQ with business keys, waiting for the broker to store each
//! message.

use std::time::Duration;

use rocketmq_client_rust::DefaultMQProducer;
use rocketmq_model::common::message::message_builder::MessageBuilder;
use rocketmq_runtime::BlockingPoolPolicy;

use crate::consume::rocketmq::{RocketMqError, client_config, client_runtime};

/// A started RocketMQ producer. Every message carries a unique id (`UNIQ_KEY`, which
/// the client sets once per message and keeps across its own retries of the send)
/// and, where given, business keys (`KEYS`): the consumer's
/// [`RocketMqMessage`](crate::consume::rocketmq::RocketMqMessage) has both. RocketMQ
/// itself does not deduplicate: a message the application sends again (after a
/// timeout, say) is stored twice, with a new id, so consumers should key on the
/// business keys.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use idempotent_runtime::publish::rocketmq::RocketMqPublisher;
///
/// let publisher = RocketMqPublisher::start("127.0.0.1:9876", "orders-producer").await?;
/// let sent = publisher.publish("orders", "order-42", br#"{"order_id":42}"#).await?;
/// assert!(!sent.message_id.is_empty());
/// publisher.shutdown().await;
/// # Ok(()) }
/// ```
pub struct RocketMqPublisher {
    producer: DefaultMQProducer,
}

/// What the broker answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// The message's unique id (`UNIQ_KEY`).
    pub message_id: String,
    /// Its offset in the queue that stored it.
    pub queue_offset: u64,
}

impl RocketMqPublisher {
    /// Starts a producer of group `group` on the cluster whose name server is at
    /// `name_server` (`host:port`, several separated by `;`).
    pub async fn start(
        name_server: impl AsRef<str>,
        group: impl AsRef<str>,
    ) -> Result<RocketMqPublisher, RocketMqError> {
        let runtime = client_runtime(BlockingPoolPolicy::default())?;
        let mut producer = DefaultMQProducer::builder(runtime)
            .client_config(client_config(name_server.as_ref(), Duration::from_secs(30)))
            .producer_group(group.as_ref())
            .build();
        producer.start().await?;
        Ok(RocketMqPublisher { producer })
    }

    /// Sends `body` to `topic` with business keys `keys` (several separated by spaces;
    /// empty for none) and waits for the broker to store it.
    pub async fn publish(
        &self,
        topic: &str,
        keys: &str,
        body: &[u8],
    ) -> Result<Published, RocketMqError> {
        let mut message = MessageBuilder::new().topic(topic).body_slice(body);
        if !keys.is_empty() {
            message = message.key(keys);
        }
        let sent = self.producer.send(message.build()?).await?;
        let sent = sent.ok_or("the broker answered the send with nothing")?;
        Ok(Published {
            message_id: sent.msg_id.map_or_else(String::new, |id| id.to_string()),
            queue_offset: sent.queue_offset,
        })
    }

    /// Stops the producer.
    pub async fn shutdown(mut self) {
        self.producer.shutdown().await;
    }
}
