//! `PostgresStore`: records in a PostgreSQL table.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use sqlx::postgres::{PgConnection, PgExecutor, PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

use super::sql::{self, PurgeSchedule, millis};
use super::{admin, format};
use crate::{Claim, Fingerprint, Key, Store, StoreError, Token, Transition};

pub use super::sql::{DEFAULT_TABLE, PURGE_BATCH, PURGE_EVERY_CLAIMS, RENEWAL_CONNECTIONS};
pub use crate::transactional::TransactionalClaim;

/// Records in PostgreSQL, through an `sqlx` pool.
///
/// A record is one row keyed by `namespace:id` (bytea) holding state, attempts,
/// claim token, lease deadline, expiry, fingerprint and cached result; times are the
/// database's clock (`clock_timestamp()`, never a transaction's start), so consumers'
/// clocks need not agree. Ids over [`MAX_STORED_ID_LEN`](crate::MAX_STORED_ID_LEN)
/// bytes are stored under their SHA-256 ([`Key::stored`]), so a key of any length fits
/// the index.
///
/// * A claim is one statement: `INSERT ... ON CONFLICT (key) DO UPDATE ... WHERE` the
///   record is expired, released, or in progress with a lapsed lease (and its
///   fingerprint agrees) `RETURNING`, with the existing record read in the same
///   statement when the claim is refused.
/// * The claim commits durably. (In `transactional` mode it commits without waiting
///   for its WAL flush, which is safe there: a claim lost in a server crash makes the
///   DONE update find nothing, which rolls the handler's writes back, and the DONE
///   commit flushes the claim anyway. For a plain handler, whose effects happen
///   elsewhere, a lost claim would make `complete` fail and the redelivery run the
///   handler again.) A transactional handler's claim runs on the connection its
///   transaction then uses; with [`TransactionalClaim::InTransaction`] it is instead
///   the transaction's first statement, and commits with it.
/// * Complete, release, fail and renew are one `UPDATE ... WHERE key = $1 AND state =
///   'P' AND token = $2`: a consumer whose lease was taken over changes nothing.
/// * Every statement waits at most [`LOCK_TIMEOUT`] for a locked record row (one left
///   locked by a consumer whose host died between its DONE update and COMMIT): a claim
///   then answers [`Claim::InProgress`] instead of blocking.
/// * Lease renewals run on [`RENEWAL_CONNECTIONS`] connections of their own, opened
///   on first use with the pool's connect and pool options, `after_connect` included
///   (a `search_path` set there holds for them too), so they never wait behind the
///   handlers' transactions.
/// * The pool bounds how many calls run at once: size it for the handlers in flight
///   (in `transactional` mode each holds one connection from its claim to its
///   commit) plus a few for plain claims. [`connect`](PostgresStore::connect) opens up
///   to 10; [`connect_with`](PostgresStore::connect_with) takes your pool options. A
///   call that had to wait for a connection logs a warning (at most once a minute)
///   saying so, and one that finds none within the pool's acquire timeout fails
///   with an error saying how to size the pool. A transactional handler waits for
///   its connection before it claims, so a full pool delays claims rather than
///   eating into leases.
/// * Errors that retrying can't fix (a value the database refuses) are
///   [`StoreError::Rejected`]: the message is dead-lettered, not retried for ever.
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
/// let ddl: String = store.migration_sql(); // for your own migration tool
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PostgresStore {
    pool: PgPool,
    /// Lease renewals' own connections, opened on first use with the pool's options:
    /// a renewal must not wait behind the handlers whose leases it keeps, which hold
    /// the pool's connections for their transactions.
    renewals: Arc<OnceLock<PgPool>>,
    sql: Arc<Sql>,
    purge: Arc<PurgeSchedule>,
    /// When a call last warned that it waited for a connection of the pool.
    pool_waits: Arc<sql::Throttle>,
    transactional_claim: TransactionalClaim,
}

/// The records table and its statements. `SqlStr`s made from an `Arc<str>` clone
/// without copying the text.
struct Sql {
    table: String,
    /// The statements naming `table` as given, until a claim resolved it.
    given: Statements,
    /// `table` as the server resolves it, once the first claim asked (on a
    /// connection no handler has used yet): `schema.name` for the advisory lock ids,
    /// and every statement from then on names the table so (quoted where needed),
    /// whatever `search_path` a handler set on the connection since, for its
    /// transaction (`SET LOCAL`) or for the session the pool keeps.
    resolved: OnceLock<Resolved>,
}

/// The statements, built once per table name.
struct Statements {
    claim: SqlStr,
    claim_deferred: SqlStr,
    claim_in_transaction: SqlStr,
    finish: SqlStr,
    /// `finish`, only inside the transaction the handler was given, while it stands
    /// ([`STILL_IN_TRANSACTION`]).
    finish_in_transaction: SqlStr,
    /// $2 ttl ms, $3 result. The row is the calling transaction's own, while it
    /// stands.
    redate_done: SqlStr,
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
    /// (`postgres://user:password@host:port/database`): enough for a consumer running
    /// up to about 8 calls at once. For more, use
    /// [`connect_with`](PostgresStore::connect_with).
    pub async fn connect(url: &str) -> Result<PostgresStore, StoreError> {
        let options = PgPoolOptions::new().acquire_timeout(Duration::from_secs(5));
        PostgresStore::connect_with(url, options.max_connections(10)).await
    }

