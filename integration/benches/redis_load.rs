//! Messages per second through `#[idempotent]` on a local Redis, against two
//! hand-written `redis`-crate loops, at concurrency 1 and 64 over one multiplexed
//! connection: one that sends the store's own two commands per message (the claim's
//! `SET NX GET` of a record, the finish script), and the minimal
//! two-phase protocol a careful engineer writes by hand (claim: `SET key token NX PX
//! lease`, and on failure `GET` to tell done from in progress; complete: compare the
//! token, `SET key done EX ttl`; no attempt count, no fingerprint, no cached result).
//! Then the p99 latency of a claim against a plain `SET NX PX` on the same connection.
//!
//! `cargo bench -p idempotent-integration --bench redis_load` (Redis at `REDIS_URL`, default
//! `redis://127.0.0.1:6379`).

mod load;

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use load::{median, p99, throughput};

use idempotent::redis_store::FINISH_SCRIPT;
use idempotent::{Key, RedisStore, Store, Token, idempotent};
use redis::Script;
use redis::aio::ConnectionManager;

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(60);
const ROUNDS: usize = 5;

static STORE: OnceLock<RedisStore> = OnceLock::new();
static NEXT: AtomicU64 = AtomicU64::new(0);

struct Msg {
    id: u64,
}

#[derive(Debug, thiserror::Error, idempotent::Classify)]
#[error("never")]
#[idempotent(retryable)]
struct Never;

#[idempotent(key = "{id}", namespace = "bench", ttl = 60, lease = 30, store = STORE.get().unwrap())]
async fn handler(msg: Msg) -> Result<u64, Never> {
    Ok(msg.id)
}

/// The same protocol by hand: the claim's `SET NX GET` of a fresh record, then the
/// finish script, same keys and args.
async fn by_hand(conn: &mut ConnectionManager, run: u64, id: u64) -> u64 {
    static FINISH: OnceLock<Script> = OnceLock::new();
    let finish = FINISH.get_or_init(|| Script::new(FINISH_SCRIPT));
    let key = format!("idempotent:hand{run}:{id}");
    let token = Token::random().to_string();
    let retention = idempotent::claim_retention(LEASE, TTL).as_millis();
    let record = format!("P{token} {} 1 - ", retention - LEASE.as_millis());
    let found: Option<String> = redis::cmd("SET")
        .arg(&key)
        .arg(record)
        .arg("NX")
        .arg("PX")
        .arg(retention.to_string())
        .arg("GET")
        .query_async(conn)
        .await
        .expect("claim");
    assert_eq!(found, None);
    let done: i64 = finish
        .key(&key)
        .arg(&token)
        .arg("D")
        .arg(TTL.as_millis().to_string())
        .arg("")
        .invoke_async(conn)
        .await
        .expect("finish");
    assert_eq!(done, 1);
    id
}

/// The minimal two-phase protocol, one script per phase.
const MINIMAL_CLAIM: &str = r"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 'W' end
if redis.call('GET', KEYS[1]) == 'done' then return 'D' end
return 'P'
";
const MINIMAL_COMPLETE: &str = r"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], 'done', 'EX', ARGV[2])
return 1
";

