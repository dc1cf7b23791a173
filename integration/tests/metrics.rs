//! What a recorder receives through the `metrics` facade (feature `metrics`): calls by
//! namespace and outcome, claim and handler times, store errors by operation, and a
//! consumer's deliveries in flight and settled by disposition, against a real Redis
//! stream.
//!
//! Each test records into a recorder of its own, set for its thread, with a
//! current-thread runtime, so that tests running side by side don't see each other's
//! calls.

mod support;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idempotent::consume::redis_streams::StreamConsumer;
use idempotent::{
    Claim, Classify, Fingerprint, Key, MemoryStore, Outcome, Store, StoreError, Token, Transition,
    async_trait, idempotent,
};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use metrics_util::{CompositeKey, MetricKind};

/// Runs `case` on a current-thread runtime with a fresh recorder set for this thread,
/// and answers what it recorded.
fn recorded<F: Future>(case: F) -> (F::Output, Recorded) {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let output = runtime.block_on(case);
    drop(runtime);
    (output, Recorded::from(&snapshotter))
}

/// A metric: its kind, name and sorted labels.
type Series = (MetricKind, String, Vec<(String, String)>);

/// One snapshot: each metric's value.
struct Recorded(HashMap<Series, DebugValue>);

impl Recorded {
    fn from(snapshotter: &Snapshotter) -> Recorded {
        let values = snapshotter.snapshot().into_vec().into_iter().map(|(key, _, _, value)| {
            let key: CompositeKey = key;
            let mut labels: Vec<(String, String)> =
                (key.key().labels()).map(|l| (l.key().to_owned(), l.value().to_owned())).collect();
            labels.sort();
            ((key.kind(), key.key().name().to_owned(), labels), value)
        });
        Recorded(values.collect())
    }

    fn get(&self, kind: MetricKind, name: &str, labels: &[(&str, &str)]) -> Option<&DebugValue> {
        let mut labels: Vec<(String, String)> =
            labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        labels.sort();
        self.0.get(&(kind, name.to_owned(), labels))
    }

    fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        match self.get(MetricKind::Counter, name, labels) {
            Some(DebugValue::Counter(n)) => *n,
            None => 0,
            Some(other) => panic!("{name} is not a counter: {other:?}"),
        }
    }

    fn histogram(&self, name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
        match self.get(MetricKind::Histogram, name, labels) {
            Some(DebugValue::Histogram(values)) => values.iter().map(|v| v.0).collect(),
            None => Vec::new(),
            Some(other) => panic!("{name} is not a histogram: {other:?}"),
        }
    }

    fn gauge(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        match self.get(MetricKind::Gauge, name, labels) {
            Some(DebugValue::Gauge(value)) => Some(value.0),
            None => None,
            Some(other) => panic!("{name} is not a gauge: {other:?}"),
        }
    }

    /// Every counter of `name`, by its labels, for failure messages.
    fn all(&self, name: &str) -> Vec<(&Vec<(String, String)>, &DebugValue)> {
        let mut all: Vec<_> = (self.0.iter())
            .filter(|((_, n, _), _)| n == name)
            .map(|((_, _, labels), value)| (labels, value))
            .collect();
        all.sort_by(|a, b| a.0.cmp(b.0));
        all
    }
}

#[derive(Debug, Classify)]
enum ChargeError {
    #[idempotent(retryable)]
    Declined,
    #[idempotent(terminal)]
    Fraud,
}

impl std::fmt::Display for ChargeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ChargeError::Declined => "declined",
            ChargeError::Fraud => "fraud",
        })
    }
}

struct Charge {
    id: String,
    fails: Option<ChargeError>,
    takes: Duration,
}

#[idempotent(key = "{id}", namespace = "charge", store = store, max_attempts = 3)]
async fn charge(msg: Charge, store: &MemoryStore) -> Result<(), ChargeError> {
    tokio::time::sleep(msg.takes).await;
    match msg.fails {
        Some(error) => Err(error),
        None => Ok(()),
    }
}

async fn charge_with(
    store: &MemoryStore,
    msg: Charge,
) -> Result<Outcome<()>, idempotent::Error<ChargeError>> {
    charge(msg, store).await
}

fn ok(id: &str) -> Charge {
    Charge { id: id.to_owned(), fails: None, takes: Duration::ZERO }
}