    /// Connects a pool made with `options` to `url`: its `max_connections` should be
    /// the consumer's concurrency plus a few (see [`PostgresStore`]).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), idempotent_runtime::StoreError> {
    /// use idempotent_runtime::PostgresStore;
    /// use sqlx::postgres::PgPoolOptions;
    ///
    /// // A consumer with `.concurrency(64)`:
    /// let options = PgPoolOptions::new().max_connections(68);
    /// let store = PostgresStore::connect_with("postgres://postgres@127.0.0.1/app", options).await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect_with(
        url: &str,
        options: PgPoolOptions,
    ) -> Result<PostgresStore, StoreError> {
        let timeout = options.get_acquire_timeout();
        let pool = options.connect(url).await.map_err(|e| sql::connect_error(e, timeout))?;
        Ok(PostgresStore::from_pool(pool))
    }

    /// Uses a pool configured by the caller.
    pub fn from_pool(pool: PgPool) -> PostgresStore {
        PostgresStore {
            pool,
            renewals: Arc::default(),
            sql: Arc::new(Sql::new(DEFAULT_TABLE)),
            purge: Arc::default(),
            pool_waits: Arc::default(),
            transactional_claim: TransactionalClaim::default(),
        }
    }

    /// Where `transactional` handlers take their claim: [`TransactionalClaim`] says
    /// what each choice gives and costs. Plain handlers always claim first.
    pub fn with_transactional_claim(mut self, claim: TransactionalClaim) -> PostgresStore {
        self.transactional_claim = claim;
        self
    }

    /// Where `transactional` handlers take their claim.
    pub fn transactional_claim(&self) -> TransactionalClaim {
        self.transactional_claim
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
        let mut tx = sql::begin_detached(&self.pool).await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
            .bind(&self.sql.table)
            .execute(&mut *tx)
            .await
            .map_err(StoreError::unavailable)?;
        sqlx::raw_sql(AssertSqlSafe(self.migration_sql()))
            .execute(&mut *tx)
            .await
            .map_err(StoreError::unavailable)?;
        tx.commit().await.map_err(StoreError::unavailable)?;
        self.check().await
    }

    /// Checks that the records table is there with every column the store uses: a
    /// missing one is [`StoreError::Misconfigured`], naming
    /// [`migrate`](PostgresStore::migrate). [`migrate`](PostgresStore::migrate) runs
    /// it; run it at start-up when the table is made by a migration tool of your own.
    pub async fn check(&self) -> Result<(), StoreError> {
        let probe = format!(
            "SELECT key, state, attempts, token, lease_until, expires_at, fingerprint, result \
             FROM {} LIMIT 0",
            self.sql.table
        );
        sqlx::query(AssertSqlSafe(probe)).execute(&self.pool).await.map_err(sql::store_error)?;
        // Every claim is an `INSERT ... ON CONFLICT (key)`, which needs a unique index
        // on `key` alone: without one each claim fails (42P10) and the message is
        // retried for ever.
        let keyed: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_index i JOIN pg_attribute a \
             ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] \
             WHERE i.indrelid = to_regclass($1) AND i.indisunique AND i.indnkeyatts = 1 \
             AND i.indpred IS NULL AND a.attname = 'key')",
        )
        .bind(&self.sql.table)
        .fetch_one(&self.pool)
        .await
        .map_err(sql::store_error)?;
        if !keyed {
            return Err(StoreError::Misconfigured(format!(
                "the records table {} has no primary key or unique index on key alone, which \
                 every claim needs (ON CONFLICT (key)): make it as migrate() does (key bytea \
                 PRIMARY KEY; PostgresStore::migration_sql has the statement)",
                self.sql.table
            )));
        }
        Ok(())
    }

    /// Deletes up to `batch` expired records; returns how many.
    pub async fn purge_expired(&self, batch: i64) -> Result<u64, StoreError> {
        let done = sqlx::query(self.sql.statements().purge.clone())
            .bind(batch)
            .execute(&self.pool)
            .await
            .map_err(sql::store_error)?;
        Ok(done.rows_affected())
    }

    /// A connection of the pool for a call (see [`sql::acquire`]).
    pub(crate) async fn acquire(
        &self,
    ) -> Result<sqlx::pool::PoolConnection<sqlx::Postgres>, StoreError> {
        sql::acquire(&self.pool, &self.pool_waits).await
    }

    /// The renewals' pool, created on the first claim (inside the runtime), which
    /// opens its first connection in the background, before the first renewal is due.
    fn renewal_pool(&self) -> &PgPool {
        self.renewals.get_or_init(|| sql::renewal_pool(&self.pool))
    }

    /// [`Store::claim`], with the claim's commit durable or deferred.
    pub(crate) async fn claim_with(
        &self,
        key: &Key,
        lease: Duration,
        ttl: Duration,
        fingerprint: Option<&Fingerprint>,
        commit: ClaimCommit,
    ) -> Result<Claim, StoreError> {
        let mut conn = self.acquire().await?;
        self.claim_on(&mut conn, key, lease, ttl, fingerprint, commit).await
    }

    /// [`Store::claim`] on `conn`, outside any transaction: the claim commits on its
    /// own, and `conn` can go on to run the handler's transaction.
    pub(crate) async fn claim_on(
        &self,
        conn: &mut PgConnection,
        key: &Key,
        lease: Duration,
        ttl: Duration,
        fingerprint: Option<&Fingerprint>,
        commit: ClaimCommit,
    ) -> Result<Claim, StoreError> {
        self.maybe_purge();
        self.renewal_pool();
        self.resolved_table(conn).await?;
        let retention = crate::claim_retention(lease, ttl);
        let sql = match commit {
            ClaimCommit::Durable => &self.sql.statements().claim,
            ClaimCommit::Deferred => &self.sql.statements().claim_deferred,
        };
        let stored = key.stored();
        // A record inserted by a transaction that committed after this statement's
        // snapshot can make the statement see nothing at all: ask again.
        for _ in 0..10 {
            let token = Token::random();
            let row: Result<Option<ClaimRow>, _> = sqlx::query_as(sql.clone())
                .bind(stored.as_ref())
                .bind(token.as_u128().to_be_bytes().as_slice())
                .bind(millis(lease))
                .bind(millis(retention))
                .bind(fingerprint.map(|f| f.as_bytes().as_slice()))
                .fetch_optional(&mut *conn)
                .await;
            let row = match row {
                Ok(row) => row,
                // The record row stayed locked for `LOCK_TIMEOUT`: another consumer is
                // committing it, or died while it was.
                Err(e) if sql::is_lock_timeout(&e) => {
                    return Ok(Claim::InProgress { lease_left: None });
                }
                // Under a REPEATABLE READ or SERIALIZABLE default, a record another
                // claim changed after this statement's snapshot is a serialization
                // failure: the statement, asked again with a new snapshot, reads it.
                Err(e) if sql::is_serialization_failure(&e) => continue,
                Err(e) => return Err(sql::store_error(e)),
            };
            let Some((outcome, attempts, result, lease_left, fence)) = row else { continue };
            let fence = fence.and_then(|xid| u64::try_from(xid).ok());
            return claim_answer(&outcome, attempts, result, lease_left, token, fence);
        }
        Err(StoreError::Protocol("claim saw no record after 10 tries".to_owned()))
    }

    /// [`TransactionalClaim::InTransaction`]'s claim, inside the caller's transaction
    /// on `conn`: the record is written DONE (kept `ttl` + `lease`), which it becomes
    /// for everyone else when, and only if, that transaction commits.
    pub(crate) async fn claim_in_transaction(
        &self,
        conn: &mut PgConnection,
        key: &Key,
        lease: Duration,
        ttl: Duration,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Claim, StoreError> {
        self.maybe_purge();
        let stored = key.stored();
        let lock = advisory_lock_id(self.resolved_table(conn).await?, stored.as_ref());
        for _ in 0..10 {
            // The outcome is NULL when the record went between the insert's check and
            // the read of why it failed: ask again.
            let row: Option<(Option<String>, i32, Option<Vec<u8>>)> =
                sqlx::query_as(self.sql.statements().claim_in_transaction.clone())
                    .bind(stored.as_ref())
                    .bind(lock)
                    .bind(millis(ttl.saturating_add(lease)))
                    .bind(fingerprint.map(|f| f.as_bytes().as_slice()))
                    .fetch_optional(&mut *conn)
                    .await
                    .map_err(sql::store_error)?;
            let Some((Some(outcome), attempts, result)) = row else { continue };
            return claim_answer(&outcome, attempts, result, None, Token::random(), None);
        }
        Err(StoreError::Protocol("claim saw no record after 10 tries".to_owned()))
    }

    /// The records table as the server resolves it (`schema.name`), asked on `conn`
    /// once: the advisory lock ids hash it, so that stores given two spellings of one
    /// table (`records`, `public.records`) lock alike.
    pub(crate) async fn resolved_table(&self, conn: &mut PgConnection) -> Result<&str, StoreError> {
        if let Some(resolved) = self.sql.resolved.get() {
            return Ok(&resolved.name);
        }
        let (name, quoted): (String, String) = sqlx::query_as(
            "SELECT n.nspname || '.' || c.relname, \
                    quote_ident(n.nspname) || '.' || quote_ident(c.relname) \
             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE c.oid = $1::regclass",
        )
        .bind(&self.sql.table)
        .fetch_one(&mut *conn)
        .await
        .map_err(sql::store_error)?;
        let statements = Statements::new(&quoted);
        let resolved = Resolved { name, quoted, statements };
        Ok(&self.sql.resolved.get_or_init(|| resolved).name)
    }

    /// Dates the DONE record [`claim_in_transaction`](Self::claim_in_transaction) wrote
    /// from now, with `result`, inside the same transaction.
    pub(crate) async fn redate_done(
        &self,
        conn: &mut PgConnection,
        key: &Key,
        ttl: Duration,
        result: Option<&[u8]>,
    ) -> Result<Transition, StoreError> {
        let done = sqlx::query(self.sql.statements().redate_done.clone())
            .bind(key.stored().as_ref())
            .bind(millis(ttl))
            .bind(result)
            .execute(conn)
            .await
            .map_err(sql::store_error)?;
        Ok(if done.rows_affected() == 1 { Transition::Applied } else { Transition::LeaseLost })
    }

    /// Turns the DONE record that a claim taken inside a handler's transaction wrote
    /// into FAILED, on its own: the handler ended that transaction early, so its own
    /// commit made the DONE. `false` when there is none (the claim was rolled back).
    pub(crate) async fn fail_inline_done(
        &self,
        key: &Key,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let sql = format!(
            "UPDATE {} SET state = 'F', result = NULL,
    expires_at = clock_timestamp() + $2 * interval '1 millisecond'
    WHERE key = $1 AND state = 'D' AND token IS NULL",
            self.sql.named()
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(key.stored().as_ref())
            .bind(millis(ttl))
            .execute(&self.pool)
            .await
            .map_err(sql::store_error)?;
        Ok(done.rows_affected() == 1)
    }

    /// Records DONE through `conn`, inside the handler's transaction: the record
    /// becomes DONE when, and only if, that transaction commits. A transaction that
    /// has ended changes nothing ([`Transition::LeaseLost`]: ask the marker which it
    /// was).
    pub(crate) async fn complete_in_transaction(
        &self,
        conn: &mut PgConnection,
        key: &Key,
        token: Token,
        ttl: Duration,
        result: Option<&[u8]>,
    ) -> Result<Transition, StoreError> {
        let extra = Extra::Finish { state: b'D' as i8, ttl: millis(ttl), result };
        self.update(conn, &self.sql.statements().finish_in_transaction, key, token, extra).await
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
        let stored = key.stored();
        let query = sqlx::query(sql.clone()).bind(stored.as_ref()).bind(token.as_slice());
        let query = match extra {
            Extra::None => query,
            Extra::Renew { lease, retention } => query.bind(lease).bind(retention),
            Extra::Finish { state, ttl, result } => query.bind(state).bind(ttl).bind(result),
        };
        let done = query.execute(on).await.map_err(sql::store_error)?;
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
    Renew { lease: i64, retention: i64 },
    Finish { state: i8, ttl: i64, result: Option<&'a [u8]> },
}

/// Statement text made from a validated table name and our own SQL.
fn statement(sql: String) -> SqlStr {
    AssertSqlSafe(std::sync::Arc::<str>::from(sql)).into_sql_str()
}

/// The claim a claim statement's row answers: its outcome letter, the attempts, any
/// cached result and the lease left in ms (for `P`, when the statement could tell);
/// `token` and `fence` are the claim's, if it won.
fn claim_answer(
    outcome: &str,
    attempts: i32,
    result: Option<Vec<u8>>,
    lease_left: Option<i64>,
    token: Token,
    fence: Option<u64>,
) -> Result<Claim, StoreError> {
    let attempts = u32::try_from(attempts).unwrap_or(0);
    match outcome {
        "W" => Ok(Claim::Won { token, attempt: attempts, fence }),
        "D" => Ok(result.map_or(Claim::Done, Claim::Cached)),
        "F" => Ok(Claim::Failed { attempts }),
        "P" => Ok(Claim::InProgress {
            lease_left: lease_left.map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0))),
        }),
        "M" => Ok(Claim::Mismatch),
        // A state letter of a later version (`format`), as its code.
        other if other.starts_with('U') => {
            let letter = other[1..].parse::<i8>().unwrap_or(0) as u8;
            Err(StoreError::NewerFormat(format::newer_state(&[letter])))
        }
        other => Err(StoreError::Protocol(format!("claim returned {other:?}"))),
    }
}

