//! The publishing helpers against the real brokers: every message gets an id in the
//! broker's own place for it, and a publish sent again with the same id (as after a
//! lost acknowledgement) is stored once where the broker deduplicates (NATS
//! JetStream), and stored twice but handled once where it does not (RabbitMQ, Kafka,
//! Redis Streams), because the consumer's handler keys on `{message_id}`. A message
//! without an id is a key error and dead-lettered, never taken for another's
//! duplicate.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use idempotent::consume::kafka::{KafkaConsumer, KafkaMessage};
use idempotent::consume::nats::{NatsConsumer, NatsMessage};
use idempotent::consume::rabbitmq::{RabbitConsumer, RabbitMessage, declare_with_dead_letter};
use idempotent::consume::redis_streams::{StreamConsumer, StreamMessage};
use idempotent::publish::kafka::KafkaPublisher;
use idempotent::publish::nats::{MESSAGE_ID_HEADER, NatsPublisher};
use idempotent::publish::rabbitmq::RabbitPublisher;
use idempotent::testing::{self, block_on};
use idempotent::{Disposition, Error, MemoryStore, Outcome, idempotent};

#[path = "support/kafka.rs"]
mod kafka;
mod support;

/// What the handlers did: how many times each message id took effect.
#[derive(Default)]
struct Effects {
    store: MemoryStore,
    applied: Mutex<HashMap<String, u32>>,
}

impl Effects {
    fn apply(&self, id: &str) {
        *self.applied.lock().unwrap().entry(id.to_owned()).or_default() += 1;
    }

    fn applied(&self) -> HashMap<String, u32> {
        self.applied.lock().unwrap().clone()
    }
}

#[idempotent(key = "{message_id}", store = effects.store)]
async fn apply_rabbit(msg: RabbitMessage, effects: &Effects) {
    effects.apply(&msg.message_id);
}

#[idempotent(key = "{message_id}", store = effects.store)]
async fn apply_nats(msg: NatsMessage, effects: &Effects) {
    effects.apply(&msg.message_id);
}

#[idempotent(key = "{message_id}", store = effects.store)]
async fn apply_kafka(msg: KafkaMessage, effects: &Effects) {
    effects.apply(&msg.message_id);
}

#[idempotent(key = "{message_id}", store = effects.store)]
async fn apply_stream(msg: StreamMessage, effects: &Effects) {
    effects.apply(&msg.message_id);
}

/// RabbitMQ stores both copies of a resent publish; the handler applies one. An
/// unroutable publish is an error, and a message without an id is dead-lettered.
#[tokio::test]
async fn rabbitmq_publishes_are_confirmed_and_resends_are_duplicates() {
    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let connection = match lapin::Connection::connect(&url, Default::default()).await {
        Ok(connection) => connection,
        Err(e) => {
            assert!(std::env::var_os("CI").is_none(), "CI needs RabbitMQ at {url}: {e}");
            return eprintln!("skipped: no RabbitMQ at {url} ({e})");
        }
    };
    let channel = connection.create_channel().await.unwrap();
    let queue = testing::fresh_key("publish-rabbit").namespace().to_owned();
    let dead = declare_with_dead_letter(&channel, &queue).await.unwrap();
    let publisher = RabbitPublisher::new(&channel).await.unwrap();

    let first = publisher.publish("", &queue, b"order 1", Default::default()).await.unwrap();
    let again = lapin::BasicProperties::default().with_message_id(first.clone().into());
    let resent = publisher.publish("", &queue, b"order 1", again).await.unwrap();
    assert_eq!(resent, first, "a resend keeps its id");
    let second = publisher.publish("", &queue, b"order 2", Default::default()).await.unwrap();
    assert_ne!(second, first, "each publish gets its own id");
    let nowhere = format!("{queue}.nowhere");
    let unroutable = publisher.publish("", &nowhere, b"x", Default::default());
    let error = unroutable.await.expect_err("no queue takes it: an error, not a silent drop");
    assert!(error.to_string().contains("no queue took"), "{error}");
    // Published without the helper: no id.
    let plain = channel
        .basic_publish(
            "".into(),
            queue.as_str().into(),
            Default::default(),
            b"anonymous",
            Default::default(),
        )
        .await
        .unwrap();
    plain.await.unwrap();

    let consumer_channel = connection.create_channel().await.unwrap();
    let mut consumer = RabbitConsumer::new(&consumer_channel, &queue, "c").await.unwrap();
    let effects = Effects::default();
    let mut settled = Vec::new();
    for _ in 0..4 {
        let next = consumer.next(|m| apply_rabbit(m, &effects));
        settled.push(tokio::time::timeout(Duration::from_secs(10), next).await.unwrap());
    }
    let settled: Vec<Disposition> = settled.into_iter().map(|s| s.unwrap().unwrap()).collect();
    use Disposition::{Ack, DeadLetter};
    assert_eq!(settled, [Ack, Ack, Ack, DeadLetter], "the copy acks as a duplicate");
    assert_eq!(effects.applied(), HashMap::from([(first, 1), (second, 1)]));
    let copy = channel.basic_get(dead.as_str().into(), Default::default()).await.unwrap();
    assert_eq!(copy.expect("the id-less message was dead-lettered").data, b"anonymous");
    for name in [&queue, &dead] {
        channel.queue_delete(name.as_str().into(), Default::default()).await.unwrap();
    }
}

