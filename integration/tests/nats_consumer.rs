//! The NATS JetStream consumer's own guarantees, with plain handlers whose runs are
//! counted: a handler longer than `ack_wait` is not redelivered meanwhile, a pulled
//! batch does not outwait `ack_wait`, a message's last allowed delivery is
//! dead-lettered instead of dropped, a dead-letter subject no stream captures is an
//! error at start-up, and `run` keeps at most `concurrency` calls in flight and
//! settles two messages of one key in one pass.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, consumer::AckPolicy, consumer::pull, stream};
use idempotent::consume::nats::{NatsConsumer, NatsMessage};
use idempotent::testing;
use idempotent::{Disposition, DispositionExt as _, Error, MemoryStore, Outcome, idempotent};

type Settled = Result<Outcome<()>, Error<std::io::Error>>;

async fn connect() -> Option<async_nats::Client> {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
    match async_nats::connect(&url).await {
        Ok(c) => Some(c),
        Err(e) => {
            assert!(std::env::var_os("CI").is_none(), "CI needs NATS at {url}: {e}");
            eprintln!("skipped: no NATS at {url} ({e})");
            None
        }
    }
}

/// A stream `{name}` on `{name}.orders` and `{name}.dead`, and a durable pull
/// consumer on the orders with `config`.
struct Setup {
    js: jetstream::Context,
    name: String,
    durable: jetstream::consumer::PullConsumer,
}

impl Setup {
    async fn new(config: pull::Config) -> Option<Setup> {
        let js = jetstream::new(connect().await?);
        let name = testing::fresh_key("nats").namespace().replace('-', "_");
        let subjects = vec![format!("{name}.orders"), format!("{name}.dead")];
        let created = js.get_or_create_stream(stream::Config {
            name: name.clone(),
            subjects,
            ..Default::default()
        });
        let stream = created.await.unwrap();
        let config = pull::Config {
            durable_name: Some("c".into()),
            filter_subject: format!("{name}.orders"),
            ..config
        };
        let durable = stream.get_or_create_consumer("c", config).await.unwrap();
        Some(Setup { js, name, durable })
    }