type ClaimRow = (String, i32, Option<Vec<u8>>, Option<i64>, Option<i64>);

/// How long one of the store's statements waits for a row lock before giving up. A
/// record row stays locked while a handler's transaction commits its DONE update; if
/// that consumer's host dies in between, its backend can hold the lock until TCP
/// gives up (hours). A claim that waits this long answers [`Claim::InProgress`]
/// instead of blocking the consumer.
pub const LOCK_TIMEOUT: Duration = Duration::from_secs(2);

/// Whether a claim's commit waits for its WAL flush.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum ClaimCommit {
    /// Durable: a claim is never lost in a server crash. For plain handlers, whose
    /// effects happen outside PostgreSQL: a lost claim would make `complete` answer
    /// LeaseLost although the handler ran, and the redelivery would run it again.
    Durable,
    /// `synchronous_commit = off` for the claim's statement: in transactional mode a
    /// claim lost in a crash only makes the DONE update find nothing, which rolls the
    /// handler's writes back; and the DONE commit flushes the claim anyway.
    Deferred,
}

/// `table` resolved, and the statements that name it so.
struct Resolved {
    name: String,
    /// `name` quoted where needed, as statements name it.
    quoted: String,
    statements: Statements,
}

/// The condition that the claim is the caller's and live, and sets the statement's
/// lock timeout. Every time is the clock's, not `now()`: inside the handler's
/// transaction `now()` is the transaction's start, and a handler that ran longer than
/// `ttl` would commit a DONE record that has already expired.
fn live_claim() -> String {
    let lock =
        format!("set_config('lock_timeout', '{}ms', true) IS NOT NULL", LOCK_TIMEOUT.as_millis());
    format!("key = $1 AND state = 'P' AND token = $2 AND expires_at > clock_timestamp() AND {lock}")
}

