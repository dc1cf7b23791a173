//! `PostgresStore`: records in a PostgreSQL table.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::postgres::{PgConnection, PgExecutor, PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

use super::sql::{self, PurgeSchedule, millis};
use crate::{Claim, Fingerprint, Key, Store, StoreError, Token, Transition};

pub use super::sql::{DEFAULT_TABLE, PURGE_BATCH, PURGE_EVERY_CLAIMS};

/// Records in PostgreSQL, through an `sqlx` pool.
///
/// A record is one row keyed by `namespace:id` (bytea) holding state, attempts,
/// claim token, lease deadline, expiry, fingerprint and cached result; times are the
/// database's `now()`, so consumers' clocks need not agree.
///
/// * A claim is one statement: `INSERT ... ON CONFLICT (key) DO UPDATE ... WHERE` the
///   record is expired, released, or in progress with a lapsed lease (and its
///   fingerprint agrees) `RETURNING`, with the existing record read in the same
///   statement when the claim is refused.
/// * The claim commits asynchronously (`synchronous_commit = off`, for that statement
///   only): losing it in a server crash is the same as its lease running out, and
///   the DONE commit, which is synchronous, makes it durable too. This halves the
///   WAL flushes per message.
/// * Complete, release, fail and renew are one `UPDATE ... WHERE key = $1 AND state =
///   'P' AND token = $2`: a consumer whose lease was taken over changes nothing.
/// * Expired rows are deleted in the background, [`PURGE_BATCH`] at a time, every
///   [`PURGE_EVERY_CLAIMS`] claims; or run [`purge_expired`](PostgresStore::purge_expired)
///   (or its SQL) from a scheduler.
///
/// Create the table with [`migrate`](PostgresStore::migrate) (idempotent, safe to run
/// from several processes at once) or apply [`migration_sql`](PostgresStore::migration_sql)
/// with your own migration tool.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use idempotent_runtime::PostgresStore;
///
/// let store = PostgresStore::connect("postgres://postgres@127.0.0.1:5432/app").await?;
/// store.migrate().await?;
///
/// // Or on a pool of your own, in a table of your choice:
/// let pool = sqlx::postgres::PgPoolOptions::new()
///     .max_connections(20)
///     .connect("postgres://postgres@127.0.0.1:5432/app")
///     .await?;
/// let store = PostgresStore::from_pool(pool).with_table("billing.idempotency")?;
/// println!("{}", store.migration_sql());
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PostgresStore {
    pool: PgPool,
    sql: Arc<Sql>,
    purge: Arc<PurgeSchedule>,
}

/// The statements, built once per table. `SqlStr`s made from an `Arc<str>` clone
/// without copying the text.
struct Sql {
    table: String,
    claim: SqlStr,
    finish: SqlStr,
    release: SqlStr,
    renew: SqlStr,
    purge: SqlStr,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore").field("table", &self.sql.table).finish()
    }
}

impl PostgresStore {
    /// Connects a pool of up to 10 connections to `url`
    /// (`postgres://user:password@host:port/database`).
    pub async fn connect(url: &str) -> Result<PostgresStore, StoreError> {
        let pool = PgPoolOptions::new()
            .max_connections(10)
            .acquire_timeout(Duration::from_secs(5))
            .connect(url)
            .await
            .map_err(StoreError::unavailable)?;
        Ok(PostgresStore::from_pool(pool))
    }

    /// Uses a pool configured by the caller.
    pub fn from_pool(pool: PgPool) -> PostgresStore {
        PostgresStore { pool, sql: Arc::new(Sql::new(DEFAULT_TABLE)), purge: Arc::default() }
    }

    /// Keeps records in `table` (`name` or `schema.name`; letters, digits and `_`).
    pub fn with_table(mut self, table: &str) -> Result<PostgresStore, StoreError> {
        sql::check_table_name(table)?;
        self.sql = Arc::new(Sql::new(table));
        Ok(self)
    }

