//! Kafka, end to end, against Apache Kafka (a broker started by the test on free
//! ports): 2,000 published records of which 20% are redelivered
//! duplicates, two group members, one hung mid-handler and killed then restarted,
//! retryable and terminal handler errors. Every unique message must take effect
//! exactly once, nothing may be lost (the group's committed offsets reach the end of
//! every partition), terminal ones must reach the dead-letter topic, and no offset may
//! be committed before its record is written: at the default concurrency and one
//! record at a time.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotent::consume::kafka::{KafkaConsumer, KafkaMessage};
use idempotent::testing::{self, block_on};
use idempotent::{MemoryStore, idempotent};
use kafka::Broker;
use orders::{Fault, World, order_id};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, FutureRecord};

#[path = "support/kafka.rs"]
mod kafka;
mod orders;

const PARTITIONS: i32 = 3;

#[idempotent(key = "{/id}", store = store, namespace = "kafka", max_attempts = 3, lease = 10)]
async fn handle(
    msg: KafkaMessage,
    store: &MemoryStore,
    world: &World,
    doomed: bool,
) -> Result<(), Fault> {
    world.process(order_id(&msg.payload), doomed).await
}

#[test]
fn two_members_one_killed_every_message_once() {
    scenario(None, &[]);
}

#[test]
fn one_record_at_a_time_every_message_once() {
    scenario(Some(1), &[]);
}

/// The same with incremental rebalances: a member joining or leaving takes or gives
/// up only the partitions that move.
#[test]
fn cooperative_sticky_rebalances_every_message_once() {
    scenario(None, &[("partition.assignment.strategy", "cooperative-sticky")]);
}

/// The same under the consumer group protocol of KIP-848 (`group.protocol=consumer`),
/// where the broker assigns the partitions and rebalances are incremental.
#[test]
fn the_consumer_group_protocol_every_message_once() {
    scenario(None, &[("group.protocol", "consumer")]);
}

/// The scenario, with the members' default concurrency or the one given, and more
/// member `settings`.
fn scenario(concurrency: Option<usize>, settings: &'static [(&'static str, &'static str)]) {
    let Some(broker) = Broker::start() else { return };
    let broker = Arc::new(broker);
    block_on(async {
        let topic = testing::fresh_key("orders").namespace().to_owned();
        let dead_topic = format!("{topic}.dead");
        broker.create_topics(&[(&topic, PARTITIONS), (&dead_topic, 1)]).await;
        let producer: FutureProducer = broker.config().create().unwrap();
        for id in orders::published() {
            let body = orders::body(id);
            let key = id.to_string();
            let record = FutureRecord::to(&topic).key(&key).payload(&body);
            producer.send(record, Duration::from_secs(10)).await.map_err(|(e, _)| e).unwrap();
        }

        let store = Arc::new(MemoryStore::new());
        let world = Arc::new(World::default());
        let acked = Arc::new(Mutex::new(0usize));
        let start_member = |doomed: bool| {
            let (store, world, acked) = (store.clone(), world.clone(), acked.clone());
            let (broker, topic, dead_topic) = (broker.clone(), topic.clone(), dead_topic.clone());
            tokio::spawn(async move {
                let producer: FutureProducer = broker.config().create().unwrap();
                let member = broker.member_with("billing", &topic, settings);
                let consumer = KafkaConsumer::new(member, producer, dead_topic)
                    .retry_delay(Duration::from_millis(100));
                let consumer = match concurrency {
                    Some(n) => consumer.concurrency(n),
                    None => consumer,
                };
                let handled = consumer.run(|m| {
                    let (store, world, acked) = (store.clone(), world.clone(), acked.clone());
                    async move {
                        let id = order_id(&m.payload);
                        let result = handle(m, &store, &world, doomed).await;
                        orders::check_recorded_before_ack(&*store, "kafka", id, &result, &acked)
                            .await;
                        result
                    }
                });
                handled.await.expect("consuming");
            })
        };
        let hung = world.hung.notified();
        let steady = start_member(false);
        let doomed = start_member(true);
        // Kill the doomed member mid-handler, without committing what it holds; its
        // partitions go to the other member from the last committed offsets.
        // Other calls of the doomed member in flight at that moment finish first (a
        // kill between an effect and its DONE record runs that effect again, at any
        // concurrency).
        hung.await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        doomed.abort();
        let _ = doomed.await;
        let restarted = start_member(false);

        let expected = World::expected();
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let done = world.effects.lock().unwrap().len();
            let (committed, ends) = {
                let broker = broker.clone();
                let topic = topic.clone();
                tokio::task::spawn_blocking(move || {
                    kafka::committed_and_end(&broker.address, "billing", &topic, PARTITIONS)
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
        steady.abort();
        restarted.abort();

        world.assert_exactly_once();

        let want = World::rejected_orders();
        let broker2 = broker.clone();
        let dead_ids =
            tokio::task::spawn_blocking(move || read_all(&broker2, &dead_topic)).await.unwrap();
        assert_eq!(dead_ids, want, "exactly the rejected orders are dead-lettered");
        assert!(*acked.lock().unwrap() >= 1_900);
    });
}

/// Every order id on `topic`, read from the start.
fn read_all(broker: &Broker, topic: &str) -> HashSet<u64> {
    let reader: BaseConsumer = broker
        .config()
        .set("group.id", format!("inspect-{topic}"))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    reader.subscribe(&[topic]).unwrap();
    let mut ids = HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    let end = reader.fetch_watermarks(topic, 0, Duration::from_secs(5)).unwrap().1;
    let mut seen = 0;
    while seen < end && Instant::now() < deadline {
        if let Some(Ok(message)) = reader.poll(Duration::from_millis(200)) {
            ids.insert(order_id(message.payload().unwrap_or_default()));
            seen += 1;
        }
    }
    ids
}
