//! The Kafka consumer's own guarantees, against a `tansu` broker of the test's own:
//! a `next` dropped mid-record loses nothing, a retry pauses only its own partition,
//! and a dead letter keeps its headers and says where it came from.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use idempotent::consume::kafka::{KafkaConsumer, KafkaMessage};
use idempotent::testing::{self, block_on};
use idempotent::{Disposition, Error, Outcome};
use kafka::Broker;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

#[path = "support/kafka.rs"]
mod kafka;

type Settled = Result<Outcome<()>, Error<std::io::Error>>;

fn ok() -> Settled {
    Ok(Outcome::Processed(()))
}

async fn produce(producer: &FutureProducer, topic: &str, partition: i32, body: &str) {
    let record = FutureRecord::<(), _>::to(topic).partition(partition).payload(body);
    producer.send(record, Duration::from_secs(10)).await.map_err(|(e, _)| e).unwrap();
}

fn body(m: &KafkaMessage) -> String {
    String::from_utf8_lossy(&m.payload).into_owned()
}

/// A `next` dropped while its handler runs (a timeout around it) rewinds the record's
/// partition: the record comes back instead of being passed by later commits.
#[test]
fn a_dropped_next_loses_nothing() {
    let Some(broker) = Broker::start() else { return };
    block_on(async {
        let topic = testing::fresh_key("kafka-drop").namespace().to_owned();
        broker.create_topics(&[(&topic, 1), (&format!("{topic}.dead"), 1)]).await;
        let producer: FutureProducer = broker.config().create().unwrap();
        for i in 0..3 {
            produce(&producer, &topic, 0, &i.to_string()).await;
        }
        let mut consumer =
            KafkaConsumer::new(broker.member("g", &topic), producer, format!("{topic}.dead"));
        let started = tokio::sync::Notify::new();
        let slow = consumer.next(|_| async {
            started.notify_one();
            tokio::time::sleep(Duration::from_secs(60)).await;
            ok()
        });
        tokio::select! {
            _ = slow => panic!("the slow handler finished"),
            () = started.notified() => {} // dropped mid-handler
        }

        let mut done = HashSet::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while done.len() < 3 && Instant::now() < deadline {
            let seen = tokio::time::timeout(
                Duration::from_secs(5),
                consumer.next(|m| {
                    done.insert(body(&m));
                    async { ok() }
                }),
            )
            .await;
            if let Ok(settled) = seen {
                settled.unwrap();
            }
        }
        let want: HashSet<String> = ["0", "1", "2"].map(String::from).into();
        assert_eq!(done, want, "the dropped record was lost");
    });
}

/// A record left for retry pauses its own partition for the retry delay; the other
/// partition's records are handled meanwhile.
#[test]
fn a_retry_pauses_only_its_partition() {
    let Some(broker) = Broker::start() else { return };
    block_on(async {
        let topic = testing::fresh_key("kafka-pause").namespace().to_owned();
        broker.create_topics(&[(&topic, 2), (&format!("{topic}.dead"), 1)]).await;
        let producer: FutureProducer = broker.config().create().unwrap();
        let publisher: FutureProducer = broker.config().create().unwrap();
        produce(&producer, &topic, 0, "retry-me").await;
        let mut consumer =
            KafkaConsumer::new(broker.member("g", &topic), producer, format!("{topic}.dead"))
                .retry_delay(Duration::from_secs(3));
        let mut handled: HashMap<String, Vec<Instant>> = HashMap::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while handled.get("retry-me").map_or(0, Vec::len) < 2 && Instant::now() < deadline {
            let settled = consumer.next(|m| {
                let name = body(&m);
                let first = !handled.contains_key(&name);
                handled.entry(name.clone()).or_default().push(Instant::now());
                async move {
                    if name == "retry-me" && first {
                        Err(Error::Panicked { message: "flaky".into(), attempt: 1 })
                    } else {
                        ok()
                    }
                }
            });
            let settled = tokio::time::timeout(Duration::from_secs(5), settled).await;
            if let Ok(Ok(Some(Disposition::Retry))) = settled {
                // The other partition's records arrive while this one waits.
                for i in 0..3 {
                    produce(&publisher, &topic, 1, &format!("other-{i}")).await;
                }
            }
        }
        let retried = &handled["retry-me"];
        assert_eq!(retried.len(), 2, "{handled:?}");
        let wait = retried[1] - retried[0];
        assert!(wait >= Duration::from_millis(2_900), "came back after {wait:?}");
        for i in 0..3 {
            let other = handled[&format!("other-{i}")][0];
            assert!(other < retried[0] + Duration::from_secs(2), "other-{i} was held up");
        }
    });
}

/// A dead letter keeps the record's headers and says where it came from.
#[test]
fn a_dead_letter_keeps_its_headers_and_source() {
    let Some(broker) = Broker::start() else { return };
    block_on(async {
        let topic = testing::fresh_key("kafka-dead").namespace().to_owned();
        let dead = format!("{topic}.dead");
        broker.create_topics(&[(&topic, 1), (&dead, 1)]).await;
        let producer: FutureProducer = broker.config().create().unwrap();
        let headers = OwnedHeaders::new().insert(Header { key: "trace-id", value: Some("t-7") });
        let record = FutureRecord::<(), _>::to(&topic).payload("poison").headers(headers);
        producer.send(record, Duration::from_secs(10)).await.map_err(|(e, _)| e).unwrap();
        let mut consumer = KafkaConsumer::new(broker.member("g", &topic), producer, dead.clone());
        let settled = consumer
            .next(|_| async {
                Settled::Err(Error::Terminal {
                    error: std::io::ErrorKind::InvalidData.into(),
                    attempt: 1,
                    exhausted: false,
                })
            })
            .await
            .unwrap();
        assert_eq!(settled, Some(Disposition::DeadLetter));

        let reader: BaseConsumer = broker
            .config()
            .set("group.id", "reader")
            .set("auto.offset.reset", "earliest")
            .create()
            .unwrap();
        reader.subscribe(&[dead.as_str()]).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        let copy = loop {
            assert!(Instant::now() < deadline, "no dead letter arrived");
            if let Some(Ok(message)) = reader.poll(Duration::from_millis(200)) {
                break message.detach();
            }
        };
        assert_eq!(copy.payload(), Some(&b"poison"[..]));
        let headers: HashMap<String, String> = copy
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| {
                        (
                            h.key.to_owned(),
                            String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        assert_eq!(headers.get("trace-id").map(String::as_str), Some("t-7"));
        assert_eq!(headers.get("idempotent-source-topic"), Some(&topic));
        assert_eq!(headers.get("idempotent-source-partition").map(String::as_str), Some("0"));
        assert_eq!(headers.get("idempotent-source-offset").map(String::as_str), Some("0"));
    });
}