    /// The pool, to run other queries on it.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The schema this store needs, as SQL.
    pub fn migration_sql(&self) -> String {
        let t = &self.sql.table;
        let index = t.replace('.', "_");
        format!(
            "CREATE TABLE IF NOT EXISTS {t} (
    key bytea PRIMARY KEY,
    state \"char\" NOT NULL,
    attempts integer NOT NULL,
    token bytea,
    lease_until timestamptz,
    expires_at timestamptz NOT NULL,
    fingerprint bytea,
    result bytea
);
CREATE INDEX IF NOT EXISTS {index}_expires_at ON {t} (expires_at);"
        )
    }

    /// Creates the table and its index if they do not exist. Holds an advisory lock
    /// while it does, so concurrent callers do not race.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await.map_err(StoreError::unavailable)?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
            .bind(&self.sql.table)
            .execute(&mut *tx)
            .await
            .map_err(StoreError::unavailable)?;
        sqlx::raw_sql(AssertSqlSafe(self.migration_sql()))
            .execute(&mut *tx)
            .await
            .map_err(StoreError::unavailable)?;
        tx.commit().await.map_err(StoreError::unavailable)
    }

    /// Deletes up to `batch` expired records; returns how many.
    pub async fn purge_expired(&self, batch: i64) -> Result<u64, StoreError> {
        let done = sqlx::query(self.sql.purge.clone())
            .bind(batch)
            .execute(&self.pool)
            .await
            .map_err(StoreError::unavailable)?;
        Ok(done.rows_affected())
    }

    /// Records DONE through `conn`, inside the caller's transaction: the record
    /// becomes DONE when, and only if, that transaction commits.
    pub(crate) async fn complete_on(
        &self,
        conn: &mut PgConnection,
        key: &Key,
        token: Token,
        ttl: Duration,
        result: Option<&[u8]>,
    ) -> Result<Transition, StoreError> {
        let extra = Extra::Finish { state: b'D' as i8, ttl: millis(ttl), result };
        self.update(conn, &self.sql.finish, key, token, extra).await
    }

    async fn update(
        &self,
        on: impl PgExecutor<'_>,
        sql: &SqlStr,
        key: &Key,
        token: Token,
        extra: Extra<'_>,
    ) -> Result<Transition, StoreError> {
        let token = token.as_u128().to_be_bytes();
        let query = sqlx::query(sql.clone()).bind(key.as_bytes()).bind(token.as_slice());
        let query = match extra {
            Extra::None => query,
            Extra::Millis(ms) => query.bind(ms),
            Extra::Finish { state, ttl, result } => query.bind(state).bind(ttl).bind(result),
        };
        let done = query.execute(on).await.map_err(StoreError::unavailable)?;
        Ok(if done.rows_affected() == 1 { Transition::Applied } else { Transition::LeaseLost })
    }

    fn maybe_purge(&self) {
        if self.purge.due() {
            let store = self.clone();
            sql::spawn_purge(async move { store.purge_expired(PURGE_BATCH).await });
        }
    }
}

enum Extra<'a> {
    None,
    Millis(i64),
    Finish { state: i8, ttl: i64, result: Option<&'a [u8]> },
}

/// Statement text made from a validated table name and our own SQL.
fn statement(sql: String) -> SqlStr {
    AssertSqlSafe(std::sync::Arc::<str>::from(sql)).into_sql_str()
}