async fn minimal(conn: &mut ConnectionManager, run: u64, id: u64) -> u64 {
    static CLAIM: OnceLock<Script> = OnceLock::new();
    static COMPLETE: OnceLock<Script> = OnceLock::new();
    let claim = CLAIM.get_or_init(|| Script::new(MINIMAL_CLAIM));
    let complete = COMPLETE.get_or_init(|| Script::new(MINIMAL_COMPLETE));
    let key = format!("idempotent:minimal{run}:{id}");
    let token = Token::random().to_string();
    let state: String = claim
        .key(&key)
        .arg(&token)
        .arg(LEASE.as_millis().to_string())
        .invoke_async(conn)
        .await
        .expect("claim");
    assert_eq!(state, "W");
    let done: i64 = complete
        .key(&key)
        .arg(&token)
        .arg(TTL.as_secs().to_string())
        .invoke_async(conn)
        .await
        .expect("complete");
    assert_eq!(done, 1);
    id
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list" || a == "--test") {
        return; // `cargo test --benches` probes bench binaries; nothing to list.
    }
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let store = RedisStore::connect(url.as_str()).await.expect("a Redis to benchmark against");
    STORE.set(store.clone()).unwrap();
    // Keys unique to this run: earlier runs' records may still be within their ttl.
    NEXT.store((Token::random().as_u128() as u64) & !((1 << 48) - 1), Ordering::Relaxed);
    // The hand-written loop and the SET NX baseline share the store's connection.
    let conn = store.connection_manager().expect("a standalone Redis").clone();

    println!(
        "| concurrency | #[idempotent] msg/s | same commands by hand msg/s | ratio | minimal protocol msg/s | ratio |"
    );
    println!("| --- | --- | --- | --- | --- | --- |");
    for (concurrency, total) in [(1usize, 5_000u64), (64, 40_000)] {
        let (mut macro_rates, mut hand_rates, mut minimal_rates) =
            (Vec::new(), Vec::new(), Vec::new());
        for round in 0..ROUNDS {
            let base = NEXT.fetch_add(1 << 32, Ordering::Relaxed);
            macro_rates.push(
                throughput(concurrency, total, move |i| async move {
                    let out = handler(Msg { id: base + i }).await.expect("processed");
                    assert!(out.is_processed());
                })
                .await,
            );
            let run = round as u64 + (concurrency as u64) * 1000 + base;
            let by_hand_conn = conn.clone();
            hand_rates.push(
                throughput(concurrency, total, move |i| {
                    let mut conn = by_hand_conn.clone();
                    async move {
                        by_hand(&mut conn, run, i).await;
                    }
                })
                .await,
            );
            let minimal_conn = conn.clone();
            minimal_rates.push(
                throughput(concurrency, total, move |i| {
                    let mut conn = minimal_conn.clone();
                    async move {
                        minimal(&mut conn, run, i).await;
                    }
                })
                .await,
            );
        }
        let (m, h, n) = (median(macro_rates), median(hand_rates), median(minimal_rates));
        println!("| {concurrency} | {m:.0} | {h:.0} | {:.2}× | {n:.0} | {:.2}× |", m / h, m / n);
    }

    println!();
    println!("| concurrency | claim p99 | SET NX PX p99 | ratio |");
    println!("| --- | --- | --- | --- |");
    for (concurrency, per_worker) in [(1usize, 5_000usize), (64, 400)] {
        let (mut claims, mut sets) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            let store = store.clone();
            claims.push(
                p99(concurrency, per_worker, move || {
                    let store = store.clone();
                    async move {
                        let id = NEXT.fetch_add(1, Ordering::Relaxed);
                        let key = Key::new("bench-claim", id.to_string()).unwrap();
                        store.claim(&key, LEASE, TTL, None).await.expect("claim");
                    }
                })
                .await
                .as_secs_f64(),
            );
            let conn = conn.clone();
            sets.push(
                p99(concurrency, per_worker, move || {
                    let mut conn = conn.clone();
                    async move {
                        let id = NEXT.fetch_add(1, Ordering::Relaxed);
                        let _: Option<String> = redis::cmd("SET")
                            .arg(format!("idempotent:bench-set:{id}"))
                            .arg(1)
                            .arg("NX")
                            .arg("PX")
                            .arg(30_000)
                            .query_async(&mut conn)
                            .await
                            .expect("SET");
                    }
                })
                .await
                .as_secs_f64(),
            );
        }
        let (c, s) = (median(claims), median(sets));
        println!("| {concurrency} | {:.0} µs | {:.0} µs | {:.2}× |", c * 1e6, s * 1e6, c / s);
    }
}
