//! What each kind of guard costs, on a local PostgreSQL and MariaDB, at concurrency 1
//! and 16. Every variant applies the same business effect to a fresh order: mark it
//! PAID and insert a charge row, in one transaction.
//!
//! * no guard: the effect alone (`BEGIN`, `UPDATE`, `INSERT`, `COMMIT`), the floor;
//! * claim store: an `#[idempotent]` handler on the database's store running that
//!   transaction (a claim before it, DONE after it, each a statement of its own);
//! * transactional: `#[idempotent(transactional)]`, the effect and DONE in one
//!   transaction;
//! * state guard: `NoStore` and a `StateGuard` UNPAID → PAID in place of the `UPDATE`;
//! * versioned: `NoStore`, the row's version read, then a `VersionGuard` update.
//!
//! `cargo bench -p idempotent-integration --bench guards_load` (`DATABASE_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`; `MYSQL_URL`, default
//! `mysql://root@127.0.0.1:3306/test`).

mod load;

use std::sync::atomic::{AtomicI64, Ordering};

use idempotent::Classify;
use idempotent::guard::{StateRefused, VersionRefused};
use load::{median, throughput};

const ROUNDS: usize = 3;
const RUNS: [(usize, u64); 2] = [(1, 1_000), (16, 5_000)];
/// Orders each database starts with: one fresh order per message of every run.
const ORDERS: i64 = ROUNDS as i64 * 5 * (1_000 + 5_000);