#[test]
fn calls_are_counted_by_namespace_and_outcome_with_their_times() {
    let (_, recorded) = recorded(async {
        let store = MemoryStore::new();
        assert_eq!(charge_with(&store, ok("a")).await.unwrap(), Outcome::Processed(()));
        assert_eq!(charge_with(&store, ok("a")).await.unwrap(), Outcome::Duplicate);
        assert_eq!(charge_with(&store, ok("a")).await.unwrap(), Outcome::Duplicate);
        let slow = Charge { takes: Duration::from_millis(30), ..ok("b") };
        assert!(charge_with(&store, slow).await.unwrap().is_processed());
        let declined = Charge { fails: Some(ChargeError::Declined), ..ok("c") };
        assert!(charge_with(&store, declined).await.is_err());
        let fraud = Charge { fails: Some(ChargeError::Fraud), ..ok("d") };
        assert!(charge_with(&store, fraud).await.is_err());
        let again = Charge { fails: Some(ChargeError::Fraud), ..ok("d") };
        assert!(charge_with(&store, again).await.is_err());
    });
    let calls = |outcome| {
        recorded.counter("idempotent_calls_total", &[("namespace", "charge"), ("outcome", outcome)])
    };
    let all = recorded.all("idempotent_calls_total");
    assert_eq!(calls("processed"), 2, "{all:?}");
    assert_eq!(calls("duplicate"), 2, "{all:?}");
    assert_eq!(calls("retryable_error"), 1, "{all:?}");
    assert_eq!(calls("terminal_error"), 1, "{all:?}");
    assert_eq!(calls("previously_failed"), 1, "{all:?}");
    assert_eq!(all.len(), 5, "no other outcome was counted: {all:?}");

    let claims = recorded.histogram("idempotent_claim_seconds", &[("namespace", "charge")]);
    assert_eq!(claims.len(), 7, "one claim time per call: {claims:?}");
    assert!(claims.iter().all(|&s| (0.0..0.5).contains(&s)), "{claims:?}");
    let handlers = recorded.histogram("idempotent_handler_seconds", &[("namespace", "charge")]);
    assert_eq!(handlers.len(), 4, "one handler time per call that ran the body: {handlers:?}");
    assert!(
        handlers.iter().any(|&s| s >= 0.030)
            && handlers.iter().filter(|&&s| s < 0.030).count() == 3,
        "the slow body's time is its sleep, the others' are short: {handlers:?}"
    );
    assert_eq!(recorded.all("idempotent_store_errors_total").len(), 0);
}

#[test]
fn a_call_dropped_mid_body_counts_as_cancelled_and_a_key_error_without_namespace() {
    let (_, recorded) = recorded(async {
        let store = MemoryStore::new();
        let slow = Charge { takes: Duration::from_secs(60), ..ok("e") };
        let cut = tokio::time::timeout(Duration::from_millis(20), charge_with(&store, slow)).await;
        assert!(cut.is_err());
        assert!(charge_with(&store, ok("")).await.is_err(), "an empty id is a key error");
    });
    let calls = |namespace, outcome| {
        recorded
            .counter("idempotent_calls_total", &[("namespace", namespace), ("outcome", outcome)])
    };
    let all = recorded.all("idempotent_calls_total");
    assert_eq!(calls("charge", "cancelled"), 1, "{all:?}");
    assert_eq!(calls("", "key_error"), 1, "{all:?}");
    assert_eq!(all.len(), 2, "{all:?}");
    let handlers = recorded.histogram("idempotent_handler_seconds", &[("namespace", "charge")]);
    assert!(handlers.is_empty(), "a body that never stopped has no time: {handlers:?}");
}

/// A memory store whose claims fail for ids starting `down`, and whose `complete`
/// fails every other time.
#[derive(Default)]
struct Flaky {
    inner: MemoryStore,
    completes: AtomicU32,
}

