//! `RedisStore` when Redis misbehaves: each test runs its own `redis-server`, kills it
//! or its connections at a chosen moment, and checks that no message is lost and none
//! is marked done without its handler succeeding.

mod support;

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use idempotent::testing::block_on;
use idempotent::{Error, Outcome, RedisStore, idempotent};
use support::RedisServer;
use tokio::sync::Notify;

struct Order {
    order_id: u64,
}

#[derive(Debug, thiserror::Error, idempotent::Classify)]
#[error("never")]
#[idempotent(retryable)]
struct Never;

/// A handler that counts its runs in `runs`.
#[idempotent(key = "order:{order_id}", store = store)]
async fn counted(msg: Order, store: &RedisStore, runs: &AtomicU32) -> Result<(), Never> {
    let _ = msg;
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(())
}

/// Retries `call` (as a broker redelivers) until it gives something other than a
/// store error that says the handler did not run.
async fn redeliver_until_store_answers<F, Fut>(mut call: F) -> Result<Outcome<()>, Error<Never>>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Outcome<()>, Error<Never>>>,
{
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        match call().await {
            Err(Error::Store { handler_ran: false, .. }) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            other => return other,
        }
    }
}

#[test]
fn redis_killed_before_claim() {
    if !support::have_redis_server() {
        return;
    }
    let mut server = RedisServer::start();
    block_on(async {
        let runs = AtomicU32::new(0);
        let store = RedisStore::connect(server.url()).await.unwrap();
        server.kill();
        let err = counted(Order { order_id: 1 }, &store, &runs).await.unwrap_err();
        assert!(matches!(err, Error::Store { handler_ran: false, .. }), "{err}");
        assert_eq!(err.disposition(), idempotent::Disposition::Retry);
        assert_eq!(runs.load(Ordering::SeqCst), 0, "the handler must not run");

        // The same store, not a new one: it reconnects by itself.
        server.restart();
        let out = redeliver_until_store_answers(|| counted(Order { order_id: 1 }, &store, &runs));
        assert_eq!(out.await.unwrap(), Outcome::Processed(()));
        let again = counted(Order { order_id: 1 }, &store, &runs).await;
        assert_eq!(again.unwrap(), Outcome::Duplicate);
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    });
}

#[test]
fn redis_killed_between_claim_and_complete() {
    if !support::have_redis_server() {
        return;
    }
    let mut server = RedisServer::start_persistent();
    block_on(async {
        static RUNS: AtomicU32 = AtomicU32::new(0);
        static STARTED: Notify = Notify::const_new();
        static FINISH: Notify = Notify::const_new();
        // Recording DONE is retried for half the lease before the call gives up; the
        // redelivery below must still come within the lease.
        #[idempotent(key = "order:{order_id}", store = store, lease = 3)]
        async fn handle(msg: Order, store: &RedisStore, hold: bool) -> Result<(), Never> {
            let _ = msg;
            RUNS.fetch_add(1, Ordering::SeqCst);
            if hold {
                STARTED.notify_one();
                FINISH.notified().await;
            }
            Ok(())
        }

        let store = RedisStore::connect(server.url()).await.unwrap();
        let first = handle(Order { order_id: 7 }, &store, true);
        let crash = async {
            STARTED.notified().await;
            server.kill();
            FINISH.notify_one();
        };
        let (first, ()) = tokio::join!(first, crash);
        let err = first.unwrap_err();
        assert!(matches!(err, Error::Store { handler_ran: true, .. }), "{err}");
        assert_eq!(RUNS.load(Ordering::SeqCst), 1);

        // The claim survived the restart (append-only file): until its lease runs out
        // a redelivery is told the message is in progress, not run a second time at once.
        server.restart();
        let out =
            redeliver_until_store_answers(|| handle(Order { order_id: 7 }, &store, false)).await;
        assert!(matches!(out.unwrap(), Outcome::InProgress { .. }));
        tokio::time::sleep(Duration::from_millis(3_200)).await;
        let out =
            redeliver_until_store_answers(|| handle(Order { order_id: 7 }, &store, false)).await;
        assert_eq!(out.unwrap(), Outcome::Processed(()), "the message is not lost");
        assert_eq!(RUNS.load(Ordering::SeqCst), 2);
    });
}

