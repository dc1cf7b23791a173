//! Messages per second on a local MySQL or MariaDB, at concurrency 1 and 16:
//!
//! * (a) `MysqlStore` claim + complete, nothing else;
//! * (b) a `#[idempotent(transactional)]` handler that inserts one business row;
//! * (c) the same by hand: one transaction doing `INSERT IGNORE` into a
//!   processed-keys table, then the business insert, then `COMMIT`;
//! * (d) (b) on a store whose transactional claims are taken inside the handler's
//!   transaction (`TransactionalClaim::InTransaction`).
//!
//! (c) is the classic inbox table. It has no claim, so concurrent duplicates both
//! run their handler and one waits on the other's row lock; (b) pays a claim
//! statement for blocking them up front.
//!
//! `cargo bench -p idempotent-integration --bench mysql_load` (MySQL or MariaDB at
//! `MYSQL_URL`, default `mysql://root@127.0.0.1:3306/test`).

mod load;

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idempotent::mysql_store::TransactionalClaim;
use idempotent::{Key, MysqlStore, Store, Token, Transition, idempotent};
use load::{median, throughput};
use sqlx::mysql::MySqlPoolOptions;
use sqlx::{MySql, MySqlPool, Transaction};

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(60);
const ROUNDS: usize = 3;

static STORE: OnceLock<MysqlStore> = OnceLock::new();
static INLINE: OnceLock<MysqlStore> = OnceLock::new();

struct Msg {
    id: i64,
}

#[idempotent(key = "{id}", namespace = "bench", ttl = 60, lease = 30, store = STORE.get().unwrap(), transactional)]
async fn handler(msg: Msg, tx: &mut Transaction<'_, MySql>) -> Result<i64, sqlx::Error> {
    sqlx::query("INSERT INTO bench_ledger (message_id, amount) VALUES (?, 1)")
        .bind(msg.id)
        .execute(&mut **tx)
        .await?;
    Ok(msg.id)
}

#[idempotent(key = "{id}", namespace = "bench-inline", ttl = 60, lease = 30, store = INLINE.get().unwrap(), transactional)]
async fn inline(msg: Msg, tx: &mut Transaction<'_, MySql>) -> Result<i64, sqlx::Error> {
    sqlx::query("INSERT INTO bench_ledger (message_id, amount) VALUES (?, 1)")
        .bind(msg.id)
        .execute(&mut **tx)
        .await?;
    Ok(msg.id)
}

/// (a): the store's two statements.
async fn claim_and_complete(store: &MysqlStore, id: i64) {
    let key = Key::new("bench-store", id.to_string()).unwrap();
    let idempotent::Claim::Won { token, .. } = store.claim(&key, LEASE, TTL, None).await.unwrap()
    else {
        panic!("fresh key")
    };
    let done = store.complete(&key, token, TTL, None).await.unwrap();
    assert_eq!(done, Transition::Applied);
}

/// (c): the hand-written inbox transaction.
async fn by_hand(pool: &MySqlPool, id: i64) {
    let mut tx = pool.begin().await.unwrap();
    let fresh = sqlx::query("INSERT IGNORE INTO bench_processed (`key`) VALUES (?)")
        .bind(format!("bench:{id}"))
        .execute(&mut *tx)
        .await
        .unwrap();
    assert_eq!(fresh.rows_affected(), 1);
    sqlx::query("INSERT INTO bench_ledger_hand (message_id, amount) VALUES (?, 1)")
        .bind(id)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list" || a == "--test") {
        return; // `cargo test --benches` probes bench binaries; nothing to list.
    }
    let url =
        std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    let pool = MySqlPoolOptions::new().max_connections(24).connect(&url).await.expect("a MySQL");
    let store = MysqlStore::from_pool(pool.clone()).with_table("bench_records").unwrap();
    store.migrate().await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS bench_ledger (message_id bigint NOT NULL, amount bigint NOT NULL);
         CREATE TABLE IF NOT EXISTS bench_ledger_hand (message_id bigint NOT NULL, amount bigint NOT NULL);
         CREATE TABLE IF NOT EXISTS bench_processed (`key` varchar(255) PRIMARY KEY);
         TRUNCATE bench_records; TRUNCATE bench_ledger; TRUNCATE bench_ledger_hand;
         TRUNCATE bench_processed;",
    )
    .execute(&pool)
    .await
    .unwrap();
    STORE.set(store.clone()).unwrap();
    INLINE.set(store.clone().with_transactional_claim(TransactionalClaim::InTransaction)).unwrap();
    let next = AtomicU64::new(Token::random().as_u128() as u64 >> 16);
    let ids = move |n: u64| next.fetch_add(n, Ordering::Relaxed) as i64;

    println!(
        "| concurrency | (a) store msg/s | (b) transactional msg/s | (c) hand-written msg/s | \
         (b)/(c) | (d) claim in transaction msg/s | (d)/(c) |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for (concurrency, total) in [(1usize, 2_000u64), (16, 10_000)] {
        let (mut a, mut b, mut c, mut d) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            let (base, store) = (ids(total), store.clone());
            a.push(
                throughput(concurrency, total, move |i| {
                    let store = store.clone();
                    async move { claim_and_complete(&store, base + i as i64).await }
                })
                .await,
            );
            let base = ids(total);
            b.push(
                throughput(concurrency, total, move |i| async move {
                    let out = handler(Msg { id: base + i as i64 }).await.expect("processed");
                    assert!(out.is_processed());
                })
                .await,
            );
            let (base, pool) = (ids(total), pool.clone());
            c.push(
                throughput(concurrency, total, move |i| {
                    let pool = pool.clone();
                    async move { by_hand(&pool, base + i as i64).await }
                })
                .await,
            );
            let base = ids(total);
            d.push(
                throughput(concurrency, total, move |i| async move {
                    let out = inline(Msg { id: base + i as i64 }).await.expect("processed");
                    assert!(out.is_processed());
                })
                .await,
            );
        }
        let (a, b, c, d) = (median(a), median(b), median(c), median(d));
        println!(
            "| {concurrency} | {a:.0} | {b:.0} | {c:.0} | {:.0}% | {d:.0} | {:.0}% |",
            100.0 * b / c,
            100.0 * d / c
        );
    }
}