impl Sql {
    fn new(table: &str) -> Sql {
        let t = table;
        let live = "key = $1 AND state = 'P' AND token = $2 AND expires_at > now()";
        Sql {
            table: t.to_owned(),
            // $1 key, $2 token, $3 lease ms, $4 retention ms, $5 fingerprint.
            // The claim commits without waiting for its WAL flush (`synchronous_commit`
            // off for this statement only): a claim lost in a server crash is a lease
            // that ran out, and the DONE commit that follows flushes it anyway.
            claim: statement(format!(
                "WITH claimed AS (
    INSERT INTO {t} AS r (key, state, attempts, token, lease_until, expires_at, fingerprint)
    VALUES ($1, 'P', CASE set_config('synchronous_commit', 'off', true) WHEN 'off' THEN 1 END,
            $2, now() + $3 * interval '1 millisecond',
            now() + $4 * interval '1 millisecond', $5)
    ON CONFLICT (key) DO UPDATE SET
        state = 'P',
        attempts = CASE WHEN r.expires_at <= now() THEN 1 ELSE r.attempts + 1 END,
        token = EXCLUDED.token,
        lease_until = EXCLUDED.lease_until,
        expires_at = CASE WHEN r.expires_at <= now() THEN EXCLUDED.expires_at
                          ELSE GREATEST(r.expires_at, EXCLUDED.expires_at) END,
        fingerprint = CASE WHEN r.expires_at <= now() THEN EXCLUDED.fingerprint
                           ELSE COALESCE(r.fingerprint, EXCLUDED.fingerprint) END,
        result = NULL
    WHERE r.expires_at <= now()
       OR ((r.state = 'R' OR (r.state = 'P' AND r.lease_until <= now()))
           AND (r.fingerprint IS NULL OR EXCLUDED.fingerprint IS NULL
                OR r.fingerprint = EXCLUDED.fingerprint))
    RETURNING 'W'::text AS outcome, r.attempts, NULL::bytea AS result
)
SELECT outcome, attempts, result FROM claimed
UNION ALL
SELECT CASE WHEN r.fingerprint IS NOT NULL AND $5::bytea IS NOT NULL
                 AND r.fingerprint <> $5::bytea THEN 'M'
            WHEN r.state = 'D' THEN 'D'
            WHEN r.state = 'F' THEN 'F'
            ELSE 'P' END,
       r.attempts, r.result
FROM {t} r
WHERE r.key = $1 AND r.expires_at > now() AND NOT EXISTS (SELECT 1 FROM claimed)"
            )),
            // $3 state (D or F), $4 ttl ms, $5 result.
            finish: statement(format!(
                "UPDATE {t} SET state = $3::\"char\", token = NULL, lease_until = NULL,
    expires_at = now() + $4 * interval '1 millisecond', result = $5 WHERE {live}"
            )),
            release: statement(format!(
                "UPDATE {t} SET state = 'R', token = NULL, lease_until = NULL WHERE {live}"
            )),
            // $3 lease ms.
            renew: statement(format!(
                "UPDATE {t} SET lease_until = now() + $3 * interval '1 millisecond',
    expires_at = GREATEST(expires_at, now() + $3 * interval '1 millisecond') WHERE {live}"
            )),
            purge: statement(format!(
                "DELETE FROM {t} WHERE key IN
    (SELECT key FROM {t} WHERE expires_at <= now() LIMIT $1 FOR UPDATE SKIP LOCKED)"
            )),
        }
    }
}

#[async_trait]
impl Store for PostgresStore {
    async fn claim(
        &self,
        key: &Key,
        lease: Duration,
        ttl: Duration,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Claim, StoreError> {
        self.maybe_purge();
        let retention = crate::claim_retention(lease, ttl);
        // A record inserted by a transaction that committed after this statement's
        // snapshot can make the statement see nothing at all: ask again.
        for _ in 0..10 {
            let token = Token::random();
            let row: Option<(String, i32, Option<Vec<u8>>)> =
                sqlx::query_as(self.sql.claim.clone())
                    .bind(key.as_bytes())
                    .bind(token.as_u128().to_be_bytes().as_slice())
                    .bind(millis(lease))
                    .bind(millis(retention))
                    .bind(fingerprint.map(|f| f.as_bytes().as_slice()))
                    .fetch_optional(&self.pool)
                    .await
                    .map_err(StoreError::unavailable)?;
            let Some((outcome, attempts, result)) = row else { continue };
            let attempts = u32::try_from(attempts).unwrap_or(0);
            return match outcome.as_str() {
                "W" => Ok(Claim::Won { token, attempt: attempts }),
                "D" => Ok(result.map_or(Claim::Done, Claim::Cached)),
                "F" => Ok(Claim::Failed { attempts }),
                "P" => Ok(Claim::InProgress),
                "M" => Ok(Claim::Mismatch),
                other => Err(StoreError::Protocol(format!("claim returned {other:?}"))),
            };
        }
        Err(StoreError::Protocol("claim saw no record after 10 tries".to_owned()))
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        ttl: Duration,
        result: Option<&[u8]>,
    ) -> Result<Transition, StoreError> {
        let extra = Extra::Finish { state: b'D' as i8, ttl: millis(ttl), result };
        self.update(&self.pool, &self.sql.finish, key, token, extra).await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<Transition, StoreError> {
        self.update(&self.pool, &self.sql.release, key, token, Extra::None).await
    }

    async fn fail(&self, key: &Key, token: Token, ttl: Duration) -> Result<Transition, StoreError> {
        let extra = Extra::Finish { state: b'F' as i8, ttl: millis(ttl), result: None };
        self.update(&self.pool, &self.sql.finish, key, token, extra).await
    }

    async fn renew(
        &self,
        key: &Key,
        token: Token,
        lease: Duration,
    ) -> Result<Transition, StoreError> {
        self.update(&self.pool, &self.sql.renew, key, token, Extra::Millis(millis(lease))).await
    }

    /// Starts the release on the current Tokio runtime and returns at once; without
    /// a runtime, the lease runs out instead.
    fn abandon(&self, key: &Key, token: Token) {
        crate::store::release_in_background(self, key, token);
    }
}
