//! The machine's MySQL or MariaDB for the tests (`MYSQL_URL`, default
//! `mysql://root@127.0.0.1:3306/test`), and tables of each test run's own.
#![allow(dead_code)]

use std::time::Duration;

use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{AssertSqlSafe, Executor, MySqlPool};

/// The server's URL: `MYSQL_URL`, default `mysql://root@127.0.0.1:3306/test`.
pub fn url() -> String {
    std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

/// A pool of up to `connections` to the machine's MySQL. `None`, with a printed
/// reason, when it is unreachable outside CI; under `CI` a missing server fails the
/// test.
pub async fn pool(connections: u32) -> Option<MySqlPool> {
    pool_with(connections, &[]).await
}

/// As [`pool`], with `statements` run on every new connection (session settings, as
/// a server whose defaults differ would have).
pub async fn pool_with(connections: u32, statements: &[&'static str]) -> Option<MySqlPool> {
    let url = url();
    let options = match url.parse::<MySqlConnectOptions>() {
        Ok(options) => options,
        Err(e) => panic!("MYSQL_URL {url} is not a MySQL URL: {e}"),
    };
    let statements = statements.to_vec();
    let pool = MySqlPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_secs(10))
        .after_connect(move |conn, _| {
            let statements = statements.clone();
            Box::pin(async move {
                for statement in statements {
                    conn.execute(statement).await?;
                }
                Ok(())
            })
        })
        .connect_with(options)
        .await;
    match pool {
        Ok(pool) => Some(pool),
        Err(e) => {
            assert!(std::env::var_os("CI").is_none(), "CI needs MySQL or MariaDB at {url}: {e}");
            eprintln!("skipped: no MySQL or MariaDB at {url} ({e}); set MYSQL_URL");
            None
        }
    }
}

/// A table name no other test or run uses: `{prefix}_{random}`.
pub fn table(prefix: &str) -> String {
    format!("{prefix}_{:016x}", rand_u64())
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos(),
    );
    hasher.finish()
}

/// Drops `tables`.
pub async fn drop_tables(pool: &MySqlPool, tables: &[&str]) {
    let sql = format!("DROP TABLE IF EXISTS {}", tables.join(", "));
    sqlx::query(AssertSqlSafe(sql)).execute(pool).await.unwrap();
}
