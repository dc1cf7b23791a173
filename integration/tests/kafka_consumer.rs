//! The Kafka consumer's own guarantees, against an Apache Kafka broker of the test's own:
//! a `next` dropped mid-record loses nothing, a retry pauses only its own partition,
//! a dead letter keeps its headers and says where it came from, and a header key that
//! is not UTF-8 (which rdkafka's own accessors panic on) is read like any other.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use futures_util::FutureExt as _;
use idempotent::consume::kafka::{KafkaConsumer, KafkaMessage};
use idempotent::testing::{self, block_on};
use idempotent::{Disposition, Error, Outcome};
use kafka::Broker;
use rdkafka::bindings as rd;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{BaseProducer, FutureProducer, FutureRecord, Producer};
use std::ffi::CString;

#[path = "support/effects.rs"]
mod effects;
#[path = "support/kafka.rs"]
mod kafka;

/// Produces `value` to `topic`/0 with one header whose key is `key` (raw bytes).
fn produce_with_raw_header_key(producer: &BaseProducer, topic: &str, key: &[u8], value: &[u8]) {
    let topic = CString::new(topic).unwrap();
    let key = CString::new(key).unwrap();
    let header_value = b"v";
    let mut vus: Vec<rd::rd_kafka_vu_t> = Vec::new();
    let mut vu = |vtype, u| vus.push(rd::rd_kafka_vu_t { vtype, u });
    vu(
        rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_TOPIC,
        rd::rd_kafka_vu_s__bindgen_ty_1 { cstr: topic.as_ptr() },
    );
    vu(rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_PARTITION, rd::rd_kafka_vu_s__bindgen_ty_1 { i32_: 0 });
    vu(
        rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_VALUE,
        rd::rd_kafka_vu_s__bindgen_ty_1 {
            mem: rd::rd_kafka_vu_s__bindgen_ty_1__bindgen_ty_1 {
                ptr: value.as_ptr() as *mut _,
                size: value.len(),
            },
        },
    );
    vu(
        rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_HEADER,
        rd::rd_kafka_vu_s__bindgen_ty_1 {
            header: rd::rd_kafka_vu_s__bindgen_ty_1__bindgen_ty_2 {
                name: key.as_ptr(),
                val: header_value.as_ptr() as *const _,
                size: header_value.len() as isize,
            },
        },
    );
    vu(
        rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_MSGFLAGS,
        rd::rd_kafka_vu_s__bindgen_ty_1 { i: rd::RD_KAFKA_MSG_F_COPY },
    );
    let error =
        unsafe { rd::rd_kafka_produceva(producer.client().native_ptr(), vus.as_ptr(), vus.len()) };
    assert!(error.is_null(), "produceva failed");
    producer.flush(Duration::from_secs(10)).unwrap();
}

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
                        Err(Error::Panicked {
                            message: "flaky".into(),
                            attempt: 1,
                            exhausted: false,
                            retry_after: Duration::from_secs(3),
                        })
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

