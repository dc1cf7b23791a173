//! RocketMQ, end to end, against Apache RocketMQ (a name server and a broker started
//! by the test on free ports): 2,000 published messages of
//! which 20% repeat an earlier order (a new message with the same business key), two
//! members of one consumer group, one hung mid-handler and killed then restarted,
//! retryable and terminal handler errors. Every unique order must take effect exactly
//! once, nothing may be lost (a member started afterwards from the group's committed
//! offsets finds nothing left), terminal ones must reach the group's dead-letter
//! queue, and no message may be acknowledged before its record is written. Then the
//! same with the broker SIGKILLed and restarted mid-consumption.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotent::consume::rocketmq::{RocketMqConsumer, RocketMqMessage};
use idempotent::publish::rocketmq::RocketMqPublisher;
use idempotent::testing::{self, block_on};
use idempotent::{MemoryStore, idempotent};
use orders::{Fault, World, order_id};
use rocketmq::Cluster;

mod orders;
#[path = "support/rocketmq.rs"]
mod rocketmq;

#[idempotent(key = "{keys}", store = store, namespace = "rocketmq", max_attempts = 3, lease = 10)]
async fn handle(
    msg: RocketMqMessage,
    store: &MemoryStore,
    world: &World,
    doomed: bool,
) -> Result<(), Fault> {
    world.process(order_id(&msg.body), doomed).await
}

fn member(name_server: &str, group: &str, topic: &str) -> RocketMqConsumer {
    RocketMqConsumer::new(name_server, group, topic)
        .from_first_offset()
        .route_refresh(Duration::from_secs(10))
        .retry_delay(Duration::from_millis(100))
}

