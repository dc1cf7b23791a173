//! RabbitMQ, end to end: 2,000 published messages of which 20% are redelivered
//! duplicates, two consumers, one hung mid-handler and killed with its connection,
//! then restarted; retryable and terminal handler errors. Every unique message must
//! take effect exactly once, nothing may be lost, terminal ones must reach the
//! dead-letter queue, and no delivery may be acked before its record is written.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotent::consume::rabbitmq::{RabbitConsumer, RabbitMessage, declare_with_dead_letter};
use idempotent::testing::{self, block_on};
use idempotent::{
    Claim, Classify, Disposition, DispositionExt, Key, MemoryStore, Store, idempotent,
};
use lapin::options::{BasicGetOptions, BasicPublishOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

const UNIQUE: u64 = 1_600;
const PUBLISHED: u64 = 2_000;

#[derive(Debug, thiserror::Error, Classify)]
enum Fault {
    #[error("database timed out")]
    #[idempotent(retryable)]
    Flaky,
    #[error("order rejected")]
    #[idempotent(terminal)]
    Rejected,
}

fn rejected(id: u64) -> bool {
    id % 100 == 13
}

fn flaky(id: u64) -> bool {
    id % 50 == 7
}

#[derive(Default)]
struct World {
    effects: Mutex<HashMap<u64, u32>>,
    starts: Mutex<HashMap<u64, u32>>,
    hung: tokio::sync::Notify,
}

#[idempotent(key = "{/id}", store = store, namespace = "rabbit", max_attempts = 3, lease = 2)]
async fn handle(
    msg: RabbitMessage,
    store: &MemoryStore,
    world: &World,
    doomed: bool,
) -> Result<(), Fault> {
    let id = order_id(&msg.body);
    let start = {
        let mut starts = world.starts.lock().unwrap();
        let n = starts.entry(id).or_default();
        *n += 1;
        *n
    };
    if rejected(id) {
        return Err(Fault::Rejected);
    }
    if flaky(id) && start == 1 {
        return Err(Fault::Flaky);
    }
    if doomed && world.effects.lock().unwrap().len() >= 300 {
        world.hung.notify_one();
        std::future::pending::<()>().await;
    }
    *world.effects.lock().unwrap().entry(id).or_default() += 1;
    Ok(())
}

fn order_id(body: &[u8]) -> u64 {
    let value: idempotent::serde_json::Value = idempotent::serde_json::from_slice(body).unwrap();
    value["id"].as_u64().unwrap()
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
    channel.queue_declare(queue, passive, FieldTable::default()).await.unwrap().message_count()
}

#[test]
fn two_consumers_one_killed_every_message_once() {
    block_on(async {
        let Some(publisher) = connect().await else { return };
        let queue = testing::fresh_key("orders").namespace().to_owned();
        let channel = publisher.create_channel().await.unwrap();
        let dead = declare_with_dead_letter(&channel, &queue).await.unwrap();
        let mut next = 0;
        for i in 0..PUBLISHED {
            let id = if i % 5 == 4 {
                (i * 7) % next
            } else {
                next += 1;
                next - 1
            };
            let body = format!(r#"{{"id":{id},"amount_cents":{}}}"#, 100 + id);
            let props = BasicProperties::default();
            let options = BasicPublishOptions::default();
            channel
                .basic_publish("", &queue, options, body.as_bytes(), props)
                .await
                .unwrap()
                .await
                .unwrap();
        }
        assert_eq!(next, UNIQUE);

        let store = Arc::new(MemoryStore::new());
        let world = Arc::new(World::default());
        let acked = Arc::new(Mutex::new(0usize));
        let consumer = |tag: &'static str, doomed: bool| {
            let (store, world, acked, queue) =
                (store.clone(), world.clone(), acked.clone(), queue.clone());
            async move {
                let connection = connect().await.unwrap();
                let channel = connection.create_channel().await.unwrap();
                channel.basic_qos(16, BasicQosOptions::default()).await.unwrap();
                let mut consumer = RabbitConsumer::new(&channel, &queue, tag).await.unwrap();
                let task = tokio::spawn({
                    async move {
                        loop {
                            let settled = consumer.next(|m| async {
                                let id = order_id(&m.body);
                                let result = handle(m, &store, &world, doomed).await;
                                if result.disposition() == Disposition::Ack {
                                    // The ack comes right after this: the record must be written.
                                    let key = Key::new("rabbit", id.to_string()).unwrap();
                                    let claim = store
                                        .claim(&key, testing::LEASE, testing::TTL, None)
                                        .await
                                        .unwrap();
                                    assert!(
                                        matches!(claim, Claim::Done | Claim::Failed { .. }),
                                        "{id}: {claim:?}"
                                    );
                                    *acked.lock().unwrap() += 1;
                                }
                                result
                            });
                            settled.await.expect("consuming").expect("settling");
                        }
                    }
                });
                (connection, task)
            }
        };
        let hung = world.hung.notified();
        let (_steady_conn, steady) = consumer("steady", false).await;
        let (doomed_conn, doomed) = consumer("doomed", true).await;
        // Kill the doomed consumer mid-handler: its task and its connection, without
        // acking what it holds; the broker requeues those. Then start it again.
        hung.await;
        doomed.abort();
        let _ = doomed.await;
        doomed_conn.close(320, "killed").await.unwrap();
        let (_restarted_conn, restarted) = consumer("doomed", false).await;

        let expected = (0..UNIQUE).filter(|&id| !rejected(id)).count();
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

        let effects = world.effects.lock().unwrap().clone();
        for id in 0..UNIQUE {
            let want = if rejected(id) { None } else { Some(&1) };
            assert_eq!(effects.get(&id), want, "order {id}");
        }
        let starts = world.starts.lock().unwrap().clone();
        assert!(
            (0..UNIQUE).filter(|&id| flaky(id)).all(|id| starts[&id] >= 2),
            "flaky ones retried"
        );

        let mut dead_ids = HashSet::new();
        while let Some(message) =
            channel.basic_get(&dead, BasicGetOptions { no_ack: true }).await.unwrap()
        {
            dead_ids.insert(order_id(&message.delivery.data));
        }
        let want: HashSet<u64> = (0..UNIQUE).filter(|&id| rejected(id)).collect();
        assert_eq!(dead_ids, want, "exactly the rejected orders are dead-lettered");
        assert!(*acked.lock().unwrap() >= 1_900);
        for q in [&queue, &dead] {
            channel.queue_delete(q, Default::default()).await.unwrap();
        }
    });
}
