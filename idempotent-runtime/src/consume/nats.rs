//! NATS JetStream pull consumers, through `async-nats`.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::AckPolicy;
use async_nats::jetstream::consumer::pull::Stream as Messages;
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::Acker;
use async_nats::jetstream::{self, AckKind};
use bytes::Bytes;
use futures_util::StreamExt as _;

use super::Answer;
use super::DEFAULT_CONCURRENCY;
use super::DEFAULT_GRACE;
use super::concurrent::{Stop, settle_concurrently};
use crate::delivery::with_delivery_count;
use crate::execute::Spec;
use crate::metrics::ConsumerMeter;
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
    /// Its `Nats-Msg-Id` header, as
    /// [`NatsPublisher`](crate::publish::nats::NatsPublisher) sets it: for
    /// `key = "{message_id}"`. Empty when it has none, so a key using it is a key
    /// error.
    pub message_id: String,
    /// How many times the server has delivered it, this time included (the reply
    /// subject's count); the attempt of a handler on [`NoStore`](crate::NoStore).
    pub delivery_count: Option<u32>,
}

/// The body is the payload, for `{/json/pointer}` keys and `validate`.
impl Payload for NatsMessage {
    fn payload(&self) -> PayloadRef<'_> {
        PayloadRef::Bytes(&self.payload)
    }
}

/// A JetStream pull consumer that settles each message by its handler's disposition,
/// up to [`concurrency`](NatsConsumer::concurrency) at once (default 32) through
/// [`run`](NatsConsumer::run), one at a time through [`next`](NatsConsumer::next):
/// Ack → `+ACK`; Retry → `-NAK` with the result's
/// [`retry_delay`](DispositionExt::retry_delay) (the handler's `backoff`, or the other
/// claim's lease for `InProgress`; the consumer's
/// [`retry_delay`](NatsConsumer::retry_delay) for results that don't say), so the
/// server redelivers it once the delay is over, and hands out other messages
/// meanwhile; DeadLetter → publish the body (with its headers, and
/// `Idempotent-Source-Subject` / `Idempotent-Source-Sequence`) to the dead-letter
/// subject and wait for JetStream to store it, then `+TERM` so the server never
/// redelivers it.
///
/// * While a message is in hand (its handler runs, or under `run` it waits for a
///   second call or for its settle), it is kept from redelivery with `+WPI` (work in
///   progress) every third of the consumer's `ack_wait`, so a handler may take longer
///   than `ack_wait` without the server handing the message out again.
/// * The consumer pulls [`batch`](NatsConsumer::batch) messages at a time (default
///   10; `run` pulls at least `concurrency`). Messages waiting in a pulled batch are
///   not yet being handled, so their `ack_wait` runs: keep the time a batch waits
///   (`batch` × the handler's time ÷ `concurrency`) well under `ack_wait`.
/// * Each message is acked on its own: JetStream has no multiple ack under
///   `AckPolicy::Explicit`, and an ack is a publish that waits for no reply.
/// * With `max_deliver` set on the JetStream consumer, a message whose last allowed
///   delivery ends in Retry is dead-lettered (copied, then `+TERM`) instead of being
///   dropped by the server at the next redelivery. Every delivery counts, also those
///   answered `InProgress` (another consumer held the key), so keep `max_deliver`
///   well above the handlers' `max_attempts`, or unset.
/// * [`new`](NatsConsumer::new) requires a dead-letter subject and checks that a
///   stream captures it (a `+TERM` without a stored copy would lose the message), and
///   that the JetStream consumer acks explicitly (`AckPolicy::Explicit`: under `All`
///   the ack of a later message would acknowledge one left for retry).
/// * A copy that the added headers would push over the server's `max_payload` is
///   published without them.
///
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
/// // A stream must capture "orders.dead".
/// let consumer = NatsConsumer::new(&pull, js, "orders.dead").await?.concurrency(32);
/// consumer.run(handle).await?;
/// # Ok(()) }
/// ```
pub struct NatsConsumer {
    consumer: jetstream::consumer::PullConsumer,
    messages: Option<Messages>,
    jetstream: jetstream::Context,
    dead_letter: String,
    retry_delay: Duration,
    grace: Duration,
    batch: usize,
    ack_wait: Duration,
    max_deliver: Option<i64>,
    concurrency: usize,
}

