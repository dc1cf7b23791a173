//! Publishing to NATS JetStream with `Nats-Msg-Id`, so the server stores a resent
//! message once.

use async_nats::HeaderMap;
use async_nats::jetstream::{self, context::PublishErrorKind};
use bytes::Bytes;

use crate::consume::nats::NatsError;

/// The header JetStream deduplicates on.
pub const MESSAGE_ID_HEADER: &str = "Nats-Msg-Id";

/// Publishes with a `Nats-Msg-Id` on every message and waits for JetStream's ack. A
/// publish whose ack does not come (a timeout, a lost connection) is sent again with
/// the same id, up to [`attempts`](NatsPublisher::attempts) times: within the
/// stream's duplicate window (`duplicate_window`, 2 minutes by default) the server
/// stores it once and answers the resend as a duplicate.
///
/// ```no_run
/// # async fn demo(client: async_nats::Client) -> Result<(), async_nats::Error> {
/// use idempotent_runtime::publish::nats::NatsPublisher;
///
/// let publisher = NatsPublisher::new(async_nats::jetstream::new(client));
/// let sent = publisher.publish("orders.placed", r#"{"order_id":42}"#.into(), None).await?;
/// assert!(!sent.duplicate, "stored once, at sequence {}", sent.sequence);
/// # Ok(()) }
/// ```
pub struct NatsPublisher {
    jetstream: jetstream::Context,
    attempts: u32,
}

/// What JetStream answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// The message's id.
    pub id: String,
    /// The stream that stored it.
    pub stream: String,
    /// Its sequence in that stream (the first copy's, for a duplicate).
    pub sequence: u64,
    /// Whether the server already had a message with this id and stored nothing.
    pub duplicate: bool,
}

impl NatsPublisher {
    /// Publishes through `jetstream`, sending a publish up to 3 times.
    pub fn new(jetstream: jetstream::Context) -> NatsPublisher {
        NatsPublisher { jetstream, attempts: 3 }
    }

    /// How many times a publish is sent before its error is returned; default 3, at
    /// least 1.
    pub fn attempts(mut self, attempts: u32) -> Self {
        self.attempts = attempts.max(1);
        self
    }

    /// Publishes `payload` to `subject` with `headers`, adding `Nats-Msg-Id` (a fresh
    /// [`message_id`](super::message_id)) unless the headers carry one, and waits for
    /// JetStream to store it. A timeout or a lost connection sends it again, with the
    /// same id; any other error (no stream for the subject, a payload over
    /// `max_payload`) is returned at once.
    pub async fn publish(
        &self,
        subject: impl Into<String>,
        payload: Bytes,
        headers: Option<HeaderMap>,
    ) -> Result<Published, NatsError> {
        let subject = subject.into();
        let mut headers = headers.unwrap_or_default();
        let id = match headers.get(MESSAGE_ID_HEADER) {
            Some(id) => id.as_str().to_owned(),
            None => {
                let id = super::message_id();
                headers.insert(MESSAGE_ID_HEADER, id.as_str());
                id
            }
        };
        let mut attempt = 1;
        loop {
            let sent = async {
                let ack = self.jetstream.publish_with_headers(
                    subject.clone(),
                    headers.clone(),
                    payload.clone(),
                );
                ack.await?.await
            };
            match sent.await {
                Ok(ack) => {
                    return Ok(Published {
                        id,
                        stream: ack.stream,
                        sequence: ack.sequence,
                        duplicate: ack.duplicate,
                    });
                }
                Err(error)
                    if attempt < self.attempts
                        && matches!(
                            error.kind(),
                            PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe
                        ) =>
                {
                    tracing::warn!(%error, id, attempt, "publishing got no ack; sending it again with the same id");
                    attempt += 1;
                }
                Err(error) => return Err(error.into()),
            }
        }
    }
}