/// Ends a live claim: $3 state (D or F), $4 ttl ms, $5 result.
fn finish_sql(t: &str) -> String {
    format!(
        "UPDATE {t} SET state = $3::\"char\", token = NULL, lease_until = NULL,
    expires_at = clock_timestamp() + $4 * interval '1 millisecond', result = $5 WHERE {}",
        live_claim()
    )
}

impl Sql {
    fn new(table: &str) -> Sql {
        Sql { table: table.to_owned(), given: Statements::new(table), resolved: OnceLock::new() }
    }

    /// The statements: naming the table as resolved, once it is.
    fn statements(&self) -> &Statements {
        self.resolved.get().map_or(&self.given, |resolved| &resolved.statements)
    }

    /// The table as statements name it: resolved, once it is.
    fn named(&self) -> &str {
        self.resolved.get().map_or(&self.table, |resolved| &resolved.quoted)
    }
}

impl Statements {
    fn new(t: &str) -> Statements {
        let live = live_claim();
        Statements {
            claim: statement(claim_sql(t, ClaimCommit::Durable)),
            claim_deferred: statement(claim_sql(t, ClaimCommit::Deferred)),
            claim_in_transaction: statement(claim_in_transaction_sql(t)),
            finish: statement(finish_sql(t)),
            finish_in_transaction: statement(format!(
                "{} AND {STILL_IN_TRANSACTION}",
                finish_sql(t)
            )),
            redate_done: statement(format!(
                "UPDATE {t} SET expires_at = clock_timestamp() + $2 * interval '1 millisecond',
    result = $3 WHERE key = $1 AND state = 'D' AND {STILL_IN_TRANSACTION}"
            )),
            release: statement(format!(
                "UPDATE {t} SET state = 'R', token = NULL, lease_until = NULL WHERE {live}"
            )),
            // $3 lease ms, $4 retention ms.
            renew: statement(format!(
                "UPDATE {t} SET lease_until = clock_timestamp() + $3 * interval '1 millisecond',
    expires_at = GREATEST(expires_at, clock_timestamp() + $4 * interval '1 millisecond')
    WHERE {live}"
            )),
            purge: statement(format!(
                "DELETE FROM {t} WHERE key IN
    (SELECT key FROM {t} WHERE expires_at <= clock_timestamp() LIMIT $1
     FOR UPDATE SKIP LOCKED)"
            )),
        }
    }
}

