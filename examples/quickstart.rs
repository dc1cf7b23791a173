//! A consumer under at-least-once delivery.
//!
//! A small simulated broker redelivers anything not acked. The stream has duplicate
//! publishes, a consumer crash mid-handler, a database timeout that succeeds on
//! retry, a terminal error and a message that times out on every attempt.
//!
//! `cargo run --example quickstart` uses the in-memory store;
//! `REDIS_URL=redis://127.0.0.1:6379 cargo run --example quickstart --features redis`
//! uses Redis.

use std::collections::{HashMap, VecDeque};
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use idempotent::{Classify, Disposition, DispositionExt, MemoryStore, Store, idempotent};

#[derive(Debug, Clone)]
struct OrderPlaced {
    order_id: u64,
    amount_cents: i64,
}

#[derive(Debug, thiserror::Error, Classify)]
enum PayError {
    #[error("database timed out")]
    #[idempotent(retryable)]
    DbTimeout,
    #[error("insufficient funds")]
    #[idempotent(terminal)]
    InsufficientFunds,
}

/// What the world saw: how many times each order was charged.
static CHARGES: LazyLock<Mutex<HashMap<u64, u32>>> = LazyLock::new(Default::default);
/// How many times each order's handler body started.
static STARTS: LazyLock<Mutex<HashMap<u64, u32>>> = LazyLock::new(Default::default);

#[idempotent(key = "order:{order_id}", ttl = "10m", lease = "5s", max_attempts = 3)]
async fn charge(msg: OrderPlaced) -> Result<u64, PayError> {
    let start = {
        let mut starts = STARTS.lock().unwrap();
        let n = starts.entry(msg.order_id).or_default();
        *n += 1;
        *n
    };
    match (msg.order_id, start) {
        (3, 1) => return Err(PayError::DbTimeout), // flaky once, then fine
        (4, 1) => tokio::time::sleep(Duration::from_secs(60)).await, // the consumer dies here
        (6, _) => return Err(PayError::DbTimeout), // down for good
        _ => {}
    }
    if msg.amount_cents > 10_000 {
        return Err(PayError::InsufficientFunds);
    }
    *CHARGES.lock().unwrap().entry(msg.order_id).or_default() += 1;
    Ok(msg.order_id)
}

/// Redis when `REDIS_URL` is set, the in-memory store otherwise.
async fn store() -> Box<dyn Store> {
    match std::env::var("REDIS_URL") {
        #[cfg(feature = "redis")]
        Ok(url) => {
            // A prefix of this run's own: earlier runs' records are still within their ttl.
            let prefix = format!("quickstart-{}", idempotent::Token::random());
            let redis = idempotent::RedisStore::options()
                .prefix(prefix.as_str())
                .connect(url.as_str())
                .await
                .expect("Redis at REDIS_URL");
            println!("store: Redis at {url}, keys under {prefix}:");
            Box::new(redis)
        }
        #[cfg(not(feature = "redis"))]
        Ok(_) => panic!("REDIS_URL is set: run with `--features redis` to use Redis"),
        Err(_) => {
            println!("store: in memory (set REDIS_URL and add --features redis for Redis)");
            Box::new(MemoryStore::new())
        }
    }
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt().with_target(false).without_time().init();
    idempotent::set_default_store(store().await).expect("set once, at start-up");

    // Orders 1..=6 published, 1 and 2 twice (producer retries), 5 is too expensive.
    let mut broker: VecDeque<OrderPlaced> = [1, 2, 1, 3, 4, 2, 5, 6]
        .into_iter()
        .map(|id| OrderPlaced { order_id: id, amount_cents: if id == 5 { 99_999 } else { 1_000 } })
        .collect();
    let (mut delivered, mut processed, mut duplicates, mut retried) = (0, 0, 0, 0);
    let mut dead_letters = Vec::new();

    while let Some(msg) = broker.pop_front() {
        delivered += 1;
        // Order 4's first attempt hangs; the consumer is killed after 50 ms and the
        // unacked message comes back, as a broker would redeliver it.
        let Ok(result) = tokio::time::timeout(Duration::from_millis(50), charge(msg.clone())).await
        else {
            println!("order {}: consumer crashed mid-handler, message redelivered", msg.order_id);
            retried += 1;
            broker.push_back(msg);
            continue;
        };
        match result.disposition() {
            Disposition::Ack if result.as_ref().is_ok_and(|o| o.is_processed()) => processed += 1,
            Disposition::Ack => duplicates += 1,
            Disposition::Retry => {
                retried += 1;
                broker.push_back(msg.clone());
            }
            Disposition::DeadLetter => dead_letters.push(msg.order_id),
        }
        match result {
            Ok(outcome) => println!("order {}: {outcome:?}", msg.order_id),
            Err(error) => println!("order {}: {error}", msg.order_id),
        }
    }

    println!();
    println!("  delivered                  {delivered:>3}");
    println!("  processed exactly once     {processed:>3}");
    println!("  duplicates skipped         {duplicates:>3}");
    println!("  redelivered for retry      {retried:>3}");
    println!("  dead-lettered              {:>3}  {dead_letters:?}", dead_letters.len());

    let charges = CHARGES.lock().unwrap().clone();
    let expected: HashMap<u64, u32> = [(1, 1), (2, 1), (3, 1), (4, 1)].into();
    assert_eq!(charges, expected, "every good order charged exactly once, bad ones never");
    assert_eq!(dead_letters, [5, 6], "the terminal and the exhausted order are dead-lettered");
    println!("\nok: every order took effect exactly once; nothing was lost");
}