#[test]
fn two_members_one_killed_every_message_once() {
    let Some(cluster) = Cluster::start() else { return };
    let cluster = Arc::new(cluster);
    block_on(async {
        let topic = testing::fresh_key("orders").namespace().to_owned();
        let group = format!("billing-{topic}");
        let publisher =
            RocketMqPublisher::start(cluster.name_server_address.as_str(), "orders-producer")
                .await
                .unwrap();
        for id in orders::published() {
            let body = orders::body(id);
            let sent = publisher.publish(&topic, &id.to_string(), body.as_bytes()).await.unwrap();
            assert!(!sent.message_id.is_empty());
        }
        publisher.shutdown().await;

        let store = Arc::new(MemoryStore::new());
        let world = Arc::new(World::default());
        let acked = Arc::new(Mutex::new(0usize));
        let calls = Arc::new(AtomicUsize::new(0));
        let start_member = |doomed: bool| {
            let (store, world, acked) = (store.clone(), world.clone(), acked.clone());
            let calls = calls.clone();
            let consumer = member(&cluster.name_server_address, &group, &topic);
            tokio::spawn(async move {
                let handled = consumer.run(|m| {
                    calls.fetch_add(1, Ordering::SeqCst);
                    let (store, world, acked) = (store.clone(), world.clone(), acked.clone());
                    async move {
                        let id = order_id(&m.body);
                        let result = handle(m, &store, &world, doomed).await;
                        orders::check_recorded_before_ack(&*store, "rocketmq", id, &result, &acked)
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
        // Kill the doomed member mid-handler; its queues go to the other member from
        // the last committed offsets.
        hung.await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        doomed.abort();
        let _ = doomed.await;
        let restarted = start_member(false);

        let expected = World::expected();
        let deadline = Instant::now() + Duration::from_secs(180);
        while world.effects.lock().unwrap().len() < expected {
            let done = world.effects.lock().unwrap().len();
            assert!(Instant::now() < deadline, "stuck: {done}/{expected} done");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // Copies sent back for retry (the killed member's unfinished messages among
        // them) come back after their delay level, and the retry topic's route is
        // refreshed every 10 s: wait until no call has started for 15 s.
        let mut seen = calls.load(Ordering::SeqCst);
        let mut quiet_since = Instant::now();
        while quiet_since.elapsed() < Duration::from_secs(15) {
            assert!(Instant::now() < deadline, "calls never stopped");
            tokio::time::sleep(Duration::from_millis(200)).await;
            let now = calls.load(Ordering::SeqCst);
            if now != seen {
                (seen, quiet_since) = (now, Instant::now());
            }
        }
        let dead = read_dead_letters(&cluster, &group, World::rejected_orders().len()).await;
        steady.abort();
        restarted.abort();
        let _ = (steady.await, restarted.await);

        world.assert_exactly_once();
        assert_eq!(dead, World::rejected_orders(), "exactly the rejected orders are dead-lettered");
        assert!(*acked.lock().unwrap() >= 1_900);

        // The members shut down, persisting their offsets: a new member of the group
        // starts where they left off and finds nothing.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let left = Arc::new(Mutex::new(Vec::new()));
        let probe = {
            let (left, consumer) =
                (left.clone(), member(&cluster.name_server_address, &group, &topic));
            tokio::spawn(async move {
                let run = consumer.run(|m| {
                    left.lock().unwrap().push(order_id(&m.body));
                    async {
                        Ok::<_, idempotent::Error<Fault>>(idempotent::Outcome::<()>::Duplicate)
                    }
                });
                run.await.expect("consuming");
            })
        };
        tokio::time::sleep(Duration::from_secs(5)).await;
        probe.abort();
        let _ = probe.await;
        assert_eq!(*left.lock().unwrap(), Vec::<u64>::new(), "messages left unacknowledged");
    });
}

/// The order ids in the group's dead-letter queue, once `want` of them arrived (or
/// after 60 s).
async fn read_dead_letters(cluster: &Cluster, group: &str, want: usize) -> HashSet<u64> {
    let ids = Arc::new(Mutex::new(HashSet::new()));
    let reader = {
        let ids = ids.clone();
        let consumer = member(
            &cluster.name_server_address,
            &format!("{group}-dead"),
            &format!("%DLQ%{group}"),
        );
        tokio::spawn(async move {
            let run = consumer.run(|m| {
                ids.lock().unwrap().insert(order_id(&m.body));
                async { Ok::<_, idempotent::Error<Fault>>(idempotent::Outcome::Processed(())) }
            });
            run.await.expect("reading the dead letters");
        })
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while ids.lock().unwrap().len() < want && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Anything past `want` would be a wrong dead letter: give it a moment to show.
    tokio::time::sleep(Duration::from_secs(1)).await;
    reader.abort();
    let _ = reader.await;
    ids.lock().unwrap().clone()
}

/// The broker is SIGKILLed while a member consumes and restarted on its store 2 s
/// later; the member's `run`, if the fault ends it, is started again as a supervisor
/// would. Every order takes effect once and rejected orders are dead-lettered.
#[test]
fn a_broker_killed_and_restarted_mid_consumption_every_message_once() {
    let Some(mut cluster) = Cluster::start() else { return };
    let name_server = cluster.name_server_address.clone();
    block_on(async {
        let topic = testing::fresh_key("orders").namespace().to_owned();
        let group = format!("billing-{topic}");
        let publisher =
            RocketMqPublisher::start(name_server.as_str(), "orders-producer").await.unwrap();
        for id in orders::published() {
            publisher.publish(&topic, &id.to_string(), orders::body(id).as_bytes()).await.unwrap();
        }
        publisher.shutdown().await;

        let store = Arc::new(MemoryStore::new());
        let world = Arc::new(World::default());
        let runs_ended = Arc::new(AtomicUsize::new(0));
        let consuming = {
            let (store, world, runs_ended) = (store.clone(), world.clone(), runs_ended.clone());
            let (name_server, group, topic) = (name_server.clone(), group.clone(), topic.clone());
            tokio::spawn(async move {
                loop {
                    let consumer = member(&name_server, &group, &topic);
                    let ran = consumer
                        .run(|m| {
                            let (store, world) = (store.clone(), world.clone());
                            async move {
                                tokio::time::sleep(Duration::from_millis(3)).await;
                                handle(m, &store, &world, false).await
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
            cluster.kill_broker();
            std::thread::sleep(Duration::from_secs(2));
            cluster.restart_broker();
        });
        let expected = World::expected();
        let deadline = Instant::now() + Duration::from_secs(240);
        while world.effects.lock().unwrap().len() < expected {
            let done = world.effects.lock().unwrap().len();
            assert!(Instant::now() < deadline, "stuck: {done}/{expected} done after the restart");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let dead = read_dead_letters(&cluster, &group, World::rejected_orders().len()).await;
        consuming.abort();
        let _ = consuming.await;
        world.assert_exactly_once();
        assert_eq!(dead, World::rejected_orders(), "exactly the rejected orders are dead-lettered");
        eprintln!("run ended {} times", runs_ended.load(Ordering::SeqCst));
    });
}
