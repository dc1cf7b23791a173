//! Redis Streams, end to end: 2,000 published entries of which 20% are redelivered
//! duplicates, two consumers in one group, one killed mid-stream and restarted,
//! retryable and terminal handler errors. Every unique message must take effect
//! exactly once, nothing may be lost, terminal ones must reach the dead-letter stream,
//! and no entry may be acked before its record is written: at the default concurrency
//! and one entry at a time.

mod orders;
mod support;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotent::consume::redis_streams::{StreamConsumer, StreamMessage};
use idempotent::testing::{self, block_on};
use idempotent::{Claim, Key, RedisStore, Store, idempotent};
use orders::{Fault, World, order_id};
use redis::aio::ConnectionManager;

#[idempotent(key = "{/id}", store = store, namespace = "streams", max_attempts = 3, lease = 2)]
async fn handle(
    msg: StreamMessage,
    store: &RedisStore,
    world: &World,
    doomed: bool,
) -> Result<(), Fault> {
    world.process(order_id(msg.body()), doomed).await
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
            (e.id, order_id(&body))
        })
        .collect()
}

#[test]
fn two_consumers_one_killed_every_message_once() {
    scenario(None);
}

#[test]
fn one_entry_at_a_time_every_message_once() {
    scenario(Some(1));
}

/// The scenario, with the consumers' default concurrency or the one given.
fn scenario(concurrency: Option<usize>) {
    block_on(async {
        let Some(store) = support::shared_store().await else {
            return;
        };
        let run = testing::fresh_key("streams").namespace().to_owned();
        let store = Arc::new(store.with_prefix(run.clone()));
        let stream = format!("{run}:orders");
        let mut conn = store.connection_manager().unwrap().clone();

        // Every fifth entry redelivers an earlier order: 1,600 orders, 2,000 entries.
        for id in orders::published() {
            let body = orders::body(id);
            let _: String = redis::cmd("XADD")
                .arg(&stream)
                .arg("*")
                .arg("payload")
                .arg(body)
                .query_async(&mut conn)
                .await
                .unwrap();
        }

        let world = Arc::new(World::default());
        let acked = Arc::new(Mutex::new(Vec::<String>::new()));
        let consumer = |name: &'static str, doomed: bool| {
            let (store, world, acked, stream) =
                (store.clone(), world.clone(), acked.clone(), stream.clone());
            let client = redis::Client::open(support::redis_url()).unwrap();
            async move {
                let consumer = StreamConsumer::new(&client, stream, "billing", name)
                    .await
                    .unwrap()
                    .batch(16)
                    .block(Duration::from_millis(100))
                    .reclaim_idle(Duration::from_millis(500));
                let consumer = match concurrency {
                    Some(n) => consumer.concurrency(n),
                    None => consumer,
                };
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
        // The batch's other calls run beside the hung one: let them record their
        // outcomes first, since a kill between a (non-transactional) effect and its
        // DONE record runs that effect again, at any concurrency.
        hung.await;
        tokio::time::sleep(Duration::from_millis(300)).await;
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
            let expected = World::expected() as u64;
            if pending == 0 && lag == Some(0) && done == expected {
                break;
            }
            let stuck = format!("stuck: {pending} pending, lag {lag:?}, {done}/{expected} done");
            assert!(Instant::now() < deadline, "{stuck}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        a.abort();
        b.abort();

        // Exactly once, nothing lost; terminal ones reached the dead-letter stream.
        world.assert_exactly_once();
        let dead_ids: HashSet<u64> = entries(&mut conn, &dead).await.into_values().collect();
        assert_eq!(
            dead_ids,
            World::rejected_orders(),
            "exactly the rejected orders are dead-lettered"
        );

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