#[test]
fn a_header_key_that_is_not_utf8_does_not_stop_the_consumer() {
    let Some(broker) = Broker::start() else { return };
    block_on(async {
        let topic = testing::fresh_key("kafka-header").namespace().to_owned();
        broker.create_topics(&[(&topic, 1), (&format!("{topic}.dead"), 1)]).await;
        let raw: BaseProducer = broker.config().create().unwrap();
        produce_with_raw_header_key(&raw, &topic, b"trace-\xff", br#"{"id":1}"#);
        produce_with_raw_header_key(&raw, &topic, b"trace-ok", br#"{"id":2}"#);

        let producer: FutureProducer = broker.config().create().unwrap();
        let mut consumer =
            KafkaConsumer::new(broker.member("g", &topic), producer, format!("{topic}.dead"));
        let mut outcomes = Vec::new();
        let mut poison_settled = false;
        for _ in 0..3 {
            let next = std::panic::AssertUnwindSafe(tokio::time::timeout(
                Duration::from_secs(8),
                consumer.next(|m: KafkaMessage| {
                    poison_settled |= m.offset == 0;
                    outcomes.push(format!("handling offset {}", m.offset));
                    async { Settled::Ok(Outcome::Processed(())) }
                }),
            ))
            .catch_unwind()
            .await;
            match next {
                Err(panic) => {
                    let message = panic
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    outcomes.push(format!("panicked: {message}"));
                }
                Ok(Err(_)) => outcomes.push("timed out".to_owned()),
                Ok(Ok(settled)) => {
                    let settled = settled.map_err(|e| e.to_string());
                    outcomes.push(format!("{settled:?}"));
                    if poison_settled && settled == Ok(Some(Disposition::Ack)) {
                        break;
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        let committed =
            rdkafka::consumer::Consumer::committed(consumer.consumer(), Duration::from_secs(5))
                .map(|list| {
                    format!("{:?}", list.elements().iter().map(|e| e.offset()).collect::<Vec<_>>())
                })
                .unwrap_or_default();
        assert!(
            poison_settled,
            "the record at offset 0 (a non-UTF-8 header key) was never handed to the \
             handler: {outcomes:?}; committed offsets now {committed}"
        );
    });
}

/// A partition with a record left for retry leaves this member and comes back after
/// another member processed and committed past the record. The member must resume
/// from the group's committed offset, not seek back to its stale retry and run
/// everything in between again.
#[test]
fn a_returning_partition_does_not_resume_from_a_stale_retry() {
    let Some(broker) = Broker::start() else { return };
    block_on(async {
        let topic = testing::fresh_key("kafka-return").namespace().to_owned();
        let dead = format!("{topic}.dead");
        broker.create_topics(&[(&topic, 1), (&dead, 1)]).await;
        let producer: FutureProducer = broker.config().create().unwrap();
        for i in 0..5 {
            produce(&producer, &topic, 0, &i.to_string()).await;
        }
        let runs: std::sync::Arc<std::sync::Mutex<HashMap<String, u32>>> = Default::default();
        let count = |runs: &std::sync::Arc<std::sync::Mutex<HashMap<String, u32>>>,
                     m: &KafkaMessage| {
            *runs.lock().unwrap().entry(body(m)).or_default() += 1;
        };

        // A leaves record 0 for retry, for longer than the test.
        let mut a = KafkaConsumer::new(broker.member("g", &topic), producer, dead.clone())
            .retry_delay(Duration::from_secs(600));
        let first = a
            .next(|m| {
                count(&runs, &m);
                async {
                    Settled::Err(Error::Panicked {
                        message: "flaky".into(),
                        attempt: 1,
                        exhausted: false,
                        retry_after: Duration::from_secs(600),
                    })
                }
            })
            .await
            .unwrap();
        assert_eq!(first, Some(Disposition::Retry));
        // The partition leaves A (a rebalance revokes it).
        a.consumer().unsubscribe();

        // B takes the partition and processes everything, record 0 included.
        let b_producer: FutureProducer = broker.config().create().unwrap();
        let mut b = KafkaConsumer::new(broker.member("g", &topic), b_producer, dead.clone());
        let deadline = Instant::now() + Duration::from_secs(30);
        while runs.lock().unwrap().values().sum::<u32>() < 6 && Instant::now() < deadline {
            let next = b.next(|m| {
                count(&runs, &m);
                async { ok() }
            });
            let _ = tokio::time::timeout(Duration::from_secs(5), next).await;
        }
        // Let B's async commit land, then B leaves and the partition returns to A.
        tokio::time::sleep(Duration::from_secs(1)).await;
        drop(b);
        a.consumer().subscribe(&[topic.as_str()]).unwrap();
        produce(&broker.config().create().unwrap(), &topic, 0, "5").await;

        // A resumes after B's commit: it sees record 5 and nothing before it.
        let deadline = Instant::now() + Duration::from_secs(30);
        while runs.lock().unwrap().get("5").is_none() && Instant::now() < deadline {
            let next = a.next(|m| {
                count(&runs, &m);
                async { ok() }
            });
            let _ = tokio::time::timeout(Duration::from_secs(5), next).await;
        }
        let runs = runs.lock().unwrap().clone();
        assert_eq!(runs.get("5"), Some(&1), "{runs:?}");
        for i in 1..5 {
            assert_eq!(runs.get(&i.to_string()), Some(&1), "record {i} ran again: {runs:?}");
        }
        assert_eq!(runs.get("0"), Some(&2), "{runs:?}");
    });
}

/// A record in flight when its partition is revoked and assigned back to the same
/// member (a member joining, a resubscription) answers Retry afterwards. The
/// partition belongs to a new assignment by then, so the record neither rewinds nor
/// commits it; nor may it pause it: nothing would resume it, and the member would
/// never again read the partition it owns.
#[test]
fn a_retry_from_before_a_rebalance_does_not_leave_the_partition_paused() {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};
    let Some(broker) = Broker::start() else { return };
    block_on(async {
        let topic = testing::fresh_key("kafka-stale-retry").namespace().to_owned();
        broker.create_topics(&[(&topic, 1), (&format!("{topic}.dead"), 1)]).await;
        let producer: FutureProducer = broker.config().create().unwrap();
        produce(&producer, &topic, 0, "0").await;
        let consumer =
            KafkaConsumer::new(broker.member("g", &topic), producer, format!("{topic}.dead"))
                .retry_delay(Duration::from_millis(100))
                .concurrency(4);
        let (started, release) = (tokio::sync::Notify::new(), tokio::sync::Notify::new());
        let first = AtomicBool::new(true);
        let handled = Mutex::new(Vec::<String>::new());
        let count = |name: &str| handled.lock().unwrap().iter().filter(|b| *b == name).count();
        let run = consumer.run(|m| {
            let name = body(&m);
            handled.lock().unwrap().push(name.clone());
            let held = name == "0" && first.swap(false, Ordering::SeqCst);
            let (started, release) = (&started, &release);
            async move {
                if held {
                    started.notify_one();
                    release.notified().await;
                    return Settled::Err(Error::Panicked {
                        message: "flaky".into(),
                        attempt: 1,
                        exhausted: false,
                        retry_after: Duration::from_millis(100),
                    });
                }
                ok()
            }
        });
        let script = async {
            started.notified().await;
            // The partition leaves and comes back while record 0 is handled.
            consumer.consumer().unsubscribe();
            tokio::time::sleep(Duration::from_secs(1)).await;
            consumer.consumer().subscribe(&[topic.as_str()]).unwrap();
            let deadline = Instant::now() + Duration::from_secs(20);
            while count("0") < 2 {
                assert!(Instant::now() < deadline, "the partition was not assigned back");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            // The call of the earlier assignment answers Retry now.
            release.notify_one();
            tokio::time::sleep(Duration::from_secs(1)).await;
            produce(&broker.config().create().unwrap(), &topic, 0, "1").await;
            let deadline = Instant::now() + Duration::from_secs(15);
            while count("1") < 1 {
                assert!(
                    Instant::now() < deadline,
                    "record 1 was never read: the partition stays paused ({:?})",
                    handled.lock().unwrap()
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        tokio::select! {
            ended = run => panic!("run ended: {ended:?}"),
            () = script => {}
        }
    });
}

/// At the default concurrency, records of one partition with the same key (and the
/// partition's records without a key) are handled one after the other in offset
/// order, while records of other keys run beside them.
#[test]
fn records_of_one_key_are_handled_in_offset_order() {
    use std::sync::Mutex;
    let Some(broker) = Broker::start() else { return };
    block_on(async {
        let topic = testing::fresh_key("kafka-order").namespace().to_owned();
        broker.create_topics(&[(&topic, 1), (&format!("{topic}.dead"), 1)]).await;
        let producer: FutureProducer = broker.config().create().unwrap();
        let total = 60;
        for i in 0..total {
            let body = i.to_string();
            let key = format!("k{}", i % 3);
            let record = FutureRecord::to(&topic).partition(0).payload(&body);
            let record = if i % 4 == 3 { record } else { record.key(&key) };
            producer.send(record, Duration::from_secs(10)).await.map_err(|(e, _)| e).unwrap();
        }
        let consumer =
            KafkaConsumer::new(broker.member("g", &topic), producer, format!("{topic}.dead"));
        let started = Mutex::new(Vec::<(Option<Vec<u8>>, i64)>::new());
        let in_flight = Mutex::new((0, 0));
        let (running, overlaps) = (Mutex::new(HashSet::new()), Mutex::new(Vec::new()));
        let run = consumer.run(|m| {
            started.lock().unwrap().push((m.key.clone(), m.offset));
            if !running.lock().unwrap().insert(m.key.clone()) {
                overlaps.lock().unwrap().push(m.offset);
            }
            let (in_flight, running) = (&in_flight, &running);
            async move {
                {
                    let mut n = in_flight.lock().unwrap();
                    n.0 += 1;
                    n.1 = n.1.max(n.0);
                }
                let pause = 2 + (m.offset * 7 % 11) as u64;
                tokio::time::sleep(Duration::from_millis(pause)).await;
                in_flight.lock().unwrap().0 -= 1;
                running.lock().unwrap().remove(&m.key);
                ok()
            }
        });
        let all = async {
            while started.lock().unwrap().len() < total {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::select! {
            () = all => {}
            ended = run => panic!("run ended: {ended:?}"),
            () = tokio::time::sleep(Duration::from_secs(30)) => panic!("not every record was handled"),
        }
        let started = started.into_inner().unwrap();
        let mut lanes: HashMap<Option<Vec<u8>>, Vec<i64>> = HashMap::new();
        for (key, offset) in started {
            lanes.entry(key).or_default().push(offset);
        }
        assert_eq!(lanes.len(), 4, "three keys and the keyless records");
        for (key, offsets) in &lanes {
            assert!(offsets.windows(2).all(|w| w[0] < w[1]), "{key:?} out of order: {offsets:?}");
        }
        let overlaps = overlaps.into_inner().unwrap();
        assert!(overlaps.is_empty(), "started while a record of its key ran: {overlaps:?}");
        assert!(in_flight.lock().unwrap().1 > 1, "the lanes ran side by side");
    });
}

/// CPU time this thread has used (user and system), from `/proc/thread-self/stat`.
fn thread_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
    // Fields after the command name (which may hold spaces): utime and stime are the
    // 14th and 15th fields of the line, the 12th and 13th after `) `.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let ticks: u64 = rest.split(' ').skip(11).take(2).map(|t| t.parse::<u64>().unwrap()).sum();
    Duration::from_millis(ticks * 10) // 100 ticks a second on Linux
}

/// `commit_interval(Duration::ZERO)` commits every record as it is settled, and a
/// consumer with nothing to read sleeps (it used to wake every millisecond, 4% of a
/// core, to commit nothing).
#[test]
fn a_zero_commit_interval_commits_each_record_and_sleeps_while_idle() {
    let Some(broker) = Broker::start() else { return };
    block_on(async {
        let topic = testing::fresh_key("kafka-zero").namespace().to_owned();
        broker.create_topics(&[(&topic, 1), (&format!("{topic}.dead"), 1)]).await;
        let producer: FutureProducer = broker.config().create().unwrap();
        for i in 0..5 {
            produce(&producer, &topic, 0, &i.to_string()).await;
        }
        let consumer =
            KafkaConsumer::new(broker.member("g", &topic), producer, format!("{topic}.dead"))
                .commit_interval(Duration::ZERO);
        let handled = std::sync::atomic::AtomicUsize::new(0);
        let run = consumer.run(|_| {
            handled.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async { ok() }
        });
        let check = async {
            while handled.load(std::sync::atomic::Ordering::SeqCst) < 5 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            // Idle: nothing more to read.
            let (cpu, wall) = (thread_cpu(), Instant::now());
            tokio::time::sleep(Duration::from_millis(1500)).await;
            let (cpu, wall) = (thread_cpu() - cpu, wall.elapsed());
            assert!(cpu <= Duration::from_millis(20), "{cpu:?} of CPU in {wall:?} of waiting");
            let committed = consumer.consumer().committed(Duration::from_secs(5)).unwrap();
            let offsets: Vec<_> = committed.elements().iter().map(|e| e.offset()).collect();
            assert_eq!(offsets, [rdkafka::Offset::Offset(5)]);
        };
        tokio::select! {
            () = check => {}
            ended = run => panic!("run ended: {ended:?}"),
            () = tokio::time::sleep(Duration::from_secs(30)) => panic!("not every record was handled"),
        }
    });
}

/// `run` commits settled offsets every `commit_interval` (100 ms): "a crash loses at
/// most this much of commits". The commit timer lives in the stream of deliveries,
/// which is polled only while a slot is free; with every slot taken by a handler that
/// takes long (here `concurrency(1)` and a 20 s handler), records settled just before
/// it are not committed until it returns, and a crash meanwhile hands them out again.
#[test]
fn settled_records_are_committed_while_every_slot_is_busy() {
    let Some(broker) = Broker::start() else { return };
    block_on(async {
        let topic = testing::fresh_key("kafka-busy").namespace().to_owned();
        broker.create_topics(&[(&topic, 1), (&format!("{topic}.dead"), 1)]).await;
        let producer: FutureProducer = broker.config().create().unwrap();
        for i in 0..3 {
            produce(&producer, &topic, 0, &i.to_string()).await;
        }
        let consumer =
            KafkaConsumer::new(broker.member("g", &topic), producer, format!("{topic}.dead"))
                .concurrency(1);
        let slow_started = tokio::sync::Notify::new();
        let run = consumer.run(|m| {
            let slow = body(&m) == "2";
            if slow {
                slow_started.notify_one();
            }
            async move {
                if slow {
                    tokio::time::sleep(Duration::from_secs(20)).await;
                }
                ok()
            }
        });
        let check = async {
            slow_started.notified().await;
            // Fifteen commit intervals while record 2 is handled.
            tokio::time::sleep(Duration::from_millis(1500)).await;
            let committed = consumer.consumer().committed(Duration::from_secs(5)).unwrap();
            let offsets: Vec<_> = committed.elements().iter().map(|e| e.offset()).collect();
            assert_eq!(
                offsets,
                [rdkafka::Offset::Offset(2)],
                "records 0 and 1 were settled 1.5 s ago and are not committed"
            );
        };
        tokio::select! {
            () = check => {}
            ended = run => panic!("run ended: {ended:?}"),
            () = tokio::time::sleep(Duration::from_secs(40)) => panic!("record 2 never started"),
        }
    });
}

/// Records settled before their partition is revoked (a member joining or leaving, a
/// resubscription) keep their place: the settled offsets not yet committed are
/// committed at the revocation, as a consumer of Kafka does in its revoke callback.
/// The consumer forgets them instead (the rebalance drops the partition's track,
/// dirty commit and all), so every record settled within the last `commit_interval`
/// before a rebalance is handed out again, without any crash. A long interval makes
/// the window the whole test; at the default 100 ms it is the last 100 ms.
#[test]
fn records_settled_before_a_revocation_are_not_handed_out_again() {
    use std::sync::Mutex;
    let Some(broker) = Broker::start() else { return };
    block_on(async {
        let topic = testing::fresh_key("kafka-revoke-commit").namespace().to_owned();
        broker.create_topics(&[(&topic, 1), (&format!("{topic}.dead"), 1)]).await;
        let producer: FutureProducer = broker.config().create().unwrap();
        for i in 0..5 {
            produce(&producer, &topic, 0, &i.to_string()).await;
        }
        let consumer =
            KafkaConsumer::new(broker.member("g", &topic), producer, format!("{topic}.dead"))
                .commit_interval(Duration::from_secs(3600));
        let handled = Mutex::new(Vec::<String>::new());
        let run = consumer.run(|m| {
            handled.lock().unwrap().push(body(&m));
            async { ok() }
        });
        let script = async {
            let deadline = Instant::now() + Duration::from_secs(20);
            while handled.lock().unwrap().len() < 5 {
                assert!(Instant::now() < deadline, "not every record was handled");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
            // The partition leaves and comes back.
            consumer.consumer().unsubscribe();
            tokio::time::sleep(Duration::from_secs(1)).await;
            consumer.consumer().subscribe(&[topic.as_str()]).unwrap();
            tokio::time::sleep(Duration::from_secs(8)).await;
            let handled = handled.lock().unwrap().clone();
            assert_eq!(
                handled,
                ["0", "1", "2", "3", "4"],
                "records settled before the revocation were handed out again"
            );
        };
        tokio::select! {
            ended = run => panic!("run ended: {ended:?}"),
            () = script => {}
        }
    });
}

/// `run` ended (its future dropped) and the consumer dropped right after, as a
/// service shutting down does: the settled offsets committed at the end of `run`
/// reach the broker, and the next member hands out nothing that was settled.
#[test]
fn offsets_settled_before_a_shutdown_are_committed() {
    use std::sync::Mutex;
    let Some(broker) = Broker::start() else { return };
    block_on(async {
        let topic = testing::fresh_key("kafka-shutdown").namespace().to_owned();
        let dead = format!("{topic}.dead");
        broker.create_topics(&[(&topic, 1), (&dead, 1)]).await;
        let producer: FutureProducer = broker.config().create().unwrap();
        for i in 0..5 {
            produce(&producer, &topic, 0, &i.to_string()).await;
        }
        let handled = Mutex::new(Vec::<String>::new());
        {
            let consumer =
                KafkaConsumer::new(broker.member("g", &topic), producer.clone(), dead.clone())
                    .commit_interval(Duration::from_secs(3600));
            let run = consumer.run(|m| {
                handled.lock().unwrap().push(body(&m));
                async { ok() }
            });
            let wait = async {
                let deadline = Instant::now() + Duration::from_secs(20);
                while handled.lock().unwrap().len() < 5 {
                    assert!(Instant::now() < deadline, "not every record was handled");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            };
            tokio::select! {
                ended = run => panic!("run ended: {ended:?}"),
                () = wait => {}
            }
        }
        let again = KafkaConsumer::new(broker.member("g", &topic), producer, dead);
        let run = again.run(|m| {
            handled.lock().unwrap().push(body(&m));
            async { ok() }
        });
        tokio::select! {
            ended = run => panic!("run ended: {ended:?}"),
            () = tokio::time::sleep(Duration::from_secs(8)) => {}
        }
        let handled = handled.lock().unwrap().clone();
        assert_eq!(handled, ["0", "1", "2", "3", "4"], "settled records handed out again");
    });
}

/// At the default commit interval, the last records settled before the consumer goes
/// idle are committed by the commit timer, with no later record to carry them.
#[test]
fn the_last_records_before_an_idle_spell_are_committed() {
    let Some(broker) = Broker::start() else { return };
    block_on(async {
        let topic = testing::fresh_key("kafka-idle").namespace().to_owned();
        broker.create_topics(&[(&topic, 2), (&format!("{topic}.dead"), 1)]).await;
        let producer: FutureProducer = broker.config().create().unwrap();
        for i in 0..10 {
            produce(&producer, &topic, i % 2, &i.to_string()).await;
        }
        let consumer =
            KafkaConsumer::new(broker.member("g", &topic), producer, format!("{topic}.dead"));
        let handled = std::sync::atomic::AtomicUsize::new(0);
        let run = consumer.run(|_| {
            handled.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async { ok() }
        });
        let check = async {
            while handled.load(std::sync::atomic::Ordering::SeqCst) < 10 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
            let committed = consumer.consumer().committed(Duration::from_secs(5)).unwrap();
            let mut offsets: Vec<_> =
                committed.elements().iter().map(|e| (e.partition(), e.offset())).collect();
            offsets.sort_by_key(|&(partition, _)| partition);
            let five = rdkafka::Offset::Offset(5);
            assert_eq!(offsets, [(0, five), (1, five)]);
        };
        tokio::select! {
            () = check => {}
            ended = run => panic!("run ended: {ended:?}"),
            () = tokio::time::sleep(Duration::from_secs(30)) => panic!("not every record was handled"),
        }
    });
}

/// A record that fails retryably four times pauses its partition for its handler's
/// backoff (`"200ms..2s"`) before each retry, while the records produced meanwhile
/// to the other partition are handled at once; the fifth attempt succeeds.
#[test]
fn retries_wait_by_the_backoff_without_holding_up_the_rest() {
    let Some(broker) = Broker::start() else { return };
    block_on(async {
        let topic = testing::fresh_key("kafka-backoff").namespace().to_owned();
        broker.create_topics(&[(&topic, 2), (&format!("{topic}.dead"), 1)]).await;
        let producer: FutureProducer = broker.config().create().unwrap();
        let publisher: FutureProducer = broker.config().create().unwrap();
        // A resumed partition is fetched by the next fetch request, which waits up to
        // `fetch.wait.max.ms` (500 ms by default) on a partition with no new data.
        let member = broker.member_with("g", &topic, &[("fetch.wait.max.ms", "50")]);
        let consumer = KafkaConsumer::new(member, producer, format!("{topic}.dead")).concurrency(8);
        let log = backoff::Log::default();
        let run = consumer.run(|m: KafkaMessage| {
            let log = log.clone();
            async move { backoff::attempt(backoff::Job::of(&m.payload), &log).await }
        });
        let (publisher, topic) = (&publisher, &topic);
        let scenario = async {
            // Until the group has assigned both partitions, records would wait.
            tokio::time::sleep(Duration::from_secs(3)).await;
            log.publish_all(|id| async move {
                // The retried record alone on partition 0; the rest on partition 1.
                let partition = if id == "flaky" { 0 } else { 1 };
                produce(publisher, topic, partition, &id).await;
            })
            .await;
            log.wait(Duration::from_secs(20)).await;
        };
        tokio::select! {
            stopped = run => panic!("the consumer stopped: {stopped:?}"),
            () = scenario => {}
        }
        log.check(Duration::from_millis(300), Duration::from_millis(300));
    });
}

#[path = "support/backoff.rs"]
mod backoff;

/// A consumer created as librdkafka has it by default, committing by itself
/// (`enable.auto.commit` left on), would commit records before their outcome is
/// recorded: `run`, `next` and the exactly-once consumer refuse it before taking a
/// record, and the group commits nothing (read from the broker).
#[test]
fn a_consumer_that_commits_by_itself_is_refused_before_taking_a_record() {
    use idempotent::consume::kafka::{ExactlyOnceConsumer, KafkaContext};
    use rdkafka::ClientConfig;
    use rdkafka::consumer::StreamConsumer;
    let Some(broker) = Broker::start() else { return };
    block_on(async {
        let topic = testing::fresh_key("kafka-auto").namespace().to_owned();
        broker.create_topics(&[(&topic, 1), (&format!("{topic}.dead"), 1)]).await;
        let producer: FutureProducer = broker.config().create().unwrap();
        for i in 0..3 {
            produce(&producer, &topic, 0, &i.to_string()).await;
        }
        let group = format!("{topic}-group");
        let defaults = || {
            let consumer: StreamConsumer<KafkaContext> = broker
                .config()
                .set("group.id", &group)
                .set("auto.offset.reset", "earliest")
                .create_with_context(KafkaContext::default())
                .unwrap();
            consumer.subscribe(&[&topic]).unwrap();
            consumer
        };
        let handled = std::sync::atomic::AtomicU32::new(0);
        let consumer = KafkaConsumer::new(defaults(), producer.clone(), format!("{topic}.dead"));
        let refused = consumer
            .run(|_| async {
                handled.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                ok()
            })
            .await
            .unwrap_err();
        assert!(refused.to_string().contains("enable.auto.commit"), "{refused}");
        let mut consumer = KafkaConsumer::new(defaults(), producer, format!("{topic}.dead"));
        let refused = consumer.next(|_| async { ok() }).await.unwrap_err();
        assert!(refused.to_string().contains("enable.auto.commit"), "{refused}");
        let mut transactional = ClientConfig::new();
        transactional
            .set("bootstrap.servers", &broker.address)
            .set("transactional.id", format!("{topic}-tx"));
        let refused =
            ExactlyOnceConsumer::new(defaults(), &transactional, format!("{topic}.dead")).err();
        assert!(
            refused.is_some_and(|e| e.to_string().contains("enable.auto.commit")),
            "the exactly-once consumer took it"
        );
        assert_eq!(handled.load(std::sync::atomic::Ordering::SeqCst), 0);
        // From the broker's side, after longer than librdkafka's auto-commit interval.
        tokio::time::sleep(Duration::from_secs(6)).await;
        let (committed, _) = kafka::committed_and_end(&broker.address, &group, &topic, 1);
        assert!(committed.iter().all(|&c| c <= 0), "committed {committed:?}");
    });
}

/// A graceful stop mid-stream, as a deploy does: the calls in flight finish and are
/// settled, nothing more is started, what they reached is committed, and the next
/// member of the group handles the rest. Each record's effect (counted by its
/// handler, which is not idempotent itself) happens once.
#[test]
fn a_graceful_stop_finishes_the_calls_in_flight_and_doubles_nothing() {
    let Some(broker) = Broker::start() else { return };
    block_on(async {
        let topic = testing::fresh_key("kafka-stop").namespace().to_owned();
        let (dead, group) = (format!("{topic}.dead"), format!("{topic}-group"));
        broker.create_topics(&[(&topic, 2), (&dead, 1)]).await;
        let producer: FutureProducer = broker.config().create().unwrap();
        for i in 0..30 {
            produce(&producer, &topic, i % 2, &i.to_string()).await;
        }
        let effects = effects::Effects::default();
        let handler = |m: KafkaMessage| {
            let effects = &effects;
            async move {
                effects.take(body(&m), Duration::from_millis(300)).await;
                ok()
            }
        };
        let by_first = {
            let first = KafkaConsumer::new(broker.member(&group, &topic), producer.clone(), &dead)
                .concurrency(4);
            let stopped = first.run_until(handler, effects.ended(6));
            let stopped = tokio::time::timeout(Duration::from_secs(30), stopped);
            stopped.await.expect("run_until did not return after the shutdown").unwrap();
            effects.every_call_finished()
        };
        assert!(by_first < 30, "the stop took no effect");
        let second = KafkaConsumer::new(broker.member(&group, &topic), producer, dead);
        tokio::select! {
            () = effects.all(30, Duration::from_millis(500)) => {}
            ended = second.run(handler) => panic!("run ended: {ended:?}"),
            () = tokio::time::sleep(Duration::from_secs(30)) => {
                panic!("only {} of 30 came to the second member", effects.messages())
            }
        }
        let twice = effects.doubled();
        assert!(twice.is_empty(), "effects doubled: {twice:?} (first member handled {by_first})");
    });
}

async fn produce_keyed(producer: &FutureProducer, topic: &str, key: &str, body: &str) {
    let record = FutureRecord::to(topic).partition(0).key(key).payload(body);
    producer.send(record, Duration::from_secs(10)).await.map_err(|(e, _)| e).unwrap();
}

/// A stop while a record waits behind a slow one of its key: it is in hand, so it is
/// finished and settled too (left unsettled, it would keep the commit below the
/// records of other keys settled after it, and the next member would run those
/// again). Each effect once.
#[test]
fn a_graceful_stop_finishes_what_waits_behind_a_record_of_its_key() {
    use std::sync::Mutex;
    let Some(broker) = Broker::start() else { return };
    block_on(async {
        let topic = testing::fresh_key("kafka-stop-lane").namespace().to_owned();
        let (dead, group) = (format!("{topic}.dead"), format!("{topic}-group"));
        broker.create_topics(&[(&topic, 1), (&dead, 1)]).await;
        let producer: FutureProducer = broker.config().create().unwrap();
        for (key, body) in [("a", "0"), ("a", "1"), ("b", "2"), ("c", "3")] {
            produce_keyed(&producer, &topic, key, body).await;
        }
        let effects = Mutex::new(HashMap::<String, u32>::new());
        let handler = |m: KafkaMessage| {
            let effects = &effects;
            async move {
                let pause = if body(&m) == "0" { 1500 } else { 20 };
                tokio::time::sleep(Duration::from_millis(pause)).await;
                *effects.lock().unwrap().entry(body(&m)).or_default() += 1;
                ok()
            }
        };
        {
            let first = KafkaConsumer::new(broker.member(&group, &topic), producer.clone(), &dead)
                .concurrency(4);
            let shutdown = async {
                while effects.lock().unwrap().len() < 2 {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            };
            first.run_until(handler, shutdown).await.unwrap();
        }
        let (committed, end) = kafka::committed_and_end(&broker.address, &group, &topic, 1);
        assert_eq!(committed, end, "what the stopped member had in hand was not all committed");
        let second = KafkaConsumer::new(broker.member(&group, &topic), producer, dead);
        let _ = tokio::time::timeout(Duration::from_secs(8), second.run(handler)).await;
        let effects = effects.lock().unwrap().clone();
        assert_eq!(effects.len(), 4, "lost: {effects:?}");
        assert!(effects.values().all(|&n| n == 1), "effects doubled: {effects:?}");
    });
}

/// A `run_until` that does not end by itself after its shutdown (dropped during the
/// grace, or unwound by a handler's panic) leaves the consumer as a dropped `run`
/// does: run again, it hands out the records let go at the stop and commits to the
/// end.
#[test]
fn a_run_until_dropped_or_unwound_during_its_stop_leaves_the_consumer_whole() {
    use futures_util::FutureExt as _;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};
    let Some(broker) = Broker::start() else { return };
    block_on(async {
        for panics in [false, true] {
            let topic = testing::fresh_key("kafka-stop-drop").namespace().to_owned();
            let (dead, group) = (format!("{topic}.dead"), format!("{topic}-group"));
            broker.create_topics(&[(&topic, 1), (&dead, 1)]).await;
            let producer: FutureProducer = broker.config().create().unwrap();
            for i in 0..10 {
                produce(&producer, &topic, 0, &i.to_string()).await;
            }
            let effects = Mutex::new(HashMap::<String, u32>::new());
            let (stuck, begun) = (AtomicBool::new(true), AtomicBool::new(false));
            let handler = |m: KafkaMessage| {
                let (effects, stuck, begun) = (&effects, &stuck, &begun);
                async move {
                    begun.store(true, Ordering::SeqCst);
                    if body(&m) == "0" && stuck.load(Ordering::SeqCst) {
                        tokio::time::sleep(Duration::from_millis(1000)).await;
                        if panics {
                            panic!("the handler panics while the consumer stops");
                        }
                        tokio::time::sleep(Duration::from_secs(60)).await;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    *effects.lock().unwrap().entry(body(&m)).or_default() += 1;
                    ok()
                }
            };
            let consumer =
                KafkaConsumer::new(broker.member(&group, &topic), producer.clone(), &dead)
                    .concurrency(4)
                    .shutdown_grace(Duration::from_secs(30));
            let shutdown = async {
                while !begun.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            };
            let stopping = std::panic::AssertUnwindSafe(tokio::time::timeout(
                Duration::from_secs(5),
                consumer.run_until(handler, shutdown),
            ));
            let ended = stopping.catch_unwind().await;
            assert!(if panics { ended.is_err() } else { matches!(ended, Ok(Err(_))) });
            stuck.store(false, Ordering::SeqCst);
            let _ = tokio::time::timeout(Duration::from_secs(8), consumer.run(handler)).await;
            let effects = effects.lock().unwrap().clone();
            let (committed, end) = kafka::committed_and_end(&broker.address, &group, &topic, 1);
            assert_eq!(effects.len(), 10, "panics {panics}: not handed out again: {effects:?}");
            assert_eq!(committed, end, "panics {panics}: the commit stuck");
        }
    });
}