/// When a claim takes an existing record over (the `ON CONFLICT ... DO UPDATE`
/// condition, the same for both claim statements): it expired, or it was released or
/// its lease ran out, and the fingerprints do not disagree.
const TAKES_OVER: &str = "r.expires_at <= clock_timestamp()
       OR ((r.state = 'R' OR (r.state = 'P' AND r.lease_until <= clock_timestamp()))
           AND (r.fingerprint IS NULL OR EXCLUDED.fingerprint IS NULL
                OR r.fingerprint = EXCLUDED.fingerprint))";

/// The claim: one statement that inserts or takes over the record, or reads why it
/// can't. $1 key, $2 token, $3 lease ms, $4 retention ms, $5 fingerprint. The settings
/// are made in the inserted row's one-time filter, before the insert, so they hold
/// when it waits for a locked row. (A `WITH settings AS MATERIALIZED` term did the
/// same at about a fifth more of the server's time per claim.)
fn claim_sql(t: &str, commit: ClaimCommit) -> String {
    let deferred = match commit {
        ClaimCommit::Durable => "",
        ClaimCommit::Deferred => " AND set_config('synchronous_commit', 'off', true) IS NOT NULL",
    };
    let lock_ms = LOCK_TIMEOUT.as_millis();
    format!(
        "WITH claimed AS (
    INSERT INTO {t} AS r (key, state, attempts, token, lease_until, expires_at, fingerprint)
    SELECT $1, 'P', 1, $2, clock_timestamp() + $3 * interval '1 millisecond',
           clock_timestamp() + $4 * interval '1 millisecond', $5
    WHERE set_config('lock_timeout', '{lock_ms}ms', true) IS NOT NULL{deferred}
    ON CONFLICT (key) DO UPDATE SET
        state = 'P',
        attempts = CASE WHEN r.expires_at <= clock_timestamp() THEN 1 ELSE r.attempts + 1 END,
        token = EXCLUDED.token,
        lease_until = EXCLUDED.lease_until,
        expires_at = CASE WHEN r.expires_at <= clock_timestamp() THEN EXCLUDED.expires_at
                          ELSE GREATEST(r.expires_at, EXCLUDED.expires_at) END,
        fingerprint = CASE WHEN r.expires_at <= clock_timestamp() THEN EXCLUDED.fingerprint
                           ELSE COALESCE(r.fingerprint, EXCLUDED.fingerprint) END,
        result = NULL
    WHERE {TAKES_OVER}
    RETURNING 'W'::text AS outcome, r.attempts, NULL::bytea AS result, txid_current() AS fence
)
SELECT outcome, attempts, result, NULL::bigint, fence FROM claimed
UNION ALL
SELECT CASE WHEN r.state NOT IN ('P', 'R', 'D', 'F') THEN 'U' || r.state::int4::text
            WHEN r.fingerprint IS NOT NULL AND $5::bytea IS NOT NULL
                 AND r.fingerprint <> $5::bytea THEN 'M'
            WHEN r.state = 'D' THEN 'D'
            WHEN r.state = 'F' THEN 'F'
            ELSE 'P' END,
       r.attempts, r.result,
       GREATEST(0, ceil(extract(epoch FROM r.lease_until - clock_timestamp()) * 1000))::bigint,
       NULL::bigint
FROM {t} r
WHERE r.key = $1 AND r.expires_at > clock_timestamp() AND NOT EXISTS (SELECT 1 FROM claimed)"
    )
}

