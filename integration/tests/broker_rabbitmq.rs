//! RabbitMQ, end to end: 2,000 published messages of which 20% are redelivered
//! duplicates, two consumers, one hung mid-handler and killed with its connection,
//! then restarted; retryable and terminal handler errors. Every unique message must
//! take effect exactly once, nothing may be lost, terminal ones must reach the
//! dead-letter queue, and no delivery may be acked before its record is written: at
//! the default concurrency and one delivery at a time.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotent::consume::rabbitmq::{RabbitConsumer, RabbitMessage, declare_with_dead_letter};
use idempotent::testing::{self, block_on};
use idempotent::{MemoryStore, idempotent};
use lapin::options::{BasicGetOptions, BasicPublishOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use orders::{Fault, World, order_id};

mod orders;

#[idempotent(key = "{/id}", store = store, namespace = "rabbit", max_attempts = 3, lease = 2)]
async fn handle(
    msg: RabbitMessage,
    store: &MemoryStore,
    world: &World,
    doomed: bool,
) -> Result<(), Fault> {
    world.process(order_id(&msg.body), doomed).await
}

async fn connect() -> Option<Connection> {
    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    match Connection::connect(&url, ConnectionProperties::default()).await {
        Ok(c) => Some(c),
        Err(e) => {
            assert!(std::env::var_os("CI").is_none(), "CI needs RabbitMQ at {url}: {e}");
            eprintln!("skipped: no RabbitMQ at {url} ({e})");
            None
        }
    }
}

async fn ready(channel: &Channel, queue: &str) -> u32 {
    let passive = QueueDeclareOptions { passive: true, ..Default::default() };
    channel
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
        .unwrap()
        .message_count()
}

#[test]
fn two_consumers_one_killed_every_message_once() {
    scenario(None);
}

#[test]
fn one_delivery_at_a_time_every_message_once() {
    scenario(Some(1));
}

/// The scenario, with the consumers' default concurrency or the one given.
fn scenario(concurrency: Option<usize>) {
    block_on(async {
        let Some(publisher) = connect().await else { return };
        let queue = testing::fresh_key("orders").namespace().to_owned();
        let channel = publisher.create_channel().await.unwrap();
        let dead = declare_with_dead_letter(&channel, &queue).await.unwrap();
        for id in orders::published() {
            let body = orders::body(id);
            let props = BasicProperties::default();
            let options = BasicPublishOptions::default();
            channel
                .basic_publish("".into(), queue.as_str().into(), options, body.as_bytes(), props)
                .await
                .unwrap()
                .await
                .unwrap();
        }

        let store = Arc::new(MemoryStore::new());
        let world = Arc::new(World::default());
        let acked = Arc::new(Mutex::new(0usize));
        let consumer = |tag: &'static str, doomed: bool| {
            let (store, world, acked, queue) =
                (store.clone(), world.clone(), acked.clone(), queue.clone());
            async move {
                let connection = connect().await.unwrap();
                let channel = connection.create_channel().await.unwrap();
                channel.basic_qos(64, BasicQosOptions::default()).await.unwrap();
                let consumer = RabbitConsumer::new(&channel, &queue, tag)
                    .await
                    .unwrap()
                    .retry_delay(Duration::from_millis(50));
                let consumer = match concurrency {
                    Some(n) => consumer.concurrency(n),
                    None => consumer,
                };
                let task = tokio::spawn(async move {
                    let handled = consumer.run(|m| {
                        let (store, world, acked) = (store.clone(), world.clone(), acked.clone());
                        async move {
                            let id = order_id(&m.body);
                            let result = handle(m, &store, &world, doomed).await;
                            orders::check_recorded_before_ack(
                                &*store, "rabbit", id, &result, &acked,
                            )
                            .await;
                            result
                        }
                    });
                    handled.await.expect("settling");
                });
                (connection, task)
            }
        };
        let hung = world.hung.notified();
        let (_steady_conn, steady) = consumer("steady", false).await;
        let (doomed_conn, doomed) = consumer("doomed", true).await;
        // Kill the doomed consumer mid-handler: its task and its connection, without
        // acking what it holds; the broker requeues those. Then start it again.
        // Other calls of the doomed consumer in flight at that moment finish first (a
        // kill between an effect and its DONE record runs that effect again, at any
        // concurrency).
        hung.await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        doomed.abort();
        let _ = doomed.await;
        // Aborting the task may already have begun closing its channel: then the
        // connection refuses a clean close, which is as good a kill.
        let _ = doomed_conn.close(320, "killed".into()).await;
        let (_restarted_conn, restarted) = consumer("doomed", false).await;

        let expected = World::expected();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let done = world.effects.lock().unwrap().len();
            if done == expected && ready(&channel, &queue).await == 0 {
                break;
            }
            assert!(Instant::now() < deadline, "stuck: {done}/{expected} done");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Let in-flight deliveries settle, then stop.
        tokio::time::sleep(Duration::from_millis(300)).await;
        steady.abort();
        restarted.abort();

        world.assert_exactly_once();

        let mut dead_ids = HashSet::new();
        while let Some(message) =
            channel.basic_get(dead.as_str().into(), BasicGetOptions { no_ack: true }).await.unwrap()
        {
            dead_ids.insert(order_id(&message.delivery.data));
        }
        let want = World::rejected_orders();
        assert_eq!(dead_ids, want, "exactly the rejected orders are dead-lettered");
        assert!(*acked.lock().unwrap() >= 1_900);
        for q in [&queue, &dead] {
            channel.queue_delete(q.as_str().into(), Default::default()).await.unwrap();
        }
    });
}