impl NatsConsumer {
    /// Pulls from `consumer`, dead-lettering to `dead_letter_subject` through
    /// `jetstream`. Fails if no stream captures that subject.
    pub async fn new(
        consumer: &jetstream::consumer::PullConsumer,
        jetstream: jetstream::Context,
        dead_letter_subject: impl Into<String>,
    ) -> Result<NatsConsumer, NatsError> {
        let dead_letter = dead_letter_subject.into();
        if let Err(error) = jetstream.stream_by_subject(dead_letter.clone()).await {
            return Err(format!(
                "no JetStream stream captures the dead-letter subject `{dead_letter}` ({error}): \
                 a dead letter would be lost; add the subject to a stream"
            )
            .into());
        }
        let config = &consumer.cached_info().config;
        if config.ack_policy != AckPolicy::Explicit {
            return Err(format!(
                "the JetStream consumer's ack_policy is {:?}; it must be Explicit: under All \
                 the ack of a later message would acknowledge one left for retry, and under \
                 None nothing is redelivered",
                config.ack_policy
            )
            .into());
        }
        let max_deliver = Some(config.max_deliver).filter(|&n| n > 0);
        if let Some(n) = max_deliver {
            tracing::warn!(
                max_deliver = n,
                "the JetStream consumer has max_deliver set: every delivery counts, also those \
                 answered InProgress; a message still left for retry at its last delivery is \
                 dead-lettered"
            );
        }
        Ok(NatsConsumer {
            consumer: consumer.clone(),
            messages: None,
            jetstream,
            dead_letter,
            retry_delay: Duration::from_secs(1),
            grace: DEFAULT_GRACE,
            batch: 10,
            ack_wait: config.ack_wait,
            max_deliver,
            concurrency: DEFAULT_CONCURRENCY,
        })
    }

    /// How long the server waits before redelivering a message left for retry, when
    /// its handler's result does not say ([`DispositionExt::retry_delay`] is `None`);
    /// default 1 s. Also how long a message met `InProgress` waits for the calls
    /// beside it (see [`run`](NatsConsumer::run)).
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// How many messages one pull asks for; default 10. See the type's documentation
    /// for how it relates to `ack_wait`.
    pub fn batch(mut self, messages: usize) -> Self {
        self.batch = messages.max(1);
        self.messages = None;
        self
    }

    /// How many messages [`run`](NatsConsumer::run) handles at once; default
    /// [`DEFAULT_CONCURRENCY`] (32). `run` pulls at least this many at a time. The
    /// JetStream consumer's `max_ack_pending` should be at least this, or the server
    /// hands out fewer.
    pub fn concurrency(mut self, in_flight: usize) -> Self {
        self.concurrency = in_flight.max(1);
        self
    }

    /// Handles messages until the subscription ends (then `Ok`), or pulling or a settle
    /// fails (then that error): up to [`concurrency`](NatsConsumer::concurrency)
    /// handler calls at once, each message settled by its own result as soon as its
    /// call returns, as [`next`](NatsConsumer::next) settles one. A message whose call
    /// answered `InProgress` while other calls ran is handled once more after them (it
    /// may have met a message of the same key here), if they return within the retry
    /// delay; otherwise it is settled by its first answer. After an error the calls in
    /// flight still return and are settled before `run` answers it. Messages in hand
    /// when the future is dropped, or waiting for a second call when it fails, are
    /// redelivered after `ack_wait`.
    ///
    /// The messages are read in the broker's order but handled side by side: where
    /// their order matters, use `concurrency(1)`.
    pub async fn run<F, Fut, R>(&self, handler: F) -> Result<(), NatsError>
    where
        F: FnMut(NatsMessage) -> Fut,
        Fut: Future<Output = R>,
        R: DispositionExt,
    {
        self.run_until(handler, std::future::pending()).await
    }