/// [`TransactionalClaim::InTransaction`]'s claim: $1 key, $2 advisory lock id, $3
/// retention ms (ttl + lease), $4 fingerprint. It takes the key's advisory lock
/// without waiting, then inserts or takes over the record as DONE under the same
/// conditions as [`claim_sql`], or reads why it can't: `P` when another transaction
/// holds the lock (asking again for a lock this transaction holds grants it again).
/// Neither the lock timeout nor the commit mode is changed: they would hold for the
/// handler's statements too.
fn claim_in_transaction_sql(t: &str) -> String {
    format!(
        "WITH claimed AS (
    INSERT INTO {t} AS r (key, state, attempts, token, lease_until, expires_at, fingerprint)
    SELECT $1, 'D', 1, NULL, NULL, clock_timestamp() + $3 * interval '1 millisecond', $4
    WHERE pg_try_advisory_xact_lock($2)
    ON CONFLICT (key) DO UPDATE SET
        state = 'D',
        attempts = CASE WHEN r.expires_at <= clock_timestamp() THEN 1 ELSE r.attempts + 1 END,
        token = NULL,
        lease_until = NULL,
        expires_at = EXCLUDED.expires_at,
        fingerprint = CASE WHEN r.expires_at <= clock_timestamp() THEN EXCLUDED.fingerprint
                           ELSE COALESCE(r.fingerprint, EXCLUDED.fingerprint) END,
        result = NULL
    WHERE {TAKES_OVER}
    RETURNING 'W'::text AS outcome, r.attempts, NULL::bytea AS result
)
SELECT outcome, attempts, result FROM claimed
UNION ALL
SELECT CASE WHEN NOT pg_try_advisory_xact_lock($2) THEN 'P'
            WHEN r.key IS NULL THEN NULL
            WHEN r.state NOT IN ('P', 'R', 'D', 'F') THEN 'U' || r.state::int4::text
            WHEN r.fingerprint IS NOT NULL AND $4::bytea IS NOT NULL
                 AND r.fingerprint <> $4::bytea THEN 'M'
            WHEN r.state = 'D' THEN 'D'
            WHEN r.state = 'F' THEN 'F'
            ELSE 'P' END,
       coalesce(r.attempts, 0), r.result
FROM (SELECT) AS one LEFT JOIN {t} r ON r.key = $1 AND r.expires_at > clock_timestamp()
WHERE NOT EXISTS (SELECT 1 FROM claimed)"
    )
}

/// The condition that the transaction a handler was given still stands, for the
/// statements that record DONE in it: that transaction sets the marker when it
/// begins (`SET LOCAL idempotent.transaction = 'begun'`, which goes with it), so after
/// a handler ended it early (its own `COMMIT`) DONE changes nothing rather than
/// committing on its own.
const STILL_IN_TRANSACTION: &str = "current_setting('idempotent.transaction', true) = 'begun'";

/// The advisory lock [`claim_in_transaction_sql`] takes for a record: FNV-1a (64 bits)
/// of the table's name as the server resolves it (`schema.name`) and the stored key,
/// the same in every process. Two keys that share it only make one of them wait its
/// turn (`InProgress`).
fn advisory_lock_id(table: &str, stored: &[u8]) -> i64 {
    let mut hash = 0xcbf2_9ce4_8422_2325_u64;
    for &byte in table.as_bytes().iter().chain(&[0]).chain(stored) {
        hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
    }
    hash as i64
}

/// The columns [`Admin`](admin::Admin) reads, against the server's clock: key, state,
/// attempts, lease ms left (live leases only), ttl ms left, fingerprint, result length.
const ADMIN_COLUMNS: &str = "key, state, attempts,
    CASE WHEN state = 'P' AND lease_until > clock_timestamp()
         THEN ceil(extract(epoch FROM lease_until - clock_timestamp()) * 1000)::bigint END,
    GREATEST(0, ceil(extract(epoch FROM expires_at - clock_timestamp()) * 1000))::bigint,
    fingerprint, octet_length(result)";

type AdminRow = (Vec<u8>, i8, i32, Option<i64>, i64, Option<Vec<u8>>, Option<i32>);

