//! The Redis Streams consumer's own guarantees, with plain handlers whose runs are
//! counted: quiet polls are not errors and lose nothing, a slow batch keeps its
//! entries from other consumers, a dead letter is copied only by the entry's owner,
//! a zero block time does not wait for ever, and entries a producer can write but
//! that are awkward to parse or copy (binary field names, thousands of fields) are
//! settled like any other instead of stalling the consumer.

mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotent::consume::redis_streams::{StreamConsumer, StreamMessage};
use idempotent::testing::{self, block_on};
use idempotent::{Error, Outcome};
use redis::aio::ConnectionManager;

type Settled = Result<Outcome<()>, Error<std::io::Error>>;

/// A fresh stream name and a connection for publishing, or `None` without Redis.
async fn stream() -> Option<(String, ConnectionManager, redis::Client)> {
    let store = support::shared_store().await?;
    let conn = store.connection_manager().unwrap().clone();
    let client = redis::Client::open(support::redis_url()).unwrap();
    Some((format!("{}:s", testing::fresh_key("consumer").namespace()), conn, client))
}

async fn publish(conn: &mut ConnectionManager, stream: &str, n: usize) {
    for i in 0..n {
        let _: String = redis::cmd("XADD")
            .arg(stream)
            .arg("*")
            .arg("payload")
            .arg(format!(r#"{{"n":{i}}}"#))
            .query_async(conn)
            .await
            .unwrap();
    }
}

async fn xadd(conn: &mut ConnectionManager, stream: &str, fields: &[(&[u8], &[u8])]) -> String {
    let mut cmd = redis::cmd("XADD");
    cmd.arg(stream).arg("*");
    for (k, v) in fields {
        cmd.arg(*k).arg(*v);
    }
    cmd.query_async(conn).await.unwrap()
}

async fn pending(conn: &mut ConnectionManager, stream: &str) -> i64 {
    let reply: redis::Value =
        redis::cmd("XPENDING").arg(stream).arg("g").query_async(conn).await.unwrap();
    match reply {
        redis::Value::Array(items) => match items.first() {
            Some(redis::Value::Int(n)) => *n,
            _ => -1,
        },
        _ => -1,
    }
}

async fn delete(conn: &mut ConnectionManager, keys: &[&str]) {
    let _: () = redis::cmd("DEL").arg(keys).query_async(conn).await.unwrap();
}

/// With the default block time, a quiet poll answers an empty batch instead of
/// timing out, and entries published while a read blocks are all delivered by reads,
/// none left pending unseen until the reclaim time.
#[test]
fn quiet_polls_are_empty_and_lose_nothing() {
    block_on(async {
        let Some((stream, mut conn, client)) = stream().await else { return };
        let consumer = StreamConsumer::new(&client, &stream, "g", "c1").await.unwrap();
        for _ in 0..3 {
            let polled = consumer.poll(|_| async { Settled::Ok(Outcome::Processed(())) }).await;
            assert_eq!(polled.unwrap(), Default::default());
        }
        let mut publisher = conn.clone();
        let stream_name = stream.clone();
        let publishing = tokio::spawn(async move {
            for _ in 0..7 {
                publish(&mut publisher, &stream_name, 3).await;
                tokio::time::sleep(Duration::from_millis(230)).await;
            }
        });
        let mut seen = 0;
        let deadline = Instant::now() + Duration::from_secs(10);
        while seen < 21 && Instant::now() < deadline {
            let polled = consumer.poll(|_| async { Settled::Ok(Outcome::Processed(())) }).await;
            seen += polled.unwrap().acked.len();
        }
        publishing.await.unwrap();
        assert_eq!(seen, 21, "entries were left pending unseen");
        delete(&mut conn, &[&stream]).await;
    });
}

/// A batch whose handling takes longer than the reclaim idle time keeps its
/// entries: the consumer touches them while it works, so another consumer does not
/// reclaim and run them too.
#[test]
fn a_slow_batch_keeps_its_entries() {
    block_on(async {
        let Some((stream, mut conn, client)) = stream().await else { return };
        let runs: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
        let idle = Duration::from_millis(600);
        let slow = StreamConsumer::new(&client, &stream, "g", "slow").await.unwrap();
        let slow = slow.batch(4).reclaim_idle(idle);
        let rival = StreamConsumer::new(&client, &stream, "g", "rival").await.unwrap();
        let rival = rival.batch(4).reclaim_idle(idle).block(Duration::from_millis(50));
        publish(&mut conn, &stream, 4).await;
        let count = |runs: Arc<Mutex<HashMap<String, u32>>>, pause: Duration| {
            move |m: StreamMessage| {
                *runs.lock().unwrap().entry(m.id.clone()).or_default() += 1;
                async move {
                    tokio::time::sleep(pause).await;
                    Settled::Ok(Outcome::Processed(()))
                }
            }
        };
        // 4 entries × 400 ms: the last is handled 1.2 s after the read. The rival
        // starts once the slow consumer holds the batch, so it can only reclaim.
        let started = tokio::sync::Notify::new();
        let counting = count(runs.clone(), Duration::from_millis(400));
        let working = slow.poll(|m| {
            started.notify_one();
            counting(m)
        });
        let poaching = async {
            started.notified().await;
            let until = Instant::now() + Duration::from_millis(2_000);
            while Instant::now() < until {
                rival.poll(count(runs.clone(), Duration::ZERO)).await.unwrap();
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        let (polled, ()) = tokio::join!(working, poaching);
        assert_eq!(polled.unwrap().acked.len(), 4);
        let runs = runs.lock().unwrap().clone();
        assert_eq!(runs.len(), 4);
        assert!(runs.values().all(|&n| n == 1), "entries ran twice: {runs:?}");
        delete(&mut conn, &[&stream]).await;
    });
}

/// An entry that another consumer took over while its first owner still handled it
/// is not copied to the dead-letter stream by the first owner.
#[test]
fn only_the_owner_dead_letters_an_entry() {
    block_on(async {
        let Some((stream, mut conn, client)) = stream().await else { return };
        let dead = format!("{stream}:dead");
        let first = StreamConsumer::new(&client, &stream, "g", "first").await.unwrap();
        publish(&mut conn, &stream, 1).await;
        let takeover = conn.clone();
        let stream_name = stream.clone();
        let polled = first
            .poll(move |m: StreamMessage| {
                let (mut takeover, stream) = (takeover.clone(), stream_name.clone());
                async move {
                    // Another consumer claims the entry and finishes it meanwhile.
                    let _: redis::Value = redis::cmd("XCLAIM")
                        .arg(&stream)
                        .arg("g")
                        .arg("second")
                        .arg(0)
                        .arg(&m.id)
                        .query_async(&mut takeover)
                        .await
                        .unwrap();
                    let _: i64 = redis::cmd("XACK")
                        .arg(&stream)
                        .arg("g")
                        .arg(&m.id)
                        .query_async(&mut takeover)
                        .await
                        .unwrap();
                    Settled::Err(Error::Terminal {
                        error: std::io::ErrorKind::InvalidData.into(),
                        attempt: 1,
                        exhausted: false,
                    })
                }
            })
            .await
            .unwrap();
        assert!(polled.dead_lettered.is_empty(), "{polled:?}");
        assert_eq!(polled.taken_over.len(), 1);
        let copies: usize = redis::cmd("XLEN").arg(&dead).query_async(&mut conn).await.unwrap();
        assert_eq!(copies, 0, "a copy of someone else's entry was dead-lettered");
        delete(&mut conn, &[&stream, &dead]).await;
    });
}

/// A zero block time reads without blocking; it is not Redis's `BLOCK 0`.
#[test]
fn a_zero_block_time_does_not_wait_for_ever() {
    block_on(async {
        let Some((stream, mut conn, client)) = stream().await else { return };
        let consumer = StreamConsumer::new(&client, &stream, "g", "c").await.unwrap();
        let consumer = consumer.block(Duration::ZERO);
        let poll = consumer.poll(|_| async { Settled::Ok(Outcome::Processed(())) });
        let polled = tokio::time::timeout(Duration::from_secs(3), poll).await;
        assert_eq!(polled.expect("the read blocked").unwrap(), Default::default());
        delete(&mut conn, &[&stream]).await;
    });
}

/// Polls for `seconds`, dead-lettering everything, until `wanted` are dead-lettered;
/// returns what was dead-lettered, the poll errors, and how many entries are left
/// pending. Deletes the stream and its dead-letter stream.
async fn dead_letter_all(
    consumer: &StreamConsumer,
    conn: &mut ConnectionManager,
    stream: &str,
    wanted: &[String],
    seconds: u64,
) -> (Vec<String>, Vec<String>, i64) {
    let (mut dead_lettered, mut errors) = (Vec::<String>::new(), Vec::new());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(seconds);
    while tokio::time::Instant::now() < deadline
        && !wanted.iter().all(|id| dead_lettered.contains(id))
    {
        let terminal = |_: StreamMessage| async {
            Settled::Err(Error::Terminal {
                error: std::io::ErrorKind::InvalidData.into(),
                attempt: 1,
                exhausted: false,
            })
        };
        match consumer.poll(terminal).await {
            Ok(polled) => dead_lettered.extend(polled.dead_lettered),
            Err(e) => errors.push(e.to_string()),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let left = pending(conn, stream).await;
    delete(conn, &[stream, &format!("{stream}:dead")]).await;
    errors.dedup();
    (dead_lettered, errors, left)
}

/// An entry with a field name that is not UTF-8 (Redis field names are binary) is
/// settled like any other, and the entries read with it are not held up.
#[tokio::test]
async fn an_entry_with_a_binary_field_name_does_not_stall_the_consumer() {
    let Some((stream, mut conn, client)) = stream().await else { return };
    let consumer = StreamConsumer::new(&client, &stream, "g", "c1").await.unwrap();
    let consumer =
        consumer.reclaim_idle(Duration::from_millis(200)).block(Duration::from_millis(50));
    let odd =
        xadd(&mut conn, &stream, &[(b"payload", br#"{"id":1}"#), (b"trace-\xff", b"x")]).await;
    let good = xadd(&mut conn, &stream, &[(b"payload", br#"{"id":2}"#)]).await;
    let later = xadd(&mut conn, &stream, &[(b"payload", br#"{"id":3}"#)]).await;
    let wanted = [odd, good, later];
    let (dead, errors, left) = dead_letter_all(&consumer, &mut conn, &stream, &wanted, 5).await;
    assert!(
        wanted.iter().all(|id| dead.contains(id)),
        "entries were never handed to the handler: {left} still pending; dead-lettered \
         {dead:?}; poll errors: {errors:?}"
    );
}

/// An entry with more fields than a Lua script can pass to one command is still
/// dead-lettered, not retried for ever.
#[tokio::test]
async fn an_entry_with_many_fields_is_dead_lettered() {
    let Some((stream, mut conn, client)) = stream().await else { return };
    let consumer = StreamConsumer::new(&client, &stream, "g", "c1").await.unwrap();
    let consumer =
        consumer.reclaim_idle(Duration::from_millis(200)).block(Duration::from_millis(50));
    let names: Vec<String> = (0..4100).map(|i| format!("attr{i}")).collect();
    let mut fields: Vec<(&[u8], &[u8])> = vec![(b"payload", br#"{"id":1}"#)];
    fields.extend(names.iter().map(|n| (n.as_bytes(), b"v".as_slice())));
    let id = xadd(&mut conn, &stream, &fields).await;
    let wanted = [id];
    let (dead, errors, left) = dead_letter_all(&consumer, &mut conn, &stream, &wanted, 3).await;
    assert_eq!(dead, wanted, "never dead-lettered ({left} pending); poll errors: {errors:?}");
}

static SAME_KEY_RUNS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

#[idempotent::idempotent(key = "{/n}", store = store, namespace = "same_batch")]
async fn slow_once(msg: StreamMessage, store: &idempotent::RedisStore) {
    let _ = msg;
    SAME_KEY_RUNS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// Two deliveries of one key in one batch run at the same time and meet: the one
/// that answered `InProgress` is handled again after the batch and settles as a
/// duplicate in the same poll, instead of waiting pending for the reclaim time. At
/// concurrency 1 they never meet.
#[tokio::test]
async fn a_key_delivered_twice_in_one_batch_settles_in_one_poll() {
    let Some((stream, mut conn, client)) = stream().await else { return };
    let store = support::shared_store().await.unwrap();
    let store = store.with_prefix(testing::fresh_key("same-batch").namespace().to_owned());
    for concurrency in [32, 1] {
        publish(&mut conn, &stream, 1).await;
        publish(&mut conn, &stream, 1).await;
        let consumer = StreamConsumer::new(&client, &stream, "g", format!("c{concurrency}"));
        let consumer = consumer.await.unwrap().concurrency(concurrency);
        let polled = consumer.poll(|m| slow_once(m, &store)).await.unwrap();
        assert_eq!(polled.acked.len(), 2, "concurrency {concurrency}: {polled:?}");
        assert_eq!(pending(&mut conn, &stream).await, 0);
    }
    assert_eq!(SAME_KEY_RUNS.load(std::sync::atomic::Ordering::SeqCst), 1, "one run");
    delete(&mut conn, &[&stream]).await;
}

/// Fails every time, retryably, on `NoStore`, noting the delivery count it ran at.
#[idempotent::idempotent(key = "{/n}", store = idempotent::NoStore, max_attempts = 3)]
async fn streams_always_flaky(
    msg: StreamMessage,
    seen: &Mutex<Vec<Option<u32>>>,
) -> Result<(), std::io::Error> {
    seen.lock().unwrap().push(idempotent::delivery::delivery_count());
    Err(std::io::ErrorKind::TimedOut.into())
}

/// A handler on `NoStore` takes its attempt from the group's delivery count (read
/// from the pending list when the entry is reclaimed), so `max_attempts`
/// dead-letters an entry that keeps failing retryably.
#[tokio::test]
async fn on_no_store_the_attempt_is_the_delivery_count() {
    let Some((stream, mut conn, client)) = stream().await else { return };
    let consumer = StreamConsumer::new(&client, &stream, "g", "c1").await.unwrap();
    let consumer =
        consumer.reclaim_idle(Duration::from_millis(100)).block(Duration::from_millis(50));
    publish(&mut conn, &stream, 1).await;
    let seen = Mutex::new(Vec::new());
    let mut dead = Vec::new();
    for _ in 0..40 {
        let polled = consumer.poll(|m| streams_always_flaky(m, &seen)).await.unwrap();
        dead.extend(polled.dead_lettered);
        if !dead.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(dead.len(), 1, "never dead-lettered; ran at {:?}", seen.lock().unwrap());
    assert_eq!(*seen.lock().unwrap(), [Some(1), Some(2), Some(3)]);
    delete(&mut conn, &[&stream, &format!("{stream}:dead")]).await;
}

/// A message that fails retryably four times is reclaimed only once its handler's
/// backoff (`"200ms..2s"`) is over, while messages published meanwhile are handled
/// at once; the fifth attempt succeeds. Twice: with the default reclaim idle time,
/// where every delay is written as the entry's idle time, and with a 300 ms one,
/// which the 800 ms and 1.6 s delays outlast, so the consumer keeps those entries
/// touched until what is left of their delay fits.
#[test]
fn retries_wait_by_the_backoff_without_holding_up_the_rest() {
    for reclaim_idle in [None, Some(Duration::from_millis(300))] {
        block_on(async {
            let Some((stream, conn, client)) = stream().await else { return };
            let consumer = StreamConsumer::new(&client, &stream, "g", "c1").await.unwrap();
            let consumer = consumer.block(Duration::from_millis(50)).concurrency(8);
            let consumer = match reclaim_idle {
                Some(idle) => consumer.reclaim_idle(idle),
                None => consumer,
            };
            let log = backoff::Log::default();
            let polls = async {
                loop {
                    let handled = consumer.poll(|m: StreamMessage| {
                        let log = log.clone();
                        async move { backoff::attempt(backoff::Job::of(m.body()), &log).await }
                    });
                    handled.await.unwrap();
                }
            };
            let scenario = async {
                log.publish_all(|id| {
                    let (mut conn, stream) = (conn.clone(), stream.clone());
                    async move {
                        xadd(&mut conn, &stream, &[(b"payload", id.as_bytes())]).await;
                    }
                })
                .await;
                log.wait(Duration::from_secs(20)).await;
            };
            tokio::select! {
                never = polls => never,
                () = scenario => {}
            }
            log.check(Duration::from_millis(300), Duration::from_millis(300));
            delete(&mut conn.clone(), &[&stream]).await;
        });
    }
}

#[path = "support/backoff.rs"]
mod backoff;

/// A poll whose settling fails after some of its entries were left for retry (here
/// a dead letter cannot be written: the dead-letter key holds a string) still keeps
/// those entries back for their retry delay. Otherwise they are reclaimed after the
/// reclaim idle time, however long their handler's backoff asked to wait.
#[test]
fn a_failed_settle_still_delays_the_batch_retries() {
    block_on(async {
        let Some((stream, mut conn, client)) = stream().await else { return };
        let dead = format!("{stream}:dead");
        let idle = Duration::from_millis(400);
        let delay = Duration::from_secs(3);
        let consumer = StreamConsumer::new(&client, &stream, "g", "c1").await.unwrap();
        let consumer = consumer.reclaim_idle(idle).block(Duration::from_millis(50)).concurrency(1);
        let retried = xadd(&mut conn, &stream, &[(b"payload", b"retry")]).await;
        xadd(&mut conn, &stream, &[(b"payload", b"dead")]).await;
        let _: () =
            redis::cmd("SET").arg(&dead).arg("not a stream").query_async(&mut conn).await.unwrap();
        let handler = |m: StreamMessage| async move {
            if m.body() == b"retry" {
                Settled::Err(Error::Retryable {
                    error: std::io::ErrorKind::TimedOut.into(),
                    attempt: 1,
                    retry_after: delay,
                })
            } else {
                Settled::Err(Error::PayloadMismatch)
            }
        };
        let failed = consumer.poll(handler).await;
        let left = Instant::now();
        assert!(failed.is_err(), "the dead letter could not be written: {failed:?}");
        delete(&mut conn, &[&dead]).await;
        let mut back = None;
        while back.is_none() && left.elapsed() < delay + Duration::from_secs(3) {
            let polled = consumer
                .poll(|m: StreamMessage| async move {
                    let _ = m;
                    Settled::Ok(Outcome::Processed(()))
                })
                .await
                .unwrap();
            if polled.acked.contains(&retried) {
                back = Some(left.elapsed());
            }
        }
        let back = back.expect("the retried entry came back");
        assert!(
            back + Duration::from_millis(50) >= delay,
            "the entry left for retry with a {delay:?} delay came back after {back:?} \
             (the reclaim idle time is {idle:?})"
        );
        delete(&mut conn, &[&stream, &dead]).await;
    });
}

#[path = "support/effects.rs"]
mod effects;

/// A graceful stop mid-stream, as a deploy does: the poll under way finishes (its
/// calls return and its entries are acked), no other poll starts, and a second
/// consumer of the group handles the rest. Each entry's effect (counted by its
/// handler, which is not idempotent itself) happens once, and nothing is left pending.
#[test]
fn a_graceful_stop_finishes_the_poll_under_way_and_doubles_nothing() {
    block_on(async {
        let Some((stream, mut conn, client)) = stream().await else { return };
        publish(&mut conn, &stream, 30).await;
        let effects = effects::Effects::default();
        let handler = |m: StreamMessage| {
            let effects = &effects;
            async move {
                let entry = String::from_utf8(m.body().to_vec()).unwrap();
                effects.take(entry, Duration::from_millis(300)).await;
                Settled::Ok(Outcome::Processed(()))
            }
        };
        let first = StreamConsumer::new(&client, &stream, "g", "first")
            .await
            .unwrap()
            .batch(8)
            .concurrency(4);
        let stopped = first.run_until(handler, effects.ended(2));
        tokio::time::timeout(Duration::from_secs(20), stopped).await.unwrap().unwrap();
        let by_first = effects.every_call_finished();
        assert!((2..30).contains(&by_first), "{by_first} handled: the stop took no effect");
        assert_eq!(
            pending(&mut conn, &stream).await,
            0,
            "the stopped consumer left entries pending"
        );
        let second = StreamConsumer::new(&client, &stream, "g", "second").await.unwrap();
        let rest = second.run_until(handler, effects.all(30, Duration::from_millis(300)));
        tokio::time::timeout(Duration::from_secs(20), rest).await.unwrap().unwrap();
        let twice = effects.doubled();
        assert!(twice.is_empty(), "effects doubled: {twice:?} (first consumer handled {by_first})");
        delete(&mut conn, &[&stream]).await;
    });
}
