//! The at-least-once Kafka consumer under broker faults, against Apache Kafka, judged
//! from outside (the effects recorded, the group's committed offsets, the dead-letter
//! topic): the broker SIGKILLed and restarted mid-consumption, with commits failing
//! while it is down; and a record left for retry that DeleteRecords removes while its
//! partition is paused.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotent::consume::kafka::{KafkaConsumer, KafkaContext, KafkaMessage};
use idempotent::testing::{self, block_on};
use idempotent::{Error, MemoryStore, Outcome, idempotent};
use kafka::Broker;
use orders::{Fault, World, order_id};
use rdkafka::admin::{AdminClient, AdminOptions};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};

#[path = "support/kafka.rs"]
mod kafka;
mod orders;

const PARTITIONS: i32 = 3;

#[idempotent(key = "{/id}", store = store, namespace = "kafka", max_attempts = 3, lease = 10)]
async fn handle(msg: KafkaMessage, store: &MemoryStore, world: &World) -> Result<(), Fault> {
    world.process(order_id(&msg.payload), false).await
}

fn config(address: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", address);
    config
}

fn member(address: &str, group: &str, topic: &str) -> StreamConsumer<KafkaContext> {
    let consumer: StreamConsumer<KafkaContext> = config(address)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "500")
        .create_with_context(KafkaContext::default())
        .unwrap();
    consumer.subscribe(&[topic]).unwrap();
    consumer
}

/// Every order id on `topic`, read from the start.
fn read_all(address: &str, topic: &str) -> HashSet<u64> {
    let reader: BaseConsumer = config(address)
        .set("group.id", format!("inspect-{topic}"))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    reader.subscribe(&[topic]).unwrap();
    let end = reader.fetch_watermarks(topic, 0, Duration::from_secs(5)).unwrap().1;
    let (mut ids, mut seen) = (HashSet::new(), 0);
    let deadline = Instant::now() + Duration::from_secs(20);
    while seen < end && Instant::now() < deadline {
        if let Some(Ok(message)) = reader.poll(Duration::from_millis(200)) {
            ids.insert(order_id(message.payload().unwrap_or_default()));
            seen += 1;
        }
    }
    ids
}