    async fn publish(&self, n: usize) {
        for i in 0..n {
            let body = format!(r#"{{"id":{i}}}"#);
            self.js
                .publish(format!("{}.orders", self.name), body.into())
                .await
                .unwrap()
                .await
                .unwrap();
        }
    }

    async fn consumer(&self) -> NatsConsumer {
        NatsConsumer::new(&self.durable, self.js.clone(), format!("{}.dead", self.name))
            .await
            .unwrap()
    }

    /// The last message on the dead-letter subject, if any.
    async fn dead_letter(&self) -> Option<jetstream::message::StreamMessage> {
        let stream = self.js.get_stream(&self.name).await.unwrap();
        stream.get_last_raw_message_by_subject(&format!("{}.dead", self.name)).await.ok()
    }

    async fn delete(self) {
        self.js.delete_stream(&self.name).await.unwrap();
    }
}

type Runs = Arc<Mutex<HashMap<Vec<u8>, u32>>>;

fn counted(
    runs: &Runs,
    pause: Duration,
) -> impl FnOnce(NatsMessage) -> std::pin::Pin<Box<dyn std::future::Future<Output = Settled> + Send>>
{
    let runs = runs.clone();
    move |m: NatsMessage| {
        *runs.lock().unwrap().entry(m.payload.to_vec()).or_default() += 1;
        Box::pin(async move {
            tokio::time::sleep(pause).await;
            Settled::Ok(Outcome::Processed(()))
        })
    }
}

/// A handler that runs 2.5× `ack_wait` keeps its message: the consumer signals work
/// in progress, so the server does not hand the message out again meanwhile.
#[tokio::test]
async fn a_handler_longer_than_ack_wait_is_not_redelivered() {
    let config = pull::Config { ack_wait: Duration::from_secs(1), ..Default::default() };
    let Some(setup) = Setup::new(config).await else { return };
    setup.publish(1).await;
    let mut consumer = setup.consumer().await;
    let runs = Runs::default();
    let settled = consumer.next(counted(&runs, Duration::from_millis(2_500))).await;
    assert_eq!(settled.unwrap().unwrap(), Disposition::Ack);
    let again =
        tokio::time::timeout(Duration::from_secs(2), consumer.next(counted(&runs, Duration::ZERO)))
            .await;
    assert!(again.is_err(), "the message was delivered again: {runs:?}");
    assert_eq!(runs.lock().unwrap().values().copied().collect::<Vec<_>>(), vec![1]);
    setup.delete().await;
}

/// With a batch of one, messages do not wait in a pulled batch while `ack_wait` runs
/// out: each of six 300 ms handlers runs once under a 1 s `ack_wait`.
#[tokio::test]
async fn a_small_batch_does_not_outwait_ack_wait() {
    let config = pull::Config { ack_wait: Duration::from_secs(1), ..Default::default() };
    let Some(setup) = Setup::new(config).await else { return };
    setup.publish(6).await;
    let mut consumer = setup.consumer().await.batch(1);
    let runs = Runs::default();
    for _ in 0..6 {
        let settled = consumer.next(counted(&runs, Duration::from_millis(300))).await;
        assert_eq!(settled.unwrap().unwrap(), Disposition::Ack);
    }
    let again = tokio::time::timeout(
        Duration::from_millis(1_500),
        consumer.next(counted(&runs, Duration::ZERO)),
    )
    .await;
    assert!(again.is_err(), "a message was delivered again: {runs:?}");
    assert!(runs.lock().unwrap().values().all(|&n| n == 1), "{runs:?}");
    setup.delete().await;
}

/// A message still left for retry at its last allowed delivery (`max_deliver`) is
/// copied to the dead-letter subject, instead of being dropped by the server.
#[tokio::test]
async fn the_last_allowed_delivery_is_dead_lettered() {
    let config =
        pull::Config { ack_wait: Duration::from_secs(2), max_deliver: 2, ..Default::default() };
    let Some(setup) = Setup::new(config).await else { return };
    setup.publish(1).await;
    let mut consumer = setup.consumer().await.retry_delay(Duration::from_millis(100));
    let in_progress = || {
        |_: NatsMessage| async {
            Settled::Ok(Outcome::InProgress { retry_after: Duration::from_millis(100) })
        }
    };
    assert_eq!(consumer.next(in_progress()).await.unwrap().unwrap(), Disposition::Retry);
    assert_eq!(consumer.next(in_progress()).await.unwrap().unwrap(), Disposition::DeadLetter);
    let copy = setup.dead_letter().await.expect("the message was dead-lettered, not dropped");
    assert_eq!(&copy.payload[..], br#"{"id":0}"#);
    let source = copy.headers.get("Idempotent-Source-Subject").map(|v| v.as_str().to_owned());
    assert_eq!(source, Some(format!("{}.orders", setup.name)));
    setup.delete().await;
}

/// A dead-letter subject that no stream captures would lose every dead letter: the
/// consumer refuses to start.
#[tokio::test]
async fn an_uncaptured_dead_letter_subject_fails_at_start_up() {
    let Some(setup) = Setup::new(pull::Config::default()).await else { return };
    let nowhere = format!("{}-nowhere.dead", setup.name);
    let started = NatsConsumer::new(&setup.durable, setup.js.clone(), nowhere).await;
    assert!(started.is_err());
    setup.delete().await;
}

/// Under `AckPolicy::All` the ack of a later message would acknowledge one just left
/// for retry, and under `None` nothing is redelivered: the consumer refuses to start
/// on anything but `Explicit`.
#[tokio::test]
async fn an_ack_policy_other_than_explicit_fails_at_start_up() {
    for policy in [AckPolicy::All, AckPolicy::None] {
        let config = pull::Config { ack_policy: policy, ..Default::default() };
        let Some(setup) = Setup::new(config).await else { return };
        let started =
            NatsConsumer::new(&setup.durable, setup.js.clone(), format!("{}.dead", setup.name))
                .await;
        assert!(started.is_err(), "{policy:?} was accepted");
        setup.delete().await;
    }
}

/// A message close to the server's `max_payload`: the headers the dead-letter copy
/// adds would push it over the limit, so it goes without them instead of failing on
/// every delivery (and, under `max_deliver`, being dropped by the server).
#[tokio::test]
async fn a_message_near_max_payload_is_dead_lettered() {
    let config =
        pull::Config { ack_wait: Duration::from_secs(1), max_deliver: 3, ..Default::default() };
    let Some(setup) = Setup::new(config).await else { return };
    let max_payload = connect().await.unwrap().server_info().max_payload;
    let body = vec![b'x'; max_payload - 64];
    let subject = format!("{}.orders", setup.name);
    setup.js.publish(subject, body.clone().into()).await.unwrap().await.unwrap();
    let mut consumer = setup.consumer().await.batch(1).retry_delay(Duration::from_millis(100));
    let settled = consumer
        .next(|_: NatsMessage| async {
            Settled::Err(Error::Terminal {
                error: std::io::ErrorKind::InvalidData.into(),
                attempt: 1,
                exhausted: false,
            })
        })
        .await
        .unwrap();
    assert_eq!(settled.unwrap(), Disposition::DeadLetter);
    let copy = setup.dead_letter().await.expect("the message was dead-lettered");
    assert_eq!(copy.payload.len(), body.len());
    setup.delete().await;
}

#[idempotent(key = "{/id}", store = store, namespace = "nats-run")]
async fn slow(
    msg: NatsMessage,
    store: &MemoryStore,
    effects: &Runs,
    in_flight: &Mutex<(u32, u32)>,
) {
    {
        let mut n = in_flight.lock().unwrap();
        n.0 += 1;
        n.1 = n.1.max(n.0);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    in_flight.lock().unwrap().0 -= 1;
    *effects.lock().unwrap().entry(msg.payload.to_vec()).or_default() += 1;
}

/// `run` keeps `concurrency` calls in flight, no more; a message whose key another
/// call of the same consumer holds is handled again once that call is done, and acks
/// as a duplicate in the same pass instead of coming back after its retry delay.
#[tokio::test]
async fn run_is_bounded_and_settles_a_key_delivered_twice_in_one_pass() {
    let config = pull::Config { ack_wait: Duration::from_secs(5), ..Default::default() };
    let Some(setup) = Setup::new(config).await else { return };
    setup.publish(20).await;
    let subject = format!("{}.orders", setup.name);
    setup.js.publish(subject, r#"{"id":3}"#.into()).await.unwrap().await.unwrap();
    let consumer = setup.consumer().await.concurrency(4).retry_delay(Duration::from_secs(30));
    let (store, effects, in_flight) = (MemoryStore::new(), Runs::default(), Mutex::new((0, 0)));
    let settled = Mutex::new(Vec::new());
    let all = async {
        while settled.lock().unwrap().len() < 21 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let run = consumer.run(|m: NatsMessage| {
        let (store, effects, in_flight, settled) = (&store, &effects, &in_flight, &settled);
        async move {
            let result = slow(m, store, effects, in_flight).await;
            if !result.is_in_progress() {
                settled.lock().unwrap().push(result.disposition());
            }
            result
        }
    });
    tokio::select! {
        () = all => {}
        ended = run => panic!("run ended: {ended:?}"),
        () = tokio::time::sleep(Duration::from_secs(10)) => {
            panic!("settled only {} of 21 in one pass", settled.lock().unwrap().len())
        }
    }
    assert!(settled.lock().unwrap().iter().all(|&d| d == Disposition::Ack));
    assert_eq!(in_flight.lock().unwrap().1, 4, "calls in flight at most");
    let effects = effects.lock().unwrap().clone();
    assert_eq!(effects.len(), 20);
    assert!(effects.values().all(|&n| n == 1), "{effects:?}");
    setup.delete().await;
}

#[idempotent(key = "{/id}", store = store, namespace = "nats-held")]
async fn three_seconds(msg: NatsMessage, store: &MemoryStore) {
    tokio::time::sleep(Duration::from_secs(3)).await;
    let _ = msg;
}

/// A message met `InProgress` while another call of its key runs here waits for that
/// call without a progress signal: it must not wait past `ack_wait` (here shorter
/// than the retry delay), or the server hands it out again while it is still held.
#[tokio::test]
async fn a_message_waiting_for_a_second_call_is_not_redelivered_meanwhile() {
    let config = pull::Config { ack_wait: Duration::from_secs(1), ..Default::default() };
    let Some(setup) = Setup::new(config).await else { return };
    let subject = format!("{}.orders", setup.name);
    for body in [r#"{"id":1,"n":"a"}"#, r#"{"id":1,"n":"b"}"#] {
        setup.js.publish(subject.clone(), body.into()).await.unwrap().await.unwrap();
    }
    let consumer = setup.consumer().await.concurrency(4).retry_delay(Duration::from_secs(10));
    let store = MemoryStore::new();
    let calls: Mutex<HashMap<String, u32>> = Mutex::default();
    let run = consumer.run(|m: NatsMessage| {
        let value: idempotent::serde_json::Value =
            idempotent::serde_json::from_slice(&m.payload).unwrap();
        *calls.lock().unwrap().entry(value["n"].as_str().unwrap().to_owned()).or_default() += 1;
        three_seconds(m, &store)
    });
    tokio::select! {
        ended = run => panic!("run ended: {ended:?}"),
        () = tokio::time::sleep(Duration::from_millis(2_800)) => {}
    }
    let calls = calls.lock().unwrap().clone();
    assert_eq!(calls.get("b"), Some(&1), "b was handed out again while held: {calls:?}");
    setup.delete().await;
}

/// Fails every time, retryably, on `NoStore`, noting the delivery count it ran at.
#[idempotent(key = "{/id}", store = idempotent::NoStore, max_attempts = 3)]
async fn nats_always_flaky(
    msg: NatsMessage,
    seen: &Mutex<Vec<Option<u32>>>,
) -> Result<(), std::io::Error> {
    seen.lock().unwrap().push(idempotent::delivery::delivery_count());
    Err(std::io::ErrorKind::TimedOut.into())
}

/// `NoStore` keeps no attempt count; the attempt is the server's delivery count, so
/// `max_attempts` still dead-letters a message that keeps failing retryably.
#[tokio::test]
async fn on_no_store_the_attempt_is_the_delivery_count() {
    let config = pull::Config { ack_wait: Duration::from_secs(5), ..Default::default() };
    let Some(setup) = Setup::new(config).await else { return };
    setup.publish(1).await;
    let mut consumer = setup.consumer().await.retry_delay(Duration::from_millis(50));
    let seen = Mutex::new(Vec::new());
    let mut settled = Vec::new();
    for _ in 0..3 {
        let next = consumer.next(|m| nats_always_flaky(m, &seen));
        settled.push(tokio::time::timeout(Duration::from_secs(10), next).await.unwrap());
    }
    let settled: Vec<_> = settled.into_iter().map(|s| s.unwrap().unwrap()).collect();
    assert_eq!(settled, [Disposition::Retry, Disposition::Retry, Disposition::DeadLetter]);
    assert_eq!(*seen.lock().unwrap(), [Some(1), Some(2), Some(3)]);
    assert!(setup.dead_letter().await.is_some());
    setup.delete().await;
}

/// A message that fails retryably four times is naked with its handler's backoff
/// (`"200ms..2s"`) as the delay, while messages published meanwhile are handled at
/// once; the fifth attempt succeeds.
#[tokio::test]
async fn retries_wait_by_the_backoff_without_holding_up_the_rest() {
    let Some(setup) = Setup::new(pull::Config::default()).await else { return };
    let consumer = setup.consumer().await.concurrency(8);
    let log = backoff::Log::default();
    let run = consumer.run(|m: NatsMessage| {
        let log = log.clone();
        async move { backoff::attempt(backoff::Job::of(&m.payload), &log).await }
    });
    let (js, subject) = (&setup.js, format!("{}.orders", setup.name));
    let subject = &subject;
    let scenario = async {
        log.publish_all(|id| async move {
            js.publish(subject.clone(), id.into()).await.unwrap().await.unwrap();
        })
        .await;
        log.wait(Duration::from_secs(20)).await;
    };
    tokio::select! {
        stopped = run => panic!("the consumer stopped: {stopped:?}"),
        () = scenario => {}
    }
    log.check(Duration::from_millis(300), Duration::from_millis(300));
    setup.delete().await;
}

#[path = "support/backoff.rs"]
mod backoff;
#[path = "support/effects.rs"]
mod effects;

/// A graceful stop mid-stream, as a deploy does: the calls in flight finish and are
/// acked, nothing more is started, and a second consumer handles the rest (what the
/// first had pulled but not started comes back after `ack_wait`). Each message's
/// effect (counted by its handler, which is not idempotent itself) happens once.
#[tokio::test]
async fn a_graceful_stop_finishes_the_calls_in_flight_and_doubles_nothing() {
    let config = pull::Config {
        ack_policy: AckPolicy::Explicit,
        ack_wait: Duration::from_secs(2),
        ..Default::default()
    };
    let Some(setup) = Setup::new(config).await else { return };
    setup.publish(30).await;
    let effects = effects::Effects::default();
    let handler = |m: NatsMessage| {
        let effects = &effects;
        async move {
            let message = String::from_utf8(m.payload.to_vec()).unwrap();
            effects.take(message, Duration::from_millis(300)).await;
            Settled::Ok(Outcome::Processed(()))
        }
    };
    let first = setup.consumer().await.concurrency(4);
    let stopped = first.run_until(handler, effects.ended(6));
    let stopped = tokio::time::timeout(Duration::from_secs(20), stopped);
    stopped.await.expect("run_until did not return after the shutdown").unwrap();
    let by_first = effects.every_call_finished();
    assert!(by_first < 30, "the stop took no effect");

    let second = setup.consumer().await;
    tokio::select! {
        // Anything redelivered twice would show up by then (past one `ack_wait`).
        () = effects.all(30, Duration::from_millis(2500)) => {}
        ended = second.run(handler) => panic!("run ended: {ended:?}"),
        () = tokio::time::sleep(Duration::from_secs(20)) => {
            panic!("only {} of 30 came to the second consumer", effects.messages())
        }
    }
    let twice = effects.doubled();
    assert!(twice.is_empty(), "effects doubled: {twice:?} (first consumer handled {by_first})");
    setup.delete().await;
}
