//! Claim + complete per second on each server-backed store, through the `Store` API
//! (the two round trips every message makes), at concurrency 1 and 64: ZooKeeper,
//! Redis and PostgreSQL on this machine, each with its default settings.
//!
//! `cargo bench -p idempotent-integration --bench store_compare` (`ZOOKEEPER_HOSTS`,
//! default `127.0.0.1:2181`; `REDIS_URL`, default `redis://127.0.0.1:6379`;
//! `DATABASE_URL`, default `postgres://postgres@127.0.0.1:5432/test`).

mod load;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idempotent::{Claim, Key, PostgresStore, RedisStore, Store, Transition, ZooKeeperStore};
use load::{median, throughput};

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(60);
const ROUNDS: usize = 5;

static RUN: AtomicU64 = AtomicU64::new(0);

/// Claim + complete of `total` fresh keys with `concurrency` workers; messages/s.
async fn rate(store: Arc<dyn Store>, concurrency: usize, total: u64) -> f64 {
    let run = RUN.fetch_add(1, Ordering::Relaxed);
    let namespace = format!("cmp{}-{run}", std::process::id());
    throughput(concurrency, total, move |i| {
        let (store, key) = (store.clone(), Key::new(&namespace, i.to_string()).unwrap());
        async move {
            let Claim::Won { token, .. } = store.claim(&key, LEASE, TTL, None).await.unwrap()
            else {
                panic!("a fresh key must be won")
            };
            let done = store.complete(&key, token, TTL, None).await.unwrap();
            assert_eq!(done, Transition::Applied);
        }
    })
    .await
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let env =
            |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
        let zookeeper = env("ZOOKEEPER_HOSTS", "127.0.0.1:2181");
        let redis = env("REDIS_URL", "redis://127.0.0.1:6379");
        let postgres = env("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
        let zookeeper: Arc<dyn Store> = Arc::new(
            ZooKeeperStore::connect_with(&zookeeper, "/idempotent-bench", Duration::from_secs(10))
                .await
                .expect("ZooKeeper"),
        );
        let redis: Arc<dyn Store> =
            Arc::new(RedisStore::connect(redis.as_str()).await.expect("Redis"));
        let pg = PostgresStore::connect(&postgres).await.expect("PostgreSQL");
        pg.migrate().await.expect("migration");
        let postgres: Arc<dyn Store> = Arc::new(pg);
        println!("| store | concurrency 1 msg/s | concurrency 64 msg/s |");
        println!("| --- | --- | --- |");
        for (name, store) in
            [("ZooKeeperStore", zookeeper), ("RedisStore", redis), ("PostgresStore", postgres)]
        {
            let mut row = Vec::new();
            for (concurrency, total) in [(1, 2_000), (64, 20_000)] {
                let mut rates = Vec::new();
                for _ in 0..ROUNDS {
                    rates.push(rate(store.clone(), concurrency, total).await);
                }
                row.push(median(rates));
            }
            println!("| `{name}` | {:.0} | {:.0} |", row[0], row[1]);
        }
    });
}