#[async_trait]
impl Store for Flaky {
    async fn claim(
        &self,
        key: &Key,
        lease: Duration,
        ttl: Duration,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Claim, StoreError> {
        if key.id().starts_with(b"down") {
            return Err(StoreError::unavailable("connection refused (simulated)"));
        }
        self.inner.claim(key, lease, ttl, fingerprint).await
    }
    async fn complete(
        &self,
        key: &Key,
        token: Token,
        ttl: Duration,
        result: Option<&[u8]>,
    ) -> Result<Transition, StoreError> {
        if self.completes.fetch_add(1, Ordering::SeqCst).is_multiple_of(2) {
            return Err(StoreError::unavailable("connection reset (simulated)"));
        }
        self.inner.complete(key, token, ttl, result).await
    }
    async fn release(&self, key: &Key, token: Token) -> Result<Transition, StoreError> {
        self.inner.release(key, token).await
    }
    async fn fail(&self, key: &Key, token: Token, ttl: Duration) -> Result<Transition, StoreError> {
        self.inner.fail(key, token, ttl).await
    }
    async fn renew(
        &self,
        key: &Key,
        token: Token,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Transition, StoreError> {
        self.inner.renew(key, token, lease, ttl).await
    }
    fn abandon(&self, key: &Key, token: Token) {
        self.inner.abandon(key, token)
    }
}

#[idempotent(key = "{id}", namespace = "ship", store = store)]
async fn ship(id: &str, store: &Flaky) -> Result<(), std::io::Error> {
    let _ = id;
    Ok(())
}

#[test]
fn store_errors_are_counted_by_operation_retries_included() {
    let (_, recorded) = recorded(async {
        let store = Flaky::default();
        assert!(ship("down-1", &store).await.is_err());
        assert!(ship("down-2", &store).await.is_err());
        // The first DONE record fails and is tried again: processed, one error.
        assert_eq!(ship("up-1", &store).await.unwrap(), Outcome::Processed(()));
    });
    let errors = |operation| {
        recorded.counter(
            "idempotent_store_errors_total",
            &[("namespace", "ship"), ("operation", operation)],
        )
    };
    let all = recorded.all("idempotent_store_errors_total");
    assert_eq!(errors("claim"), 2, "{all:?}");
    assert_eq!(errors("complete"), 1, "{all:?}");
    assert_eq!(all.len(), 2, "{all:?}");
    let calls = |outcome| {
        recorded.counter("idempotent_calls_total", &[("namespace", "ship"), ("outcome", outcome)])
    };
    assert_eq!((calls("store_error"), calls("processed")), (2, 1));
}

#[derive(Debug, thiserror::Error, Classify)]
enum StockError {
    #[error("warehouse busy")]
    #[idempotent(retryable)]
    Busy,
    #[error("unknown item")]
    #[idempotent(terminal)]
    Unknown,
}

/// A consumer's deliveries, against a real Redis stream: taken and settled by
/// disposition, and nothing left in flight once the poll returns.
#[test]
fn a_consumer_counts_its_deliveries_by_disposition() {
    let ((), recorded) = recorded(async {
        let Some(store) = support::shared_store().await else { return };
        let stream = format!("{}:metrics", idempotent::testing::fresh_key("metrics").namespace());
        let client = redis::Client::open(support::redis_url()).unwrap();
        let mut conn = store.connection_manager().unwrap().clone();
        let consumer = StreamConsumer::new(&client, &stream, "g", "c1").await.unwrap();
        for item in ["ok-1", "ok-2", "busy", "unknown", "ok-1"] {
            let _: String = redis::cmd("XADD")
                .arg(&stream)
                .arg("*")
                .arg("payload")
                .arg(format!(r#"{{"item":"{item}"}}"#))
                .query_async(&mut conn)
                .await
                .unwrap();
        }
        let store = MemoryStore::new();
        #[idempotent(key = "{/item}", namespace = "stock", store = store)]
        async fn reserve(
            msg: idempotent::consume::redis_streams::StreamMessage,
            store: &MemoryStore,
        ) -> Result<(), StockError> {
            match msg.body() {
                br#"{"item":"busy"}"# => Err(StockError::Busy),
                br#"{"item":"unknown"}"# => Err(StockError::Unknown),
                _ => Ok(()),
            }
        }
        let polled = consumer.poll(|msg| reserve(msg, &store)).await.unwrap();
        assert_eq!(
            (polled.acked.len(), polled.retried.len(), polled.dead_lettered.len()),
            (3, 1, 1)
        );
        let _: () = redis::cmd("DEL")
            .arg(&stream)
            .arg(format!("{stream}:dead"))
            .query_async(&mut conn)
            .await
            .unwrap();
    });
    if recorded.0.is_empty() {
        return; // No Redis, outside CI: the support module said why.
    }
    let source = recorded
        .all("idempotent_consumer_settled_total")
        .first()
        .and_then(|(labels, _)| labels.iter().find(|(k, _)| k == "source"))
        .map(|(_, v)| v.clone())
        .expect("a settled count");
    let labels = |disposition| {
        [("broker", "redis_streams"), ("source", &*source), ("disposition", disposition)]
    };
    let settled =
        |disposition| recorded.counter("idempotent_consumer_settled_total", &labels(disposition));
    let all = recorded.all("idempotent_consumer_settled_total");
    assert_eq!((settled("ack"), settled("retry"), settled("dead_letter")), (3, 1, 1), "{all:?}");
    let in_flight = recorded.gauge(
        "idempotent_consumer_in_flight",
        &[("broker", "redis_streams"), ("source", &*source)],
    );
    assert_eq!(in_flight, Some(0.0), "taken and settled: nothing left in flight");
    let calls = |outcome| {
        recorded.counter("idempotent_calls_total", &[("namespace", "stock"), ("outcome", outcome)])
    };
    assert_eq!(
        (calls("processed"), calls("duplicate"), calls("retryable_error"), calls("terminal_error")),
        (2, 1, 1, 1),
        "{:?}",
        recorded.all("idempotent_calls_total")
    );
}

/// The loop the RabbitMQ, NATS and Kafka consumers share, through a real RabbitMQ
/// queue: deliveries settled by disposition, none left in flight once `run` stops.
#[test]
fn the_shared_settle_loop_counts_deliveries_by_disposition() {
    use idempotent::consume::rabbitmq::{RabbitConsumer, RabbitMessage};
    use lapin::options::{BasicPublishOptions, QueueDeclareOptions};
    use lapin::{BasicProperties, Connection, ConnectionProperties, types::FieldTable};

    let queue = format!("metrics-{:08x}", rand_u32());
    let (ran, recorded) = recorded(async {
        let url = std::env::var("AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
        let connection = match Connection::connect(&url, ConnectionProperties::default()).await {
            Ok(connection) => connection,
            Err(e) => {
                assert!(std::env::var_os("CI").is_none(), "CI needs RabbitMQ at {url}: {e}");
                eprintln!("skipped: no RabbitMQ at {url} ({e})");
                return false;
            }
        };
        let channel = connection.create_channel().await.unwrap();
        let options = QueueDeclareOptions { auto_delete: true, ..Default::default() };
        for name in [queue.clone(), format!("{queue}.dead")] {
            channel.queue_declare(name.into(), options, FieldTable::default()).await.unwrap();
        }
        for item in ["ok-1", "ok-2", "unknown", "ok-1"] {
            let body = format!(r#"{{"item":"{item}"}}"#);
            let publish = channel.basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                BasicProperties::default(),
            );
            publish.await.unwrap().await.unwrap();
        }
        let store = MemoryStore::new();
        #[idempotent(key = "{/item}", namespace = "stock", store = store)]
        async fn reserve(msg: RabbitMessage, store: &MemoryStore) -> Result<(), StockError> {
            match &msg.body[..] {
                br#"{"item":"unknown"}"# => Err(StockError::Unknown),
                _ => Ok(()),
            }
        }
        let consumer_channel = connection.create_channel().await.unwrap();
        let consumer = RabbitConsumer::new(&consumer_channel, &queue, "c").await.unwrap();
        let seen = AtomicU32::new(0);
        let run = consumer.run(|msg| {
            seen.fetch_add(1, Ordering::SeqCst);
            reserve(msg, &store)
        });
        let stop = async {
            while seen.load(Ordering::SeqCst) < 4 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        };
        tokio::select! {
            stopped = run => panic!("the consumer stopped: {stopped:?}"),
            () = stop => {}
        }
        true
    });
    if !ran {
        return;
    }
    let labels = |disposition| {
        [("broker", "rabbitmq"), ("source", queue.as_str()), ("disposition", disposition)]
    };
    let settled =
        |disposition| recorded.counter("idempotent_consumer_settled_total", &labels(disposition));
    let all = recorded.all("idempotent_consumer_settled_total");
    assert_eq!((settled("ack"), settled("retry"), settled("dead_letter")), (3, 0, 1), "{all:?}");
    let in_flight = recorded
        .gauge("idempotent_consumer_in_flight", &[("broker", "rabbitmq"), ("source", &queue)]);
    assert_eq!(in_flight, Some(0.0), "taken and settled: nothing left in flight");
}

fn rand_u32() -> u32 {
    use std::hash::{BuildHasher as _, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now()) as u32
}