#[derive(Debug, thiserror::Error, Classify)]
enum GuardError {
    #[error(transparent)]
    #[idempotent(transparent)]
    Db(#[from] sqlx::Error),
    #[error(transparent)]
    #[idempotent(transparent)]
    State(#[from] StateRefused<String>),
    #[error(transparent)]
    #[idempotent(transparent)]
    Version(#[from] VersionRefused),
}

/// The next fresh order ids.
static NEXT: AtomicI64 = AtomicI64::new(1);

fn fresh(n: u64) -> i64 {
    NEXT.fetch_add(n as i64, Ordering::Relaxed)
}

/// The variants for one database: its sqlx type, store, pool, and the SQL of the
/// effect with its placeholders.
macro_rules! guard_variants {
    ($module:ident, $name:literal, $db:ty, $store:ty, $pool:ty, $update:literal, $insert:literal, $version:literal) => {
        mod $module {
            use std::sync::{LazyLock, OnceLock};

            use idempotent::guard::{StateGuard, Table, VersionGuard};
            use idempotent::{NoStore, idempotent};
            use sqlx::Transaction;

            use super::*;

            pub static STORE: OnceLock<$store> = OnceLock::new();
            static PAY: LazyLock<StateGuard<String>> = LazyLock::new(|| {
                Table::new("gb_orders", "id").unwrap().state("status", ["UNPAID"], "PAID").unwrap()
            });
            static VERSION: LazyLock<VersionGuard> = LazyLock::new(|| {
                Table::new("gb_orders", "id").unwrap().versioned("version").unwrap()
            });

            async fn effect(tx: &mut Transaction<'_, $db>, id: i64) -> Result<(), sqlx::Error> {
                let paid = sqlx::query($update).bind(id).execute(&mut **tx).await?;
                assert_eq!(paid.rows_affected(), 1);
                charge(tx, id).await
            }

            async fn charge(tx: &mut Transaction<'_, $db>, id: i64) -> Result<(), sqlx::Error> {
                sqlx::query($insert).bind(id).execute(&mut **tx).await?;
                Ok(())
            }

            pub async fn unguarded(pool: &$pool, id: i64) -> Result<(), sqlx::Error> {
                let mut tx = pool.begin().await?;
                effect(&mut tx, id).await?;
                tx.commit().await
            }

            #[idempotent(key = "{id}", namespace = "gb-claim", store = STORE.get().unwrap())]
            pub async fn claimed(id: i64, pool: &$pool) -> Result<(), sqlx::Error> {
                unguarded(pool, id).await
            }

            #[idempotent(key = "{id}", namespace = "gb-tx", store = STORE.get().unwrap(), transactional)]
            pub async fn transactional(
                id: i64,
                tx: &mut Transaction<'_, $db>,
            ) -> Result<(), sqlx::Error> {
                effect(tx, id).await
            }

            #[idempotent(key = "{id}", namespace = "gb-state", store = NoStore)]
            pub async fn state(id: i64, pool: &$pool) -> Result<(), GuardError> {
                let mut tx = pool.begin().await?;
                PAY.apply(&mut *tx, id).await?.into_result()?;
                charge(&mut tx, id).await?;
                Ok(tx.commit().await?)
            }

            #[idempotent(key = "{id}", namespace = "gb-version", store = NoStore)]
            pub async fn versioned(id: i64, pool: &$pool) -> Result<(), GuardError> {
                let mut tx = pool.begin().await?;
                let version: i64 = sqlx::query_scalar($version).bind(id).fetch_one(&mut *tx).await?;
                VERSION.set("status", "PAID").apply(&mut *tx, id, version).await?.into_result()?;
                charge(&mut tx, id).await?;
                Ok(tx.commit().await?)
            }

            /// Fresh tables, `ORDERS` orders UNPAID at version 0.
            pub async fn prepare(pool: &$pool) {
                let store = <$store>::from_pool(pool.clone()).with_table("gb_records").unwrap();
                store.migrate().await.unwrap();
                for sql in [
                    "DROP TABLE IF EXISTS gb_orders, gb_charges",
                    "CREATE TABLE gb_orders (id BIGINT PRIMARY KEY, status VARCHAR(16) NOT NULL, version BIGINT NOT NULL)",
                    "CREATE TABLE gb_charges (order_id BIGINT NOT NULL, cents BIGINT NOT NULL)",
                    "DELETE FROM gb_records",
                ] {
                    sqlx::query(sql).execute(pool).await.unwrap();
                }
                for first in (1..=ORDERS).step_by(1_000) {
                    let rows: Vec<String> = (first..first + 1_000)
                        .map(|id| format!("({id}, 'UNPAID', 0)"))
                        .collect();
                    let sql = format!("INSERT INTO gb_orders VALUES {}", rows.join(", "));
                    sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(pool).await.unwrap();
                }
                STORE.set(store).ok();
            }

            /// One table row per concurrency: messages per second of each variant.
            pub async fn run(pool: &$pool) {
                NEXT.store(1, Ordering::Relaxed);
                prepare(pool).await;
                for (concurrency, total) in RUNS {
                    let mut rates: [Vec<f64>; 5] = Default::default();
                    for _ in 0..ROUNDS {
                        for (variant, rates) in rates.iter_mut().enumerate() {
                            let (base, pool) = (fresh(total), pool.clone());
                            let rate = throughput(concurrency, total, move |i| {
                                let pool = pool.clone();
                                async move {
                                    let id = base + i as i64;
                                    match variant {
                                        0 => unguarded(&pool, id).await.unwrap(),
                                        1 => assert!(claimed(id, &pool).await.unwrap().is_processed()),
                                        2 => assert!(transactional(id).await.unwrap().is_processed()),
                                        3 => assert!(state(id, &pool).await.unwrap().is_processed()),
                                        _ => assert!(versioned(id, &pool).await.unwrap().is_processed()),
                                    }
                                }
                            });
                            rates.push(rate.await);
                        }
                    }
                    let [none, rest @ ..] = rates.map(median);
                    let cells: Vec<String> =
                        rest.iter().map(|r| format!("{r:.0} ({:.0}%)", 100.0 * r / none)).collect();
                    println!("| {} | {concurrency} | {none:.0} | {} |", $name, cells.join(" | "));
                }
            }
        }
    };
}

guard_variants!(
    postgres,
    "PostgreSQL",
    sqlx::Postgres,
    idempotent::PostgresStore,
    sqlx::PgPool,
    "UPDATE gb_orders SET status = 'PAID' WHERE id = $1 AND status = 'UNPAID'",
    "INSERT INTO gb_charges VALUES ($1, 500)",
    "SELECT version FROM gb_orders WHERE id = $1"
);
guard_variants!(
    mysql,
    "MariaDB",
    sqlx::MySql,
    idempotent::MysqlStore,
    sqlx::MySqlPool,
    "UPDATE gb_orders SET status = 'PAID' WHERE id = ? AND status = 'UNPAID'",
    "INSERT INTO gb_charges VALUES (?, 500)",
    "SELECT version FROM gb_orders WHERE id = ?"
);

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list" || a == "--test") {
        return; // `cargo test --benches` probes bench binaries; nothing to list.
    }
    let env = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
    let pg = env("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let my = env("MYSQL_URL", "mysql://root@127.0.0.1:3306/test");
    println!(
        "| database | concurrency | no guard msg/s | claim store | transactional | state guard | \
         versioned |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(24).connect(&pg);
    postgres::run(&pool.await.expect("a PostgreSQL")).await;
    let pool = sqlx::mysql::MySqlPoolOptions::new().max_connections(24).connect(&my);
    mysql::run(&pool.await.expect("a MySQL or MariaDB")).await;
}
