//! Redis Streams, end to end: 2,000 published entries of which 20% are redelivered
//! duplicates, two consumers in one group, one killed mid-stream and restarted,
//! retryable and terminal handler errors. Every unique message must take effect
//! exactly once, nothing may be lost, terminal ones must reach the dead-letter stream,
//! and no entry may be acked before its record is written.

mod support;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotent::consume::redis_streams::{StreamConsumer, StreamMessage};
use idempotent::testing::{self, block_on};
use idempotent::{Claim, Classify, Key, RedisStore, Store, idempotent};
use redis::aio::ConnectionManager;

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
    /// Told when the doomed consumer hangs mid-handler.
    hung: tokio::sync::Notify,
}

/// `doomed`: this consumer hangs mid-handler (before the effect) once 300 orders took
/// effect, and is killed there. (A kill between the effect and its DONE record would
/// run the effect again after the lease: only a transaction spanning both, as the
/// PostgreSQL store's transactional mode gives, closes that window.)
#[idempotent(key = "{/id}", store = store, namespace = "streams", max_attempts = 3, lease = 2)]
async fn handle(
    msg: StreamMessage,
    store: &RedisStore,
    world: &World,
    doomed: bool,
) -> Result<(), Fault> {
    let id = serde_json_id(msg.body());
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

fn serde_json_id(body: &[u8]) -> u64 {
    let value: idempotent::serde_json::Value = idempotent::serde_json::from_slice(body).unwrap();
    value["id"].as_u64().unwrap()
}

/// Entry id → business id, for every entry of `stream`.
async fn entries(conn: &mut ConnectionManager, stream: &str) -> HashMap<String, u64> {
    let reply: redis::streams::StreamRangeReply =
        redis::cmd("XRANGE").arg(stream).arg("-").arg("+").query_async(conn).await.unwrap();
    reply
        .ids
        .into_iter()
        .map(|e| {
            let body: Vec<u8> = redis::from_redis_value(e.map["payload"].clone()).unwrap();
            (e.id, serde_json_id(&body))
        })
        .collect()
}

#[test]
fn two_consumers_one_killed_every_message_once() {
    block_on(async {
        let Some(store) = support::shared_store().await else {
            return;
        };
        let run = testing::fresh_key("streams").namespace().to_owned();
        let store = Arc::new(store.with_prefix(run.clone()));
        let stream = format!("{run}:orders");
        let mut conn = store.connection_manager().unwrap().clone();

        // Every fifth entry redelivers an earlier order: 1,600 orders, 2,000 entries.
        let mut next = 0;
        for i in 0..PUBLISHED {
            let id = if i % 5 == 4 {
                (i * 7) % next
            } else {
                next += 1;
                next - 1
            };
            let body = format!(r#"{{"id":{id},"amount_cents":{}}}"#, 100 + id);
            let _: String = redis::cmd("XADD")
                .arg(&stream)
                .arg("*")
                .arg("payload")
                .arg(body)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
        assert_eq!(next, UNIQUE);

        let world = Arc::new(World::default());
        let acked = Arc::new(Mutex::new(Vec::<String>::new()));
        let consumer = |name: &'static str, doomed: bool| {
            let (store, world, acked, stream) =
                (store.clone(), world.clone(), acked.clone(), stream.clone());
            let conn = conn.clone();
            async move {
                let consumer = StreamConsumer::new(conn, stream, "billing", name)
                    .await
                    .unwrap()
                    .batch(16)
                    .block(Duration::from_millis(100))
                    .reclaim_idle(Duration::from_millis(500));
                loop {
                    let polled =
                        consumer.poll(|m| handle(m, &store, &world, doomed)).await.unwrap();
                    acked.lock().unwrap().extend(polled.acked);
                }
            }
        };
        let hung = world.hung.notified();
        let b = tokio::spawn(consumer("steady", false));
        let a = tokio::spawn(consumer("doomed", true));
        // Kill A mid-handler, with the rest of its batch unacked, then start it again.
        hung.await;
        a.abort();
        let _ = a.await;
        let a = tokio::spawn(consumer("doomed", false));

        let deadline = Instant::now() + Duration::from_secs(60);
        let dead = format!("{stream}:dead");
        loop {
            let pending: Vec<redis::Value> = redis::cmd("XPENDING")
                .arg(&stream)
                .arg("billing")
                .query_async(&mut conn)
                .await
                .unwrap();
            let pending: u64 = redis::from_redis_value(pending[0].clone()).unwrap();
            let groups: Vec<HashMap<String, redis::Value>> = redis::cmd("XINFO")
                .arg("GROUPS")
                .arg(&stream)
                .query_async(&mut conn)
                .await
                .unwrap();
            let lag: Option<u64> = redis::from_redis_value(groups[0]["lag"].clone()).ok();
            let done = world.effects.lock().unwrap().len() as u64;
            let expected = (0..UNIQUE).filter(|&id| !rejected(id)).count() as u64;
            if pending == 0 && lag == Some(0) && done == expected {
                break;
            }
            let stuck = format!("stuck: {pending} pending, lag {lag:?}, {done}/{expected} done");
            assert!(Instant::now() < deadline, "{stuck}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        a.abort();
        b.abort();

        // Exactly once, nothing lost.
        let effects = world.effects.lock().unwrap().clone();
        for id in (0..UNIQUE).filter(|&id| !rejected(id)) {
            assert_eq!(effects.get(&id), Some(&1), "order {id}");
        }
        for id in (0..UNIQUE).filter(|&id| rejected(id)) {
            assert_eq!(effects.get(&id), None, "rejected order {id} took effect");
        }
        // Terminal ones reached the dead-letter stream.
        let dead_ids: HashSet<u64> = entries(&mut conn, &dead).await.into_values().collect();
        for id in (0..UNIQUE).filter(|&id| rejected(id)) {
            assert!(dead_ids.contains(&id), "rejected order {id} is not in {dead}");
        }
        assert!(dead_ids.iter().all(|&id| rejected(id)), "only rejected orders are dead-lettered");
        // Flaky orders were retried, and each took effect once.
        let starts = world.starts.lock().unwrap().clone();
        assert!((0..UNIQUE).filter(|&id| flaky(id)).all(|id| starts[&id] >= 2));

        // No entry was acked before its record was written: every acked entry's key
        // is DONE or FAILED in the store.
        let by_entry = entries(&mut conn, &stream).await;
        let acked: Vec<String> = acked.lock().unwrap().clone();
        assert!(acked.len() >= 1_900, "acked {}", acked.len());
        for entry in acked {
            let key = Key::new("streams", by_entry[&entry].to_string()).unwrap();
            let claim = store.claim(&key, testing::LEASE, testing::TTL, None).await.unwrap();
            assert!(
                matches!(claim, Claim::Done | Claim::Failed { .. }),
                "entry {entry}: {claim:?}"
            );
        }
        let _: () = redis::cmd("DEL").arg(&stream).arg(&dead).query_async(&mut conn).await.unwrap();
    });
}