/// JetStream stores a resent publish once, within its duplicate window: the resend
/// is answered as a duplicate of the first copy.
#[tokio::test]
async fn nats_stores_a_resent_publish_once() {
    use async_nats::jetstream::{self, consumer::pull, stream};
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
    let client = match async_nats::connect(&url).await {
        Ok(client) => client,
        Err(e) => {
            assert!(std::env::var_os("CI").is_none(), "CI needs NATS at {url}: {e}");
            return eprintln!("skipped: no NATS at {url} ({e})");
        }
    };
    let js = jetstream::new(client);
    let name = testing::fresh_key("publish-nats").namespace().replace('-', "_");
    let (subject, dead) = (format!("{name}.orders"), format!("{name}.dead"));
    let config = stream::Config {
        name: name.clone(),
        subjects: vec![subject.clone(), dead.clone()],
        ..Default::default()
    };
    let stream = js.get_or_create_stream(config).await.unwrap();
    assert!(stream.cached_info().config.duplicate_window > Duration::ZERO);

    let publisher = NatsPublisher::new(js.clone());
    let first = publisher.publish(subject.clone(), "order 1".into(), None).await.unwrap();
    assert!(!first.duplicate);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(MESSAGE_ID_HEADER, first.id.as_str());
    let resent = publisher.publish(subject.clone(), "order 1".into(), Some(headers)).await;
    let resent = resent.unwrap();
    assert!(resent.duplicate, "the server recognised the resend");
    assert_eq!((resent.id.as_str(), resent.sequence), (first.id.as_str(), first.sequence));
    let second = publisher.publish(subject.clone(), "order 2".into(), None).await.unwrap();
    assert_ne!(second.id, first.id);
    js.publish(subject.clone(), "anonymous".into()).await.unwrap().await.unwrap();
    let mut stream = js.get_stream(&name).await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 3, "one copy of the resend");

    let durable = pull::Config {
        durable_name: Some("c".into()),
        filter_subject: subject,
        ..Default::default()
    };
    let durable = stream.get_or_create_consumer("c", durable).await.unwrap();
    let mut consumer = NatsConsumer::new(&durable, js.clone(), dead).await.unwrap();
    let effects = Effects::default();
    let mut settled = Vec::new();
    for _ in 0..3 {
        let next = consumer.next(|m| apply_nats(m, &effects));
        let next = tokio::time::timeout(Duration::from_secs(10), next).await.unwrap();
        settled.push(next.unwrap().unwrap());
    }
    use Disposition::{Ack, DeadLetter};
    assert_eq!(settled, [Ack, Ack, DeadLetter], "the id-less message is dead-lettered");
    assert_eq!(effects.applied(), HashMap::from([(first.id, 1), (second.id, 1)]));
    js.delete_stream(&name).await.unwrap();
}