    /// As [`run`](NatsConsumer::run), until `shutdown` resolves (a signal, a deploy's
    /// stop): then no more messages are taken, those in hand finish and are settled,
    /// and `run_until` answers `Ok`. Messages pulled but not started are left
    /// unacked: the server redelivers them after `ack_wait` (to another consumer of
    /// the group). Calls still running
    /// [`shutdown_grace`](NatsConsumer::shutdown_grace) after the shutdown are dropped
    /// then (their claims released).
    pub async fn run_until<F, Fut, R>(
        &self,
        mut handler: F,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), NatsError>
    where
        F: FnMut(NatsMessage) -> Fut,
        Fut: Future<Output = R>,
        R: DispositionExt,
    {
        let batch = self.batch.max(self.concurrency);
        let messages = self.consumer.stream().max_messages_per_batch(batch).messages().await?;
        let deliveries = messages
            .map(|message| message.map(|message| self.held(message)).map_err(NatsError::from));
        let meter = self.meter();
        settle_concurrently(
            deliveries,
            self.concurrency,
            self.retry_delay,
            &meter,
            Stop { signal: shutdown, grace: self.grace },
            |_| None,
            |held: &Held| {
                with_delivery_count(held.message.delivery_count, handler(held.message.clone()))
            },
            |held, answer| self.settle(held, answer),
        )
        .await
    }

    /// How long the calls in flight have to finish after [`run_until`]'s shutdown;
    /// default 30 s. Keep it under what the deploy waits before it kills the process.
    ///
    /// [`run_until`]: NatsConsumer::run_until
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// Waits for the next message, runs `handler` on it and settles it. `None` when
    /// the subscription ended. One message at a time; see [`run`](NatsConsumer::run)
    /// for many.
    pub async fn next<F, Fut, R>(&mut self, handler: F) -> Option<Result<Disposition, NatsError>>
    where
        F: FnOnce(NatsMessage) -> Fut,
        Fut: Future<Output = R>,
        R: DispositionExt,
    {
        if self.messages.is_none() {
            let pull = self.consumer.stream().max_messages_per_batch(self.batch);
            match pull.messages().await {
                Ok(messages) => self.messages = Some(messages),
                Err(e) => return Some(Err(e.into())),
            }
        }
        let held = match self.messages.as_mut()?.next().await? {
            Ok(message) => self.held(message),
            Err(e) => return Some(Err(e.into())),
        };
        let meter = self.meter();
        meter.taken(1);
        let call = handler(held.message.clone());
        let answer = Answer::of(&with_delivery_count(held.message.delivery_count, call).await);
        let settled = self.settle(held, answer).await;
        if let Ok(disposition) = &settled {
            meter.settled(*disposition);
        }
        Some(settled)
    }

    /// Counts this consumer's deliveries under `{stream}/{consumer}`.
    fn meter(&self) -> ConsumerMeter {
        let info = self.consumer.cached_info();
        ConsumerMeter::new("nats", &format!("{}/{}", info.stream_name, info.name))
    }

    fn held(&self, message: jetstream::Message) -> Held {
        // The reply subject carries the delivery count and the stream sequence.
        let info = message.info().ok().map(|info| (info.delivered, info.stream_sequence));
        let last_delivery = match (self.max_deliver, info) {
            (Some(max), Some((delivered, _))) => delivered >= max,
            _ => false,
        };
        let (message, acker) = message.split();
        let acker = Arc::new(acker);
        Held {
            _progress: Progress(tokio::spawn(self.progress(acker.clone()))),
            message: NatsMessage {
                subject: message.subject.to_string(),
                payload: message.payload,
                message_id: (message.headers.as_ref())
                    .and_then(|h| h.get(crate::publish::nats::MESSAGE_ID_HEADER))
                    .map_or_else(String::new, |id| id.as_str().to_owned()),
                headers: message.headers,
                delivery_count: info.and_then(|(delivered, _)| u32::try_from(delivered).ok()),
            },
            acker,
            last_delivery,
            source: info.map(|(_, sequence)| sequence),
        }
    }

