//! The RabbitMQ consumer's own guarantees: dead letters are published and confirmed
//! by the consumer, whatever the queue's broker-side settings; a missing dead-letter
//! queue is an error at start-up; a retry's delay does not hold up other deliveries.

use std::time::{Duration, Instant};

use idempotent::consume::rabbitmq::{RabbitConsumer, RabbitMessage};
use idempotent::testing;
use idempotent::{Disposition, Error, Outcome};
use lapin::options::{BasicGetOptions, BasicPublishOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

type Settled = Result<Outcome<()>, Error<std::io::Error>>;

async fn open() -> Option<(Connection, Channel)> {
    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    match Connection::connect(&url, ConnectionProperties::default()).await {
        Ok(connection) => {
            let channel = connection.create_channel().await.unwrap();
            Some((connection, channel))
        }
        Err(e) => {
            assert!(std::env::var_os("CI").is_none(), "CI needs RabbitMQ at {url}: {e}");
            eprintln!("skipped: no RabbitMQ at {url} ({e})");
            None
        }
    }
}

/// A plain queue: no dead-letter exchange, auto-deleted after the test.
async fn plain_queue(channel: &Channel, name: &str) {
    let options = QueueDeclareOptions { auto_delete: true, ..Default::default() };
    channel.queue_declare(name.into(), options, FieldTable::default()).await.unwrap();
}

async fn publish(channel: &Channel, queue: &str, body: &str) {
    channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            body.as_bytes(),
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
}

/// On a queue without a dead-letter exchange, where a reject would discard the
/// message, a dead letter still reaches the dead-letter queue, with its origin.
#[tokio::test]
async fn dead_letters_reach_their_queue_without_a_broker_side_exchange() {
    let Some((_connection, channel)) = open().await else { return };
    let queue = testing::fresh_key("rabbit-dl").namespace().to_owned();
    let dead = format!("{queue}.dead");
    plain_queue(&channel, &queue).await;
    plain_queue(&channel, &dead).await;
    let (_c, consumer_channel) = open().await.unwrap();
    let mut consumer =
        RabbitConsumer::with_dead_letter_queue(&consumer_channel, &queue, "c", &dead)
            .await
            .unwrap();
    publish(&channel, &queue, r#"{"id":1}"#).await;
    let settled = consumer
        .next(|_: RabbitMessage| async {
            Settled::Err(Error::Terminal {
                error: std::io::ErrorKind::InvalidData.into(),
                attempt: 1,
                exhausted: false,
            })
        })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(settled, Disposition::DeadLetter);
    let copy = channel
        .basic_get(dead.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("the dead letter reached its queue");
    assert_eq!(copy.delivery.data, br#"{"id":1}"#);
    let headers = copy.delivery.properties.headers().clone().unwrap_or_default();
    let source = headers.inner().get("x-idempotent-source-queue").cloned();
    assert_eq!(source, Some(AMQPValue::LongString(queue.clone().into())));
}

/// A dead-letter queue that does not exist is an error when the consumer starts,
/// not a message lost at the first dead letter.
#[tokio::test]
async fn a_missing_dead_letter_queue_fails_at_start_up() {
    let Some((_connection, channel)) = open().await else { return };
    let queue = testing::fresh_key("rabbit-missing").namespace().to_owned();
    plain_queue(&channel, &queue).await;
    let (_c, consumer_channel) = open().await.unwrap();
    let started = RabbitConsumer::new(&consumer_channel, &queue, "c").await;
    assert!(started.is_err(), "started without {queue}.dead");
}

/// A delivery held for its retry delay does not hold up the next delivery.
#[tokio::test]
async fn a_retry_delay_does_not_hold_up_other_deliveries() {
    let Some((_connection, channel)) = open().await else { return };
    let queue = testing::fresh_key("rabbit-retry").namespace().to_owned();
    plain_queue(&channel, &queue).await;
    plain_queue(&channel, &format!("{queue}.dead")).await;
    let (_c, consumer_channel) = open().await.unwrap();
    let mut consumer = RabbitConsumer::new(&consumer_channel, &queue, "c")
        .await
        .unwrap()
        .retry_delay(Duration::from_secs(3));
    publish(&channel, &queue, "first").await;
    publish(&channel, &queue, "second").await;
    let started = Instant::now();
    let first = consumer
        .next(|_| async { Settled::Err(Error::Panicked { message: "flaky".into(), attempt: 1 }) });
    assert_eq!(first.await.unwrap().unwrap(), Disposition::Retry);
    let second = consumer.next(|m: RabbitMessage| async move {
        assert_eq!(m.body, b"second");
        Settled::Ok(Outcome::Processed(()))
    });
    assert_eq!(second.await.unwrap().unwrap(), Disposition::Ack);
    assert!(started.elapsed() < Duration::from_secs(2), "held up {:?}", started.elapsed());
    // The first comes back once its delay is over.
    let again = tokio::time::timeout(
        Duration::from_secs(10),
        consumer.next(|m: RabbitMessage| async move {
            assert_eq!(m.body, b"first");
            assert!(m.redelivered);
            Settled::Ok(Outcome::Processed(()))
        }),
    )
    .await
    .expect("the retried delivery came back");
    assert_eq!(again.unwrap().unwrap(), Disposition::Ack);
    assert!(started.elapsed() >= Duration::from_secs(3), "requeued before its delay");
}
