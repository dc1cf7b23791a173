//! The machine's PostgreSQL for the tests (`DATABASE_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`).

use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

/// A pool of up to `connections` to the machine's PostgreSQL. `None`, with a printed
/// reason, when it is unreachable outside CI; under `CI` a missing server fails the
/// test.
pub async fn pool(connections: u32) -> Option<PgPool> {
    pool_with(connections, &[]).await
}

/// As [`pool`], with `settings` (name, value) made the defaults of every connection,
/// as a database whose defaults differ from PostgreSQL's would.
pub async fn pool_with(connections: u32, settings: &[(&str, &str)]) -> Option<PgPool> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let options = match url.parse::<sqlx::postgres::PgConnectOptions>() {
        Ok(options) => options.options(settings.iter().copied()),
        Err(e) => panic!("DATABASE_URL {url} is not a PostgreSQL URL: {e}"),
    };
    let pool = PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await;
    match pool {
        Ok(pool) => Some(pool),
        Err(e) => {
            assert!(std::env::var_os("CI").is_none(), "CI needs PostgreSQL at {url}: {e}");
            eprintln!("skipped: no PostgreSQL at {url} ({e}); set DATABASE_URL");
            None
        }
    }
}