#[test]
fn connections_dropped_and_restored_mid_stream() {
    if !support::have_redis_server() {
        return;
    }
    let server = RedisServer::start();
    block_on(async {
        static RUNS: [AtomicU32; 200] = [const { AtomicU32::new(0) }; 200];
        #[idempotent(key = "order:{order_id}", store = store)]
        async fn handle(msg: Order, store: &RedisStore) -> Result<(), Never> {
            RUNS[msg.order_id as usize].fetch_add(1, Ordering::SeqCst);
            Ok(())
        }

        let store = RedisStore::connect(server.url()).await.unwrap();
        let mut store_errors = 0;
        for id in 0..200u64 {
            if id % 50 == 25 {
                let killed = server.cli(&["client", "kill", "type", "normal"]);
                assert!(!killed.contains("ERR"), "{killed}");
            }
            // A consumer loop: redeliver until the outcome is recorded.
            loop {
                match handle(Order { order_id: id }, &store).await {
                    Ok(Outcome::Processed(())) | Ok(Outcome::Duplicate) => break,
                    Err(Error::Store { handler_ran: false, .. }) => store_errors += 1,
                    other => panic!("order {id}: {other:?}"),
                }
            }
        }
        for (id, runs) in RUNS.iter().enumerate() {
            assert_eq!(runs.load(Ordering::SeqCst), 1, "order {id}");
        }
        eprintln!("{store_errors} deliveries met a dropped connection and were redelivered");
    });
}

#[test]
fn scripts_are_reloaded_after_a_flush() {
    if !support::have_redis_server() {
        return;
    }
    let server = RedisServer::start();
    block_on(async {
        let runs = AtomicU32::new(0);
        let store = RedisStore::connect(server.url()).await.unwrap();
        let first = counted(Order { order_id: 1 }, &store, &runs).await;
        assert_eq!(first.unwrap(), Outcome::Processed(()));
        // A restart or failover loses loaded scripts; EVALSHA then answers NOSCRIPT.
        assert!(server.cli(&["script", "flush"]).contains("OK"));
        let second = counted(Order { order_id: 2 }, &store, &runs).await;
        assert_eq!(second.unwrap(), Outcome::Processed(()));
        let again = counted(Order { order_id: 2 }, &store, &runs).await;
        assert_eq!(again.unwrap(), Outcome::Duplicate);
        assert_eq!(runs.load(Ordering::SeqCst), 2);
    });
}

/// The claim ran on the server but its reply was lost on the way back. The claim is
/// given back, attempt and all: with `max_attempts = 1`, the next delivery runs the
/// handler instead of finding the key abandoned without it ever having run.
#[test]
fn a_lost_claim_reply_gives_the_claim_back() {
    if !support::have_redis_server() {
        return;
    }
    let server = RedisServer::start();
    block_on(async {
        static RUNS: AtomicU32 = AtomicU32::new(0);
        #[idempotent(key = "order:{order_id}", store = store, lease = 1, max_attempts = 1)]
        async fn once(msg: Order, store: &RedisStore) -> Result<(), Never> {
            let _ = msg;
            RUNS.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }

        let proxy = support::FaultProxy::start(server.port).await;
        let store = RedisStore::connect(proxy.url()).await.unwrap();
        // Loads the scripts, so that the lost reply is the claim's own.
        assert_eq!(once(Order { order_id: 1 }, &store).await.unwrap(), Outcome::Processed(()));

        proxy.lose_next_reply();
        let err = once(Order { order_id: 2 }, &store).await.unwrap_err();
        assert!(matches!(err, Error::Store { handler_ran: false, .. }), "{err}");
        assert_eq!(proxy.lost(), 1);
        let record = server.cli(&["--no-raw", "keys", "*:order:2"]);
        assert!(record.contains("order:2"), "the claim ran on the server: {record}");

        let deadline = Instant::now() + Duration::from_secs(5);
        let out = loop {
            match once(Order { order_id: 2 }, &store).await {
                Ok(Outcome::InProgress { .. }) | Err(Error::Store { handler_ran: false, .. })
                    if Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                other => break other,
            }
        };
        assert!(matches!(out, Ok(Outcome::Processed(()))), "{out:?}");
        assert_eq!(RUNS.load(Ordering::SeqCst), 2);
    });
}
