//! NATS JetStream pull consumers, through `async-nats`.

use std::future::Future;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::pull::Stream as Messages;
use async_nats::jetstream::{self, AckKind};
use bytes::Bytes;
use futures_util::StreamExt as _;

use crate::{Disposition, DispositionExt, Payload, PayloadRef};

/// What can go wrong while consuming: the stream of messages, an acknowledgement, or
/// publishing to the dead-letter subject.
pub type NatsError = Box<dyn std::error::Error + Send + Sync>;

/// One message from a JetStream consumer.
#[derive(Debug, Clone)]
pub struct NatsMessage {
    /// The subject it was published to.
    pub subject: String,
    /// The body.
    pub payload: Bytes,
    /// Its headers.
    pub headers: Option<HeaderMap>,
}

/// The body is the payload, for `{/json/pointer}` keys and `validate`.
impl Payload for NatsMessage {
    fn payload(&self) -> PayloadRef<'_> {
        PayloadRef::Bytes(&self.payload)
    }
}

/// A JetStream pull consumer that settles each message by its handler's disposition:
/// Ack → `+ACK`; Retry → `-NAK` with a delay (default 1 s), so the server redelivers
/// it after the delay; DeadLetter → publish the body (with its headers) to the
/// dead-letter subject, if one is set, then `+TERM` so the server never redelivers it.
/// A consumer that dies without acking has its messages redelivered after the
/// consumer's `ack_wait`.
///
/// ```no_run
/// # async fn demo(client: async_nats::Client) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use async_nats::jetstream::{self, consumer::pull};
/// use idempotent_runtime::consume::nats::{NatsConsumer, NatsMessage};
/// use idempotent_runtime::{Error, Outcome};
///
/// async fn handle(msg: NatsMessage) -> Result<Outcome<()>, Error<std::io::Error>> {
///     // an #[idempotent] function
///     # let _ = msg; Ok(Outcome::Processed(()))
/// }
///
/// let js = jetstream::new(client);
/// let stream = js.get_stream("ORDERS").await?;
/// let durable = pull::Config { durable_name: Some("billing".into()), ..Default::default() };
/// let pull = stream.get_or_create_consumer("billing", durable).await?;
/// let mut consumer = NatsConsumer::new(&pull, js).await?.dead_letter_subject("orders.dead");
/// while let Some(settled) = consumer.next(handle).await {
///     settled?;
/// }
/// # Ok(()) }
/// ```
pub struct NatsConsumer {
    messages: Messages,
    jetstream: jetstream::Context,
    dead_letter: Option<String>,
    retry_delay: Duration,
}

impl NatsConsumer {
    /// Pulls from `consumer`; `jetstream` publishes dead letters.
    pub async fn new(
        consumer: &jetstream::consumer::PullConsumer,
        jetstream: jetstream::Context,
    ) -> Result<NatsConsumer, NatsError> {
        let messages = consumer.messages().await?;
        Ok(NatsConsumer {
            messages,
            jetstream,
            dead_letter: None,
            retry_delay: Duration::from_secs(1),
        })
    }

    /// Publishes dead-lettered messages to `subject` (a stream should capture it)
    /// before terminating them.
    pub fn dead_letter_subject(mut self, subject: impl Into<String>) -> Self {
        self.dead_letter = Some(subject.into());
        self
    }

    /// How long the server waits before redelivering a message left for retry.
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// Waits for the next message, runs `handler` on it and settles it. `None` when
    /// the subscription ended.
    pub async fn next<F, Fut, R>(&mut self, handler: F) -> Option<Result<Disposition, NatsError>>
    where
        F: FnOnce(NatsMessage) -> Fut,
        Fut: Future<Output = R>,
        R: DispositionExt,
    {
        let message = match self.messages.next().await? {
            Ok(message) => message,
            Err(e) => return Some(Err(e.into())),
        };
        let (message, acker) = message.split();
        let message = NatsMessage {
            subject: message.subject.to_string(),
            payload: message.payload,
            headers: message.headers,
        };
        let dead_copy = self.dead_letter.as_ref().map(|_| message.clone());
        let disposition = handler(message).await.disposition();
        let settled: Result<(), NatsError> = async {
            match disposition {
                Disposition::Ack => acker.ack().await?,
                Disposition::Retry => acker.ack_with(AckKind::Nak(Some(self.retry_delay))).await?,
                Disposition::DeadLetter => {
                    if let (Some(subject), Some(copy)) = (&self.dead_letter, dead_copy) {
                        let headers = dead_letter_headers(copy.headers.as_ref());
                        let publish = self
                            .jetstream
                            .publish_with_headers(subject.clone(), headers, copy.payload)
                            .await?;
                        publish.await?;
                    }
                    acker.ack_with(AckKind::Term).await?
                }
            }
            Ok(())
        }
        .await;
        Some(settled.map(|()| disposition))
    }
}

/// The original's headers without the `Nats-*` ones: those are JetStream controls
/// (expected sequence, rollup, message id) that would make the dead-letter publish
/// fail or purge earlier dead letters.
fn dead_letter_headers(original: Option<&HeaderMap>) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, values) in original.into_iter().flat_map(HeaderMap::iter) {
        let name: &str = name.as_ref();
        if !name.to_ascii_lowercase().starts_with("nats-") {
            for value in values {
                headers.append(name, value.as_str());
            }
        }
    }
    headers
}