/// The broker is SIGKILLed while a member consumes, with settled records not yet
/// committed (commits every 2 s), and restarted on its data 2 s later. The member's
/// commits fail meanwhile and `run` may end with the error: it is started again, as
/// a supervisor would. Every order takes effect once, the uncommitted records come
/// back (as duplicates the store answers), rejected orders are dead-lettered, and the
/// group's committed offsets reach the end of every partition.
#[test]
fn a_broker_killed_and_restarted_mid_consumption_loses_nothing_and_doubles_nothing() {
    let Some(mut broker) = Broker::start() else { return };
    let address = broker.address.clone();
    block_on(async {
        let topic = testing::fresh_key("orders").namespace().to_owned();
        let dead_topic = format!("{topic}.dead");
        broker.create_topics(&[(&topic, PARTITIONS), (&dead_topic, 1)]).await;
        let producer: FutureProducer = broker.config().create().unwrap();
        for id in orders::published() {
            let (body, key) = (orders::body(id), id.to_string());
            let record = FutureRecord::to(&topic).key(&key).payload(&body);
            producer.send(record, Duration::from_secs(10)).await.map_err(|(e, _)| e).unwrap();
        }
        drop(producer);

        let store = Arc::new(MemoryStore::new());
        let world = Arc::new(World::default());
        let deliveries: Arc<Mutex<HashMap<(i32, i64), u32>>> = Arc::default();
        let runs_ended = Arc::new(AtomicUsize::new(0));
        let consuming = {
            let (store, world, deliveries, runs_ended) =
                (store.clone(), world.clone(), deliveries.clone(), runs_ended.clone());
            let (address, topic, dead_topic) = (address.clone(), topic.clone(), dead_topic.clone());
            tokio::spawn(async move {
                loop {
                    let producer: FutureProducer = config(&address).create().unwrap();
                    let consumer = KafkaConsumer::new(
                        member(&address, "billing", &topic),
                        producer,
                        &dead_topic,
                    )
                    .concurrency(4)
                    .commit_interval(Duration::from_secs(2))
                    .retry_delay(Duration::from_millis(100));
                    let ran = consumer
                        .run(|m| {
                            *deliveries
                                .lock()
                                .unwrap()
                                .entry((m.partition, m.offset))
                                .or_default() += 1;
                            let (store, world) = (store.clone(), world.clone());
                            async move {
                                tokio::time::sleep(Duration::from_millis(3)).await;
                                handle(m, &store, &world).await
                            }
                        })
                        .await;
                    if let Err(error) = ran {
                        eprintln!("run ended: {error}; starting again");
                        runs_ended.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                }
            })
        };

        while world.effects.lock().unwrap().len() < 300 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::task::block_in_place(|| {
            broker.kill();
            std::thread::sleep(Duration::from_secs(2));
            broker.restart();
        });

        let expected = World::expected();
        let deadline = Instant::now() + Duration::from_secs(180);
        loop {
            let done = world.effects.lock().unwrap().len();
            let (committed, ends) = {
                let (address, topic) = (address.clone(), topic.clone());
                tokio::task::spawn_blocking(move || {
                    kafka::committed_and_end(&address, "billing", &topic, PARTITIONS)
                })
                .await
                .unwrap()
            };
            if done == expected && committed == ends {
                break;
            }
            let stuck =
                format!("stuck: {done}/{expected} done, committed {committed:?} of {ends:?}");
            assert!(Instant::now() < deadline, "{stuck}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        consuming.abort();

        world.assert_exactly_once();
        let again = deliveries.lock().unwrap().values().filter(|&&n| n > 1).count();
        assert!(again > 0, "no record came back: the kill lost no settled, uncommitted record");
        let dead =
            tokio::task::spawn_blocking(move || read_all(&address, &dead_topic)).await.unwrap();
        assert_eq!(dead, World::rejected_orders(), "exactly the rejected orders are dead-lettered");
        eprintln!(
            "{again} records delivered again after the restart; run ended {} times",
            runs_ended.load(Ordering::SeqCst)
        );
    });
}

/// A record left for retry pauses its partition; meanwhile an operator deletes the
/// partition's records up to past it (DeleteRecords, as retention would). When the
/// partition resumes, the record is gone: the consumer goes on from the log start
/// instead of waiting for it for ever, and its commit reaches the end.
#[test]
fn a_retried_record_deleted_while_paused_does_not_stop_its_partition() {
    let Some(broker) = Broker::start() else { return };
    block_on(async {
        let topic = testing::fresh_key("kafka-deleted").namespace().to_owned();
        broker.create_topics(&[(&topic, 1), (&format!("{topic}.dead"), 1)]).await;
        let producer: FutureProducer = broker.config().create().unwrap();
        for i in 0..10 {
            let body = i.to_string();
            let record = FutureRecord::<(), _>::to(&topic).partition(0).payload(&body);
            producer.send(record, Duration::from_secs(10)).await.map_err(|(e, _)| e).unwrap();
        }
        let consumer =
            KafkaConsumer::new(broker.member("g", &topic), producer, format!("{topic}.dead"))
                .retry_delay(Duration::from_secs(3));
        let handled: Arc<Mutex<Vec<i64>>> = Arc::default();
        let admin: AdminClient<DefaultClientContext> = broker.config().create().unwrap();
        let deleted = Arc::new(tokio::sync::Notify::new());
        let run = consumer.run(|m| {
            handled.lock().unwrap().push(m.offset);
            let deleted = deleted.clone();
            async move {
                if m.offset == 3 {
                    deleted.notify_one();
                    return Err(Error::Panicked {
                        message: "flaky".into(),
                        attempt: 1,
                        exhausted: false,
                        retry_after: Duration::from_secs(3),
                    });
                }
                Ok::<_, Error<std::io::Error>>(Outcome::Processed(()))
            }
        });
        let check = async {
            deleted.notified().await;
            let mut upto = TopicPartitionList::new();
            upto.add_partition_offset(&topic, 0, Offset::Offset(5)).unwrap();
            let result = admin.delete_records(&upto, &AdminOptions::new()).await.unwrap();
            assert!(result.elements()[0].error().is_ok(), "{result:?}");
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let (committed, _) = {
                    let (address, topic) = (broker.address.clone(), topic.clone());
                    tokio::task::spawn_blocking(move || {
                        kafka::committed_and_end(&address, "g", &topic, 1)
                    })
                    .await
                    .unwrap()
                };
                if committed == [10] {
                    return;
                }
                let seen = handled.lock().unwrap().clone();
                assert!(Instant::now() < deadline, "stuck at {committed:?}; handled {seen:?}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        };
        tokio::select! {
            ran = run => panic!("run ended: {ran:?}"),
            () = check => {}
        }
        let handled = handled.lock().unwrap().clone();
        for offset in 5..10 {
            assert!(handled.contains(&offset), "record {offset} was not handled: {handled:?}");
        }
    });
}
