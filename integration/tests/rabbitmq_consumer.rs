//! The RabbitMQ consumer's own guarantees: dead letters are published and confirmed
//! by the consumer, whatever the queue's broker-side settings, and do not expire with
//! the message's TTL; a missing dead-letter queue is an error at start-up; a retry's
//! delay does not hold up other deliveries; a `next` or `run` dropped mid-handler
//! requeues what it holds; `run` keeps at most `concurrency` calls in flight and
//! settles two deliveries of one key in one pass.

use std::time::{Duration, Instant};

use idempotent::consume::rabbitmq::{RabbitConsumer, RabbitMessage};
use idempotent::testing;
use idempotent::{Disposition, DispositionExt as _, Error, MemoryStore, Outcome, idempotent};
use lapin::options::{BasicGetOptions, BasicPublishOptions, BasicQosOptions, QueueDeclareOptions};
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
    publish_with(channel, queue, body, BasicProperties::default()).await;
}

async fn publish_with(channel: &Channel, queue: &str, body: &str, properties: BasicProperties) {
    channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            body.as_bytes(),
            properties,
        )
        .await
        .unwrap()
        .await
        .unwrap();
}

fn terminal() -> Settled {
    Settled::Err(Error::Terminal {
        error: std::io::ErrorKind::InvalidData.into(),
        attempt: 1,
        exhausted: false,
    })
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
    let settled = consumer.next(|_: RabbitMessage| async { terminal() }).await.unwrap().unwrap();
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
    let first = consumer.next(|_| async {
        Settled::Err(Error::Panicked {
            message: "flaky".into(),
            attempt: 1,
            exhausted: false,
            retry_after: Duration::from_secs(3),
        })
    });
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

#[tokio::test]
async fn a_dead_letter_does_not_inherit_the_message_ttl() {
    let Some((_connection, channel)) = open().await else { return };
    let queue = testing::fresh_key("rabbit-ttl").namespace().to_owned();
    let dead = format!("{queue}.dead");
    plain_queue(&channel, &queue).await;
    plain_queue(&channel, &dead).await;
    let (_c, consumer_channel) = open().await.unwrap();
    let mut consumer = RabbitConsumer::new(&consumer_channel, &queue, "c").await.unwrap();

    // A message that must be handled within a minute, say; it is handled at once.
    let properties = BasicProperties::default().with_expiration("1500".into());
    publish_with(&channel, &queue, r#"{"id":1}"#, properties).await;
    let settled = consumer.next(|_: RabbitMessage| async { terminal() }).await.unwrap().unwrap();
    assert_eq!(settled, Disposition::DeadLetter);

    // The original is acked; the dead letter is all that is left of the message.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let copy =
        channel.basic_get(dead.as_str().into(), BasicGetOptions { no_ack: true }).await.unwrap();
    assert!(
        copy.is_some(),
        "the dead letter expired in `{dead}`: it kept the original's `expiration` property, \
         and the original was acked, so the message is gone"
    );
}

#[tokio::test]
async fn a_dropped_next_requeues_its_delivery() {
    let Some((_connection, channel)) = open().await else { return };
    let queue = testing::fresh_key("rabbit-drop").namespace().to_owned();
    plain_queue(&channel, &queue).await;
    plain_queue(&channel, &format!("{queue}.dead")).await;
    let (_c, consumer_channel) = open().await.unwrap();
    consumer_channel.basic_qos(10, BasicQosOptions::default()).await.unwrap();
    let mut consumer = RabbitConsumer::new(&consumer_channel, &queue, "c").await.unwrap();

    publish(&channel, &queue, "slow").await;
    // The consumer gives each message a second; this one's handler is slow that time
    // (a store that is slow to answer), so the call is cancelled.
    let first = tokio::time::timeout(
        Duration::from_secs(1),
        consumer.next(|_: RabbitMessage| async {
            tokio::time::sleep(Duration::from_secs(30)).await;
            Settled::Ok(Outcome::Processed(()))
        }),
    )
    .await;
    assert!(first.is_err(), "the first call was cancelled");

    // The consumer goes on. The message must come back to be handled.
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(8);
    while tokio::time::Instant::now() < deadline {
        let next = tokio::time::timeout(
            Duration::from_millis(500),
            consumer.next(|m: RabbitMessage| async move {
                assert_eq!(m.body, b"slow");
                Settled::Ok(Outcome::Processed(()))
            }),
        )
        .await;
        if let Ok(Some(settled)) = next {
            seen.push(settled.unwrap());
            break;
        }
    }
    assert_eq!(
        seen,
        vec![Disposition::Ack],
        "the delivery of the cancelled call was never settled nor redelivered: it stays \
         unacked on the live channel for ever"
    );
}

/// `run` starts no more than `concurrency` calls, and when it is dropped with calls
/// in flight, their deliveries come back to be handled.
#[tokio::test]
async fn run_is_bounded_and_a_dropped_run_requeues_what_it_holds() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let Some((_connection, channel)) = open().await else { return };
    let queue = testing::fresh_key("rabbit-run").namespace().to_owned();
    plain_queue(&channel, &queue).await;
    plain_queue(&channel, &format!("{queue}.dead")).await;
    for i in 0..10 {
        publish(&channel, &queue, &format!("m{i}")).await;
    }
    let (_c, consumer_channel) = open().await.unwrap();
    consumer_channel.basic_qos(10, BasicQosOptions::default()).await.unwrap();
    let consumer =
        RabbitConsumer::new(&consumer_channel, &queue, "c").await.unwrap().concurrency(4);
    let started = AtomicUsize::new(0);
    let hung = consumer.run(|_: RabbitMessage| {
        started.fetch_add(1, Ordering::SeqCst);
        async {
            std::future::pending::<()>().await;
            Settled::Ok(Outcome::Processed(()))
        }
    });
    let stopped = tokio::time::timeout(Duration::from_millis(1500), hung).await;
    assert!(stopped.is_err(), "run ended by itself");
    assert_eq!(started.load(Ordering::SeqCst), 4, "calls in flight beyond the concurrency");

    let handled = std::sync::Mutex::new(std::collections::BTreeSet::new());
    let all = async {
        while handled.lock().unwrap().len() < 10 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let run = consumer.run(|m: RabbitMessage| {
        handled.lock().unwrap().insert(String::from_utf8(m.body).unwrap());
        async { Settled::Ok(Outcome::Processed(())) }
    });
    tokio::select! {
        () = all => {}
        ended = run => panic!("run ended: {ended:?}"),
        () = tokio::time::sleep(Duration::from_secs(10)) => {
            panic!("only {:?} came back", handled.lock().unwrap())
        }
    }
}

#[idempotent(key = "{/id}", store = store, namespace = "rabbit-twice")]
async fn slow_once(msg: RabbitMessage, store: &MemoryStore, effects: &std::sync::Mutex<u32>) {
    tokio::time::sleep(Duration::from_millis(200)).await;
    *effects.lock().unwrap() += 1;
    let _ = msg;
}

/// Two deliveries of one key in flight together in one consumer: the second meets
/// the first's claim, is handled again once the first is done, and acks as a
/// duplicate at once, rather than being requeued to come back a retry delay later.
#[tokio::test]
async fn a_key_delivered_twice_settles_both_in_one_pass() {
    let Some((_connection, channel)) = open().await else { return };
    let queue = testing::fresh_key("rabbit-twice").namespace().to_owned();
    plain_queue(&channel, &queue).await;
    plain_queue(&channel, &format!("{queue}.dead")).await;
    publish(&channel, &queue, r#"{"id":1}"#).await;
    publish(&channel, &queue, r#"{"id":1}"#).await;
    let (_c, consumer_channel) = open().await.unwrap();
    consumer_channel.basic_qos(10, BasicQosOptions::default()).await.unwrap();
    let consumer = RabbitConsumer::new(&consumer_channel, &queue, "c")
        .await
        .unwrap()
        .retry_delay(Duration::from_secs(30));
    let (store, effects) = (MemoryStore::new(), std::sync::Mutex::new(0));
    let settled = std::sync::Mutex::new(Vec::new());
    let both = async {
        while settled.lock().unwrap().len() < 2 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let run = consumer.run(|m: RabbitMessage| {
        let (store, effects, settled) = (&store, &effects, &settled);
        async move {
            let result = slow_once(m, store, effects).await;
            if !result.is_in_progress() {
                settled.lock().unwrap().push(result.disposition());
            }
            result
        }
    });
    tokio::select! {
        () = both => {}
        ended = run => panic!("run ended: {ended:?}"),
        () = tokio::time::sleep(Duration::from_secs(5)) => {
            panic!("settled only {:?}: the second delivery was left for a retry", settled.lock().unwrap())
        }
    }
    assert_eq!(*settled.lock().unwrap(), vec![Disposition::Ack, Disposition::Ack]);
    assert_eq!(*effects.lock().unwrap(), 1);
}

/// Fails every time, retryably, on `NoStore`, noting the delivery count it ran at.
#[idempotent(key = "{/id}", store = idempotent::NoStore, max_attempts = 3)]
async fn rabbit_always_flaky(
    msg: RabbitMessage,
    seen: &std::sync::Mutex<Vec<Option<u32>>>,
) -> Result<(), std::io::Error> {
    seen.lock().unwrap().push(idempotent::delivery::delivery_count());
    Err(std::io::ErrorKind::TimedOut.into())
}

/// On a quorum queue, which counts deliveries, a handler on `NoStore` takes its
/// attempt from `x-delivery-count`, so `max_attempts` dead-letters a message that
/// keeps failing retryably.
#[tokio::test]
async fn on_no_store_the_attempt_is_the_quorum_queue_delivery_count() {
    let Some((_connection, channel)) = open().await else { return };
    let queue = testing::fresh_key("rabbit-quorum").namespace().to_owned();
    let mut arguments = FieldTable::default();
    arguments.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    let durable = QueueDeclareOptions { durable: true, ..Default::default() };
    channel.queue_declare(queue.as_str().into(), durable, arguments).await.unwrap();
    plain_queue(&channel, &format!("{queue}.dead")).await;
    let (_c, consumer_channel) = open().await.unwrap();
    let consumer = RabbitConsumer::new(&consumer_channel, &queue, "c").await.unwrap();
    let mut consumer = consumer.retry_delay(Duration::from_millis(50));
    publish(&channel, &queue, r#"{"id":1}"#).await;
    let seen = std::sync::Mutex::new(Vec::new());
    let mut settled = Vec::new();
    for _ in 0..3 {
        let next = consumer.next(|m| rabbit_always_flaky(m, &seen));
        let next = tokio::time::timeout(Duration::from_secs(10), next).await.unwrap();
        settled.push(next.unwrap().unwrap());
    }
    assert_eq!(settled, [Disposition::Retry, Disposition::Retry, Disposition::DeadLetter]);
    assert_eq!(*seen.lock().unwrap(), [Some(1), Some(2), Some(3)]);
    channel.queue_delete(queue.as_str().into(), Default::default()).await.unwrap();
}

/// Fails retryably on its first call only, on `NoStore`, noting the delivery count it
/// ran at.
#[idempotent(key = "{/id}", store = idempotent::NoStore, max_attempts = 3)]
async fn rabbit_flaky_once(
    msg: RabbitMessage,
    seen: &std::sync::Mutex<Vec<Option<u32>>>,
) -> Result<(), std::io::Error> {
    let mut seen = seen.lock().unwrap();
    seen.push(idempotent::delivery::delivery_count());
    if seen.len() == 1 { Err(std::io::ErrorKind::TimedOut.into()) } else { Ok(()) }
}

/// A dead letter replayed into its queue (its copy moved back as it is, the usual
/// way to retry dead letters once the cause is fixed) is a first delivery, and its
/// handler gets all of its attempts again. The consumer's dead-letter copy keeps the
/// quorum queue's `x-delivery-count` header, and the consumer reads that header even
/// on a delivery the broker marks as not redelivered, so the replayed message starts
/// at the attempt it was dead-lettered at: its first transient failure dead-letters
/// it again.
#[tokio::test]
async fn on_no_store_a_replayed_dead_letter_starts_again_at_attempt_one() {
    let Some((_connection, channel)) = open().await else { return };
    let queue = testing::fresh_key("rabbit-replay").namespace().to_owned();
    let dead = format!("{queue}.dead");
    let mut arguments = FieldTable::default();
    arguments.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    let durable = QueueDeclareOptions { durable: true, ..Default::default() };
    channel.queue_declare(queue.as_str().into(), durable, arguments).await.unwrap();
    plain_queue(&channel, &dead).await;
    let (_c, consumer_channel) = open().await.unwrap();
    let consumer = RabbitConsumer::new(&consumer_channel, &queue, "c").await.unwrap();
    let mut consumer = consumer.retry_delay(Duration::from_millis(50));
    publish(&channel, &queue, r#"{"id":1}"#).await;
    let seen = std::sync::Mutex::new(Vec::new());
    for _ in 0..3 {
        let next = consumer.next(|m| rabbit_always_flaky(m, &seen));
        tokio::time::timeout(Duration::from_secs(10), next).await.unwrap().unwrap().unwrap();
    }
    // Replay the dead letter: its body and properties, back into the queue.
    let copy = channel.basic_get(dead.as_str().into(), BasicGetOptions { no_ack: true });
    let copy = copy.await.unwrap().expect("the message was dead-lettered");
    publish_with(
        &channel,
        &queue,
        std::str::from_utf8(&copy.delivery.data).unwrap(),
        copy.delivery.properties.clone(),
    )
    .await;

    let seen = std::sync::Mutex::new(Vec::new());
    let mut settled = Vec::new();
    for _ in 0..2 {
        let next = consumer.next(|m| rabbit_flaky_once(m, &seen));
        let next = tokio::time::timeout(Duration::from_secs(3), next).await;
        match next {
            Ok(next) => settled.push(next.unwrap().unwrap()),
            Err(_) => break, // nothing more to consume: it went to the dead-letter queue
        }
    }
    assert_eq!(
        (settled, seen.into_inner().unwrap()),
        (vec![Disposition::Retry, Disposition::Ack], vec![Some(1), Some(2)]),
        "the replayed message was counted from its old x-delivery-count header"
    );
    channel.queue_delete(queue.as_str().into(), Default::default()).await.unwrap();
}

/// Succeeds, on `NoStore`, noting the delivery count it ran at.
#[idempotent(key = "{/id}", store = idempotent::NoStore, max_attempts = 3)]
async fn rabbit_fine(
    msg: RabbitMessage,
    seen: &std::sync::Mutex<Vec<Option<u32>>>,
) -> Result<(), std::io::Error> {
    seen.lock().unwrap().push(idempotent::delivery::delivery_count());
    Ok(())
}

/// On a classic queue, which keeps no count, an `x-delivery-count` header is whatever
/// the publisher (or an earlier dead-letter copy, a shovel, a bridge) put there. A
/// first delivery carrying `x-delivery-count: 5` must still be attempt 1; the consumer
/// reads it as delivery 6, so a handler with `max_attempts = 3` on `NoStore` never
/// runs, and the message is dead-lettered as "3 attempt(s) never finished".
#[tokio::test]
async fn on_no_store_a_published_delivery_count_header_is_not_the_attempt() {
    let Some((_connection, channel)) = open().await else { return };
    let queue = testing::fresh_key("rabbit-forged").namespace().to_owned();
    plain_queue(&channel, &queue).await;
    plain_queue(&channel, &format!("{queue}.dead")).await;
    let mut headers = FieldTable::default();
    headers.insert("x-delivery-count".into(), AMQPValue::LongLongInt(5));
    let properties = BasicProperties::default().with_headers(headers);
    publish_with(&channel, &queue, r#"{"id":1}"#, properties).await;
    let (_c, consumer_channel) = open().await.unwrap();
    let mut consumer = RabbitConsumer::new(&consumer_channel, &queue, "c").await.unwrap();
    let seen = std::sync::Mutex::new(Vec::new());
    let next = consumer.next(|m| rabbit_fine(m, &seen));
    let settled = tokio::time::timeout(Duration::from_secs(10), next).await.unwrap();
    assert_eq!(
        (settled.unwrap().unwrap(), seen.into_inner().unwrap()),
        (Disposition::Ack, vec![Some(1)]),
        "a first delivery was taken for the sixth"
    );
}

/// A message that fails retryably four times is held for its handler's backoff
/// (`"200ms..2s"`) before each requeue, while messages published meanwhile are
/// handled at once; the fifth attempt succeeds.
#[tokio::test]
async fn retries_wait_by_the_backoff_without_holding_up_the_rest() {
    let Some((_connection, channel)) = open().await else { return };
    let queue = testing::fresh_key("rabbit-backoff").namespace().to_owned();
    let dead = idempotent::consume::rabbitmq::declare_with_dead_letter(&channel, &queue).await;
    let dead = dead.unwrap();
    let (_c, consumer_channel) = open().await.unwrap();
    consumer_channel.basic_qos(64, BasicQosOptions::default()).await.unwrap();
    let consumer =
        RabbitConsumer::new(&consumer_channel, &queue, "c").await.unwrap().concurrency(8);
    let log = backoff::Log::default();
    let run = consumer.run(|m: RabbitMessage| {
        let log = log.clone();
        async move { backoff::attempt(backoff::Job::of(&m.body), &log).await }
    });
    let (channel_ref, queue_ref) = (&channel, &queue);
    let scenario = async {
        log.publish_all(|id| async move { publish(channel_ref, queue_ref, &id).await }).await;
        log.wait(Duration::from_secs(20)).await;
    };
    tokio::select! {
        stopped = run => panic!("the consumer stopped: {stopped:?}"),
        () = scenario => {}
    }
    log.check(Duration::from_millis(300), Duration::from_millis(300));
    for name in [&queue, &dead] {
        channel.queue_delete(name.as_str().into(), Default::default()).await.unwrap();
    }
}

#[path = "support/backoff.rs"]
mod backoff;
#[path = "support/effects.rs"]
mod effects;

/// A graceful stop mid-stream, as a deploy does: the calls in flight finish and are
/// acked, nothing more is started, the deliveries the channel had prefetched are
/// requeued at once (the stopped consumer's channel stays open here, so they would
/// otherwise stay unacked), and a second consumer handles the rest. Each message's
/// effect (counted by its handler, which is not idempotent itself) happens once.
#[tokio::test]
async fn a_graceful_stop_finishes_the_calls_in_flight_and_doubles_nothing() {
    let Some((_connection, channel)) = open().await else { return };
    let queue = testing::fresh_key("rabbit-stop").namespace().to_owned();
    // Not auto-deleted: the first consumer's cancel would delete it, messages and all.
    let kept = QueueDeclareOptions::default();
    channel.queue_declare(queue.as_str().into(), kept, FieldTable::default()).await.unwrap();
    plain_queue(&channel, &format!("{queue}.dead")).await;
    for i in 0..30 {
        publish(&channel, &queue, &format!("m{i}")).await;
    }
    let effects = effects::Effects::default();
    let handler = |m: RabbitMessage| {
        let effects = &effects;
        async move {
            effects.take(String::from_utf8(m.body).unwrap(), Duration::from_millis(300)).await;
            Settled::Ok(Outcome::Processed(()))
        }
    };
    let (_c, first_channel) = open().await.unwrap();
    first_channel.basic_qos(10, BasicQosOptions::default()).await.unwrap();
    let first = RabbitConsumer::new(&first_channel, &queue, "first").await.unwrap().concurrency(4);
    let stopped = first.run_until(handler, effects.ended(6));
    let stopped = tokio::time::timeout(Duration::from_secs(20), stopped);
    stopped.await.expect("run_until did not return after the shutdown").unwrap();
    let by_first = effects.every_call_finished();
    assert!(by_first < 30, "the stop took no effect");

    let (_c2, second_channel) = open().await.unwrap();
    let second = RabbitConsumer::new(&second_channel, &queue, "second").await.unwrap();
    tokio::select! {
        () = effects.all(30, Duration::from_millis(500)) => {}
        ended = second.run(handler) => panic!("run ended: {ended:?}"),
        () = tokio::time::sleep(Duration::from_secs(15)) => {
            panic!("only {} of 30 came to the second consumer", effects.messages())
        }
    }
    let twice = effects.doubled();
    assert!(twice.is_empty(), "effects doubled: {twice:?} (first consumer handled {by_first})");
    let delete = lapin::options::QueueDeleteOptions::default();
    channel.queue_delete(queue.as_str().into(), delete).await.unwrap();
}

/// After a graceful stop the consumer is cancelled: `run` and `run_until` on it
/// answer `Ok` at once (the broker sends it nothing more) instead of waiting for
/// deliveries that never come.
#[tokio::test]
async fn a_stopped_consumer_answers_at_once_when_run_again() {
    let Some((_connection, channel)) = open().await else { return };
    let queue = testing::fresh_key("rabbit-stopped").namespace().to_owned();
    let kept = QueueDeclareOptions::default();
    channel.queue_declare(queue.as_str().into(), kept, FieldTable::default()).await.unwrap();
    plain_queue(&channel, &format!("{queue}.dead")).await;
    let (_c, consumer_channel) = open().await.unwrap();
    let consumer = RabbitConsumer::new(&consumer_channel, &queue, "c").await.unwrap();
    let handler = |_: RabbitMessage| async { Settled::Ok(Outcome::Processed(())) };
    consumer.run_until(handler, async {}).await.unwrap();
    let again = tokio::time::timeout(Duration::from_secs(2), consumer.run(handler)).await;
    assert!(matches!(again, Ok(Ok(()))), "run after the stop: {again:?}");
    let delete = lapin::options::QueueDeleteOptions::default();
    channel.queue_delete(queue.as_str().into(), delete).await.unwrap();
}