/// A `state` column's letter; one this version does not know is a later version's.
fn admin_state(letter: i8) -> Result<admin::State, StoreError> {
    admin::State::from_letter(letter as u8)
        .ok_or_else(|| StoreError::NewerFormat(format::newer_state(&[letter as u8])))
}

fn admin_record(row: AdminRow) -> Result<admin::Record, StoreError> {
    let (key, state, attempts, lease_ms, ttl_ms, fingerprint, result_len) = row;
    let state = admin_state(state)?;
    let (namespace, id) = admin::Record::split(&key);
    let millis = |ms: i64| Duration::from_millis(u64::try_from(ms).unwrap_or(0));
    Ok(admin::Record {
        key,
        namespace,
        id,
        state,
        attempts: u32::try_from(attempts).unwrap_or(0),
        lease_left: lease_ms.map(millis),
        ttl_left: Some(millis(ttl_ms)),
        fingerprint: fingerprint.map(|f| admin::hex(&f)),
        result_len: result_len.map(|n| usize::try_from(n).unwrap_or(0)),
    })
}

/// The key range of a namespace: from `ns:` up to, not including, `ns;` (`;` follows
/// `:`), so the primary key's index serves it.
fn namespace_range(namespace: Option<&str>) -> (Option<Vec<u8>>, Option<Vec<u8>>) {
    match namespace {
        Some(ns) => (Some(format!("{ns}:").into_bytes()), Some(format!("{ns};").into_bytes())),
        None => (None, None),
    }
}