/// Kafka's idempotent producer is accepted, and a record the application sends again
/// with the same id is a second record that the handler answers as a duplicate.
#[test]
fn kafka_resends_are_duplicates_by_message_id() {
    let Some(broker) = kafka::Broker::start() else { return };
    block_on(async {
        let topic = testing::fresh_key("publish-kafka").namespace().to_owned();
        let dead = format!("{topic}.dead");
        broker.create_topics(&[(&topic, 1), (&dead, 1)]).await;
        let publisher = KafkaPublisher::create(&broker.config()).unwrap();
        let first = publisher.send(&topic, Some(b"k"), b"order 1", None).await.unwrap();
        let resent = publisher.send(&topic, Some(b"k"), b"order 1", Some(&first.id)).await;
        let resent = resent.unwrap();
        assert_eq!(resent.id, first.id);
        assert_eq!(resent.offset, first.offset + 1, "the broker stores an application resend");
        let second = publisher.send(&topic, None, b"order 2", None).await.unwrap();
        assert_ne!(second.id, first.id);
        let plain = rdkafka::producer::FutureRecord::<(), _>::to(&topic).payload("anonymous");
        publisher
            .producer()
            .send(plain, Duration::from_secs(10))
            .await
            .map_err(|(e, _)| e)
            .unwrap();

        let producer = broker.config().create().unwrap();
        let mut consumer = KafkaConsumer::new(broker.member("g", &topic), producer, dead);
        let effects = Effects::default();
        let mut settled = Vec::new();
        while settled.len() < 4 {
            let next = consumer.next(|m| apply_kafka(m, &effects));
            let next = tokio::time::timeout(Duration::from_secs(20), next).await.unwrap();
            settled.extend(next.unwrap());
        }
        use Disposition::{Ack, DeadLetter};
        assert_eq!(settled, [Ack, Ack, Ack, DeadLetter]);
        assert_eq!(effects.applied(), HashMap::from([(first.id, 1), (second.id, 1)]));
    });
}

/// Redis keeps both entries of a resent `XADD`; the handler applies one.
#[test]
fn redis_stream_resends_are_duplicates_by_message_id() {
    use idempotent::publish::redis_streams::publish;
    block_on(async {
        let Some(store) = support::shared_store().await else { return };
        let mut conn = store.connection_manager().unwrap().clone();
        let stream = format!("{}:s", testing::fresh_key("publish-stream").namespace());
        let client = redis::Client::open(support::redis_url()).unwrap();
        let consumer = StreamConsumer::new(&client, &stream, "g", "c").await.unwrap();
        let fields: [(&str, &[u8]); 1] = [("payload", b"order 1")];
        let first = publish(&mut conn, &stream, &fields, None).await.unwrap();
        let resent = publish(&mut conn, &stream, &fields, Some(&first.id)).await.unwrap();
        assert_ne!(resent.entry_id, first.entry_id, "Redis stores the resend");
        let second = publish(&mut conn, &stream, &[("payload", b"order 2")], None).await.unwrap();
        assert_ne!(second.id, first.id);
        let _: String = redis::cmd("XADD")
            .arg(&stream)
            .arg("*")
            .arg("payload")
            .arg("anonymous")
            .query_async(&mut conn)
            .await
            .unwrap();

        let effects = Effects::default();
        let polled = consumer.poll(|m| apply_stream(m, &effects)).await.unwrap();
        assert_eq!(polled.acked.len(), 3, "{polled:?}");
        assert_eq!(polled.dead_lettered.len(), 1, "the id-less entry: {polled:?}");
        assert_eq!(effects.applied(), HashMap::from([(first.id, 1), (second.id, 1)]));
        let _: () = redis::cmd("DEL")
            .arg(&stream)
            .arg(format!("{stream}:dead"))
            .query_async(&mut conn)
            .await
            .unwrap();
    });
}

/// Key errors say what is missing.
#[tokio::test]
async fn a_message_without_an_id_is_a_key_error() {
    let effects = Effects::default();
    let message = RabbitMessage {
        body: b"anonymous".to_vec(),
        routing_key: "orders".into(),
        message_id: String::new(),
        redelivered: false,
        delivery_count: Some(1),
        properties: Default::default(),
    };
    let error = apply_rabbit(message, &effects).await.unwrap_err();
    assert!(matches!(error, Error::Key(_)), "{error:?}");
    assert!(error.to_string().contains("message_id"), "{error}");
    assert!(matches!(apply_rabbit_ok(&effects).await, Ok(Outcome::Processed(()))));
}

async fn apply_rabbit_ok(
    effects: &Effects,
) -> Result<Outcome<()>, Error<std::convert::Infallible>> {
    let message = RabbitMessage {
        body: b"order".to_vec(),
        routing_key: "orders".into(),
        message_id: idempotent::publish::message_id(),
        redelivered: false,
        delivery_count: Some(1),
        properties: Default::default(),
    };
    apply_rabbit(message, effects).await
}