    /// Signals work in progress every third of `ack_wait`, until aborted: it keeps the
    /// server from redelivering the message while it is in hand.
    fn progress(&self, acker: Arc<Acker>) -> impl Future<Output = ()> + Send + 'static {
        let period = (self.ack_wait / 3).max(Duration::from_millis(10));
        async move {
            loop {
                tokio::time::sleep(period).await;
                if let Err(error) = acker.ack_with(AckKind::Progress).await {
                    tracing::warn!(%error, "signalling work in progress failed");
                }
            }
        }
    }

    /// Settles a message by its disposition, and answers the disposition it was
    /// settled with.
    async fn settle(&self, held: Held, answer: Answer) -> Result<Disposition, NatsError> {
        // The server would drop a message left for retry at its last delivery.
        let disposition = match answer.disposition {
            Disposition::Retry if held.last_delivery => Disposition::DeadLetter,
            other => other,
        };
        let acker = &held.acker;
        match disposition {
            Disposition::Ack => acker.ack().await?,
            Disposition::Retry => {
                // The server reads the delay as nanoseconds in an i64.
                let delay = answer.delay_or(self.retry_delay).min(Spec::MAX_DURATION);
                acker.ack_with(AckKind::Nak(Some(delay))).await?
            }
            Disposition::DeadLetter => {
                self.publish_dead_letter(held.message, held.source).await?;
                acker.ack_with(AckKind::Term).await?
            }
        }
        Ok(disposition)
    }
}

/// A message in hand: the message (handed to the handler as a copy, and kept for a
/// dead-letter copy), its acker, and what its reply subject said. From the moment it
/// is taken from the pulled batch until it is settled or dropped, a task of its own
/// signals work in progress: while its handler runs, and also while it waits for a
/// second call or for its settle.
struct Held {
    _progress: Progress,
    message: NatsMessage,
    acker: Arc<Acker>,
    /// Its delivery is the last the JetStream consumer's `max_deliver` allows.
    last_delivery: bool,
    /// Its stream sequence.
    source: Option<u64>,
}

/// A message's progress signal, stopped when its message is settled or dropped.
struct Progress(tokio::task::JoinHandle<()>);

impl Drop for Progress {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl NatsConsumer {
    /// Publishes the copy and waits for JetStream to store it. A copy that the source
    /// headers push over the server's `max_payload` goes without them.
    async fn publish_dead_letter(
        &self,
        copy: NatsMessage,
        source: Option<u64>,
    ) -> Result<(), NatsError> {
        let plain = dead_letter_headers(copy.headers.as_ref());
        let mut headers = plain.clone();
        headers.insert("Idempotent-Source-Subject", copy.subject.as_str());
        if let Some(sequence) = source {
            headers.insert("Idempotent-Source-Sequence", sequence.to_string().as_str());
        }
        let subject = self.dead_letter.clone();
        let sent =
            self.jetstream.publish_with_headers(subject.clone(), headers, copy.payload.clone());
        let publish = match sent.await {
            Err(e) if e.kind() == PublishErrorKind::MaxPayloadExceeded => {
                self.jetstream.publish_with_headers(subject, plain, copy.payload).await?
            }
            other => other?,
        };
        publish.await?;
        Ok(())
    }
}

/// The original's headers without the `Nats-*` ones: those are JetStream controls
/// (expected sequence, rollup, message id) that would make the dead-letter publish
/// fail or purge earlier dead letters.
fn dead_letter_headers(original: Option<&HeaderMap>) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, values) in original.into_iter().flat_map(HeaderMap::iter) {
        let text: &str = name.as_ref();
        if !text.to_ascii_lowercase().starts_with("nats-") {
            for value in values {
                headers.append(name.clone(), value.clone());
            }
        }
    }
    headers
}