/// Reads the server's clock (`clock_timestamp()`). `list` walks the primary key
/// (keyset pagination: the cursor is the last key listed); `release` is one
/// `DELETE ... WHERE` the record may go; `purge` deletes expired records
/// [`PURGE_BATCH`] at a time until none are left.
#[async_trait]
impl admin::Admin for PostgresStore {
    async fn inspect(&self, key: &Key) -> Result<Option<admin::Record>, StoreError> {
        let t = self.sql.named();
        let row: Option<AdminRow> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT {ADMIN_COLUMNS} FROM {t} WHERE key = $1 AND expires_at > clock_timestamp()"
        )))
        .bind(key.stored().as_ref())
        .fetch_optional(&self.pool)
        .await
        .map_err(sql::store_error)?;
        row.map(admin_record).transpose()
    }

    async fn list(
        &self,
        filter: &admin::Filter,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<admin::Page, StoreError> {
        if filter.matches_nothing() {
            return Ok(admin::Page { records: Vec::new(), next: None });
        }
        let t = self.sql.named();
        let after = cursor.map(admin::unhex).transpose()?;
        let (from, to) = namespace_range(filter.namespace.as_deref());
        let limit = limit.max(1);
        let rows: Vec<AdminRow> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT {ADMIN_COLUMNS} FROM {t}
WHERE expires_at > clock_timestamp()
  AND state IN ('P', 'R', 'D', 'F') -- a later version's records (`format`) left out
  AND ($1::bytea IS NULL OR key > $1) AND ($2::bytea IS NULL OR key >= $2)
  AND ($3::bytea IS NULL OR key < $3) AND ($4::\"char\" IS NULL OR state = $4)
ORDER BY key LIMIT $5"
        )))
        .bind(after)
        .bind(from)
        .bind(to)
        .bind(filter.state.map(|s| s.letter() as i8))
        .bind(i64::try_from(limit).unwrap_or(i64::MAX).saturating_add(1))
        .fetch_all(&self.pool)
        .await
        .map_err(sql::store_error)?;
        let more = rows.len() > limit;
        let records =
            rows.into_iter().take(limit).map(admin_record).collect::<Result<Vec<_>, _>>()?;
        let next = match records.last() {
            Some(last) if more => Some(admin::hex(&last.key)),
            _ => None,
        };
        Ok(admin::Page { records, next })
    }

    fn record_key(&self, key: &Key) -> Vec<u8> {
        key.stored().into_owned()
    }

    async fn release_record(
        &self,
        record_key: &[u8],
        expected: Option<admin::State>,
        force: bool,
    ) -> Result<admin::Released, StoreError> {
        let t = self.sql.named();
        // The condition is checked by the DELETE itself, on the row's latest version
        // (a concurrent change makes PostgreSQL check it again); the read beside it
        // sees the record as it was, to say why it stayed.
        let row: (i64, Option<i8>, Option<bool>, Option<i64>) =
            sqlx::query_as(AssertSqlSafe(format!(
                "WITH gone AS (
    DELETE FROM {t} WHERE key = $1 AND ($3::\"char\" IS NULL OR state = $3::\"char\")
      AND ($2 OR expires_at <= clock_timestamp() OR state IN ('F', 'R')
           OR (state = 'P' AND lease_until <= clock_timestamp()))
    RETURNING expires_at > clock_timestamp() AS live
)
SELECT (SELECT count(*) FROM gone WHERE live), r.state, r.expires_at > clock_timestamp(),
       CASE WHEN r.state = 'P' AND r.lease_until > clock_timestamp()
            THEN ceil(extract(epoch FROM r.lease_until - clock_timestamp()) * 1000)::bigint END
FROM (SELECT) AS one LEFT JOIN {t} r ON r.key = $1"
            )))
            .bind(record_key)
            .bind(force)
            .bind(expected.map(|state| state.letter() as i8))
            .fetch_one(&self.pool)
            .await
            .map_err(sql::store_error)?;
        let (deleted, state, live, lease_ms) = row;
        if deleted > 0 {
            return Ok(admin::Released::Released);
        }
        let state = match (state, live) {
            (Some(letter), Some(true)) => match admin::State::from_letter(letter as u8) {
                None => return Ok(admin::Released::Refused(format::newer_refusal(letter as u8))),
                known => known,
            },
            _ => return Ok(admin::Released::NotFound),
        };
        if let Some(expected) = expected.filter(|&expected| state != Some(expected)) {
            return Ok(admin::changed(state, expected));
        }
        let lease_left = lease_ms.map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0)));
        match state.and_then(|state| admin::refusal(state, lease_left)) {
            Some(why) => Ok(admin::Released::Refused(why)),
            // Changed between the DELETE's check and the read (it went or was taken
            // over): nothing was deleted; the caller may ask again.
            None => Ok(admin::Released::Refused(
                "the record changed while it was being released: try again".to_owned(),
            )),
        }
    }

    async fn purge(&self) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let purged = self.purge_expired(PURGE_BATCH).await?;
            total += purged;
            if purged < PURGE_BATCH as u64 {
                return Ok(total);
            }
        }
    }

    async fn stats(
        &self,
        filter: &admin::Filter,
    ) -> Result<Vec<(String, admin::State, u64)>, StoreError> {
        if filter.matches_nothing() {
            return Ok(Vec::new());
        }
        let t = self.sql.named();
        let (from, to) = namespace_range(filter.namespace.as_deref());
        // The namespace is the key up to its first ':' (0x3a).
        let rows: Vec<(Vec<u8>, i8, i64)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT substring(key FROM 1 FOR GREATEST(position('\\x3a'::bytea IN key) - 1, 0)),
       state, count(*)
FROM {t}
WHERE expires_at > clock_timestamp() AND state IN ('P', 'R', 'D', 'F')
  AND ($1::bytea IS NULL OR key >= $1) AND ($2::bytea IS NULL OR key < $2)
  AND ($3::\"char\" IS NULL OR state = $3)
GROUP BY 1, 2"
        )))
        .bind(from)
        .bind(to)
        .bind(filter.state.map(|s| s.letter() as i8))
        .fetch_all(&self.pool)
        .await
        .map_err(sql::store_error)?;
        let mut stats = Vec::with_capacity(rows.len());
        for (namespace, state, count) in rows {
            let state = admin_state(state)?;
            let namespace = String::from_utf8_lossy(&namespace).into_owned();
            stats.push((namespace, state, u64::try_from(count).unwrap_or(0)));
        }
        stats.sort();
        Ok(stats)
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
        self.claim_with(key, lease, ttl, fingerprint, ClaimCommit::Durable).await
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        ttl: Duration,
        result: Option<&[u8]>,
    ) -> Result<Transition, StoreError> {
        let extra = Extra::Finish { state: b'D' as i8, ttl: millis(ttl), result };
        self.update(&mut *self.acquire().await?, &self.sql.statements().finish, key, token, extra)
            .await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<Transition, StoreError> {
        self.update(
            &mut *self.acquire().await?,
            &self.sql.statements().release,
            key,
            token,
            Extra::None,
        )
        .await
    }

    async fn fail(&self, key: &Key, token: Token, ttl: Duration) -> Result<Transition, StoreError> {
        let extra = Extra::Finish { state: b'F' as i8, ttl: millis(ttl), result: None };
        self.update(&mut *self.acquire().await?, &self.sql.statements().finish, key, token, extra)
            .await
    }

    async fn renew(
        &self,
        key: &Key,
        token: Token,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Transition, StoreError> {
        let retention = millis(crate::claim_retention(lease, ttl));
        let extra = Extra::Renew { lease: millis(lease), retention };
        self.update(self.renewal_pool(), &self.sql.statements().renew, key, token, extra).await
    }

    /// Starts the release on the current Tokio runtime and returns at once; without
    /// a runtime, the lease runs out instead.
    fn abandon(&self, key: &Key, token: Token) {
        crate::store::release_in_background(self, key, token);
    }
}

/// The row decoders, for the fuzz targets (feature `fuzzing`). Not part of the API.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    use super::{AdminRow, admin, admin_record, claim_answer};
    use crate::{Claim, StoreError, Token};

    /// The claim a claim statement's row answers.
    pub fn claim(
        outcome: &str,
        attempts: i32,
        result: Option<Vec<u8>>,
        lease_left: Option<i64>,
        token: Token,
    ) -> Result<Claim, StoreError> {
        claim_answer(outcome, attempts, result, lease_left, token, None)
    }

    /// An admin row: key, state letter, attempts, lease ms, ttl ms, fingerprint,
    /// result length.
    pub fn record(row: AdminRow) -> Result<admin::Record, StoreError> {
        admin_record(row)
    }
}
