//! The SQL stores' connection pool as users size it, against the machine's PostgreSQL
//! and MySQL or MariaDB: `connect_with` takes the pool's options; more calls at once
//! than the pool has connections are paced by it and say so in a warning that tells
//! what to change; a call that gets no connection in time, and a server that takes
//! none, fail with errors that say which of the two happened. Each test runs on both
//! databases, with its own table.

#[path = "support/log_capture.rs"]
mod log_capture;
#[path = "support/mysql.rs"]
mod mysql;

use std::time::Duration;

use idempotent::{Classify, Error, Outcome, idempotent};
use log_capture::log;
use tokio::sync::Notify;

#[derive(Debug, thiserror::Error, Classify)]
#[error("database: {0}")]
#[idempotent(transparent)]
struct DbError(#[from] sqlx::Error);

/// The captured log lines that contain every one of `parts`.
fn logged(parts: &[&str]) -> Vec<String> {
    let log = log();
    let text = String::from_utf8_lossy(&log.lock().unwrap()).into_owned();
    text.lines().filter(|line| parts.iter().all(|p| line.contains(p))).map(str::to_owned).collect()
}

const POOL_WARNING: &str = "a call waited for one of the idempotency store pool's connections";

/// The same tests for each database: `$store` is the store type, `$options` its pool
/// options, `$db` sqlx's database, `$url` the server's URL, `$pool_size` a size no
/// other test in this file uses (the warning's lines are told apart by it).
macro_rules! pool_tests {
    ($name:ident, $store:ty, $options:ty, $db:ty, $url:expr, $closed_url:expr, $pool_size:expr) => {
        mod $name {
            use super::*;

            struct Bank {
                store: $store,
                gate: Notify,
                holding: Notify,
                hold: bool,
                runs: std::sync::atomic::AtomicUsize,
            }

            #[idempotent(key = "pay:{id}", store = bank.store, transactional, lease = "10s")]
            async fn pay(
                id: u32,
                bank: &Bank,
                tx: &mut sqlx::Transaction<'_, $db>,
            ) -> Result<(), DbError> {
                sqlx::query("SELECT 1").execute(&mut **tx).await?;
                bank.runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if bank.hold {
                    bank.holding.notify_one();
                    bank.gate.notified().await;
                } else {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                Ok(())
            }

            /// A store on a pool made with `options`, in a table of its own.
            async fn store(options: $options) -> Option<$store> {
                let url = $url;
                let store = match <$store>::connect_with(&url, options).await {
                    Ok(store) => store,
                    Err(e) => {
                        assert!(std::env::var_os("CI").is_none(), "CI needs {url}: {e}");
                        eprintln!("skipped: no server at {url} ({e})");
                        return None;
                    }
                };
                let store = store.with_table(&mysql::table("pool")).unwrap();
                store.migrate().await.unwrap();
                Some(store)
            }

            fn bank(store: $store, hold: bool) -> Bank {
                Bank {
                    store,
                    gate: Notify::new(),
                    holding: Notify::new(),
                    hold,
                    runs: Default::default(),
                }
            }

            /// Eight transactional calls at once on a pool of fewer connections: all
            /// are processed, once each, paced by the pool, and a warning names the
            /// pool's size and what to change.
            #[test]
            fn more_calls_than_connections_are_paced_and_say_so() {
                log();
                idempotent::testing::block_on(async {
                    let size: u32 = $pool_size;
                    let options = <$options>::new().max_connections(size);
                    let Some(store) = store(options).await else { return };
                    assert_eq!(store.pool().options().get_max_connections(), size);
                    let bank = bank(store, false);
                    let calls = (0..8).map(|id| pay(id, &bank));
                    for outcome in futures_util::future::join_all(calls).await {
                        assert!(matches!(outcome, Ok(Outcome::Processed(()))), "{outcome:?}");
                    }
                    assert_eq!(bank.runs.load(std::sync::atomic::Ordering::SeqCst), 8);
                    let size = format!("max_connections={size}");
                    let warnings = logged(&[POOL_WARNING, &size, "WARN"]);
                    assert_eq!(warnings.len(), 1, "warned once a minute: {warnings:?}");
                    assert!(warnings[0].contains("connect_with"), "{}", warnings[0]);
                });
            }

            /// One connection, held by a call whose handler waits: a second call gets
            /// none within the acquire timeout and fails before its handler with an
            /// error that says the pool was full and how to size it; delivered again
            /// once the first is done, it is processed.
            #[test]
            fn a_call_that_gets_no_connection_says_the_pool_is_full() {
                idempotent::testing::block_on(async {
                    let options = <$options>::new()
                        .max_connections(1)
                        .acquire_timeout(Duration::from_millis(500));
                    let Some(store) = store(options).await else { return };
                    let bank = bank(store, true);
                    let first = pay(1, &bank);
                    let second = async {
                        bank.holding.notified().await;
                        let refused = pay(2, &bank).await;
                        bank.gate.notify_one();
                        refused
                    };
                    let (first, refused) = futures_util::join!(first, second);
                    assert!(matches!(first, Ok(Outcome::Processed(()))), "{first:?}");
                    let Err(Error::Store { error, handler_ran: false, .. }) = &refused else {
                        panic!("{refused:?}");
                    };
                    let text = error.to_string();
                    assert!(
                        text.contains("none of the store pool's 1 connections came free")
                            && text.contains("max_connections"),
                        "{text}"
                    );
                    // Lets the redelivery's handler through as soon as it waits.
                    bank.gate.notify_one();
                    let again = pay(2, &bank).await;
                    assert!(matches!(again, Ok(Outcome::Processed(()))), "{again:?}");
                    assert_eq!(bank.runs.load(std::sync::atomic::Ordering::SeqCst), 2);
                });
            }

            /// A server that refuses connections: `connect_with` says so after the
            /// acquire timeout, instead of sqlx's "pool timed out".
            #[test]
            fn a_server_that_takes_no_connection_is_named() {
                idempotent::testing::block_on(async {
                    let options = <$options>::new().acquire_timeout(Duration::from_millis(500));
                    let error = <$store>::connect_with($closed_url, options).await.unwrap_err();
                    let text = error.to_string();
                    assert!(
                        text.contains("the database accepted no connection within 500ms"),
                        "{text}"
                    );
                });
            }
        }
    };
}

pool_tests!(
    postgres,
    idempotent::PostgresStore,
    sqlx::postgres::PgPoolOptions,
    sqlx::Postgres,
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into()),
    "postgres://postgres@127.0.0.1:1/test",
    2
);

pool_tests!(
    mariadb,
    idempotent::MysqlStore,
    sqlx::mysql::MySqlPoolOptions,
    sqlx::MySql,
    mysql::url(),
    "mysql://root@127.0.0.1:1/test",
    3
);
