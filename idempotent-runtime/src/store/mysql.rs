//! `MysqlStore`: records in a MySQL 8 or MariaDB 10.6+ table.

use std::fmt::Write as _;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use sqlx::mysql::{MySqlConnection, MySqlExecutor, MySqlPool, MySqlPoolOptions};
use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

use super::sql::{self, PurgeSchedule, millis};
use super::{admin, format};
use crate::{Claim, Fingerprint, Key, Store, StoreError, Token, Transition};

pub use super::sql::{DEFAULT_TABLE, PURGE_BATCH, PURGE_EVERY_CLAIMS, RENEWAL_CONNECTIONS};
pub use crate::transactional::TransactionalClaim;

/// Records in MySQL 8 or MariaDB 10.6+ (InnoDB), through an `sqlx` pool.
///
/// A record is one row keyed by `namespace:id` (`VARBINARY`, compared byte for byte)
/// holding state, attempts, claim token, lease deadline, expiry, fingerprint and
/// cached result. Times are the database's clock in UTC (`UTC_TIMESTAMP(6)`, read
/// once per statement and independent of the session's `time_zone`), so consumers'
/// clocks need not agree. Ids over [`MAX_STORED_ID_LEN`](crate::MAX_STORED_ID_LEN)
/// bytes are stored under their SHA-256 ([`Key::stored`]), so a key of any length fits
/// the primary key (InnoDB indexes at most 3072 bytes; a namespace is the program's
/// own and short).
///
/// Round trips per transition:
///
/// * **Claim: one**, an `INSERT ... ON DUPLICATE KEY UPDATE` whose assignments take
///   the record over only if it expired, was released, or is in progress with a
///   lapsed lease (and its fingerprint agrees). The answer comes back in the same
///   reply, without a result set: the first assignment passes its verdict (won, done,
///   failed, in progress, mismatch, with the attempt count) through
///   `LAST_INSERT_ID(expr)`, which the server returns in its OK packet, and a fresh
///   insert reports 0 there. Neither server can return rows from this statement
///   portably: MySQL 8 has no `RETURNING`, and MariaDB's (10.5+; 10.11 accepts it
///   with `ON DUPLICATE KEY UPDATE`) is MariaDB's alone. A duplicate whose DONE
///   record holds a cached result (`cache = true`) costs a second round trip to read
///   the result. The claim leaves the connection's `LAST_INSERT_ID()` set to its
///   verdict; the next insert into an `AUTO_INCREMENT` column sets it again.
/// * Complete, release, fail and renew: one `UPDATE ... WHERE key = ? AND state = 'P'
///   AND token = ?` each: a consumer whose lease was taken over changes nothing.
/// * In `transactional` mode: the claim, then `SET TRANSACTION ISOLATION LEVEL READ
///   COMMITTED; START TRANSACTION` in one round trip, the handler's statements, the
///   DONE update and `COMMIT`: two commits per message. With
///   [`TransactionalClaim::InTransaction`] the claim is the transaction's first
///   statement and writes DONE itself, so the DONE update goes and there is one
///   commit: `START TRANSACTION`, the claim, the handler's statements, `COMMIT`, the
///   hand-written inbox's shape (a handler that outlives its lease or caches its
///   result adds one update to date the record).
///
/// Isolation: the store's own statements are single locking statements (`INSERT ...
/// ON DUPLICATE KEY UPDATE`, `UPDATE`, `DELETE`) run in autocommit mode, so they read
/// the latest committed record whatever the session's isolation level; the one plain
/// read (a cached result) is a statement of its own too. The connections must be in
/// autocommit mode (sqlx's default). A `transactional` handler's transaction is
/// begun at READ COMMITTED whatever the server's default (REPEATABLE READ on both):
/// see [`crate::transactional`].
///
/// * Every statement waits at most [`LOCK_TIMEOUT`] for a locked record row on
///   MariaDB (`SET STATEMENT innodb_lock_wait_timeout = 2 FOR`, inside a
///   `/*M! ... */` comment that only MariaDB executes); a claim that gives up answers
///   [`Claim::InProgress`] instead of blocking. MySQL 8 can't set that per
///   statement: there the session's `innodb_lock_wait_timeout` applies (50 s unless
///   the pool's connections set less).
/// * A claim that hits a deadlock (concurrent claims on neighbouring keys can, through
///   InnoDB's gap locks) is tried again; the statement was rolled back whole.
/// * Lease renewals run on [`RENEWAL_CONNECTIONS`] connections of their own, opened
///   on first use with the pool's connect and pool options, `after_connect` included
///   (a session variable set there holds for them too), so they never wait behind
///   the handlers' transactions.
/// * The pool bounds how many calls run at once: size it for the handlers in flight
///   (in `transactional` mode each holds one connection from its claim to its
///   commit) plus a few for plain claims. [`connect`](MysqlStore::connect) opens up to
///   10; [`connect_with`](MysqlStore::connect_with) takes your pool options. A call
///   that had to wait for a connection logs a warning (at most once a minute) saying
///   so, and one that finds none within the pool's acquire timeout fails with an
///   error saying how to size the pool.
/// * Errors that retrying can't fix (a value the database refuses) are
///   [`StoreError::Rejected`]: the message is dead-lettered, not retried for ever.
/// * Expired rows are deleted in the background, [`PURGE_BATCH`] at a time, every
///   [`PURGE_EVERY_CLAIMS`] claims; or run [`purge_expired`](MysqlStore::purge_expired)
///   from a scheduler.
///
/// Create the table with [`migrate`](MysqlStore::migrate) (`CREATE TABLE IF NOT
/// EXISTS`, safe to run from several processes at once) or apply
/// [`migration_sql`](MysqlStore::migration_sql) with your own migration tool.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use idempotent_runtime::MysqlStore;
///
/// let store = MysqlStore::connect("mysql://root@127.0.0.1:3306/app").await?;
/// store.migrate().await?;
///
/// // Or on a pool of your own, in a table of your choice:
/// let pool = sqlx::mysql::MySqlPoolOptions::new()
///     .max_connections(20)
///     .connect("mysql://root@127.0.0.1:3306/app")
///     .await?;
/// let store = MysqlStore::from_pool(pool).with_table("billing.idempotency")?;
/// let ddl: String = store.migration_sql(); // for your own migration tool
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct MysqlStore {
    pool: MySqlPool,
    /// Lease renewals' own connections, opened on first use with the pool's options.
    renewals: Arc<OnceLock<MySqlPool>>,
    sql: Arc<Sql>,
    /// The statements naming the table in its database (`database.name`), once the
    /// first claim asked which database an unqualified name is in (on a connection no
    /// handler has used yet): a handler's `USE other` stays on the pooled connection
    /// and would send later claims to another database's table of that name.
    resolved: Arc<OnceLock<Sql>>,
    purge: Arc<PurgeSchedule>,
    /// When a call last warned that it waited for a connection of the pool.
    pool_waits: Arc<sql::Throttle>,
    transactional_claim: TransactionalClaim,
}

/// How long one of the store's statements waits for a locked record row on MariaDB
/// before giving up (a row stays locked while a `transactional` handler commits its
/// DONE update, or until the server notices that consumer died). A claim that gives up
/// answers [`Claim::InProgress`]. On MySQL 8 the session's `innodb_lock_wait_timeout`
/// applies instead.
pub const LOCK_TIMEOUT: Duration = Duration::from_secs(2);

impl std::fmt::Debug for MysqlStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MysqlStore").field("table", &self.sql.table).finish()
    }
}

impl MysqlStore {
    /// Connects a pool of up to 10 connections to `url`
    /// (`mysql://user:password@host:port/database`): enough for a consumer running up
    /// to about 8 calls at once. For more, use [`connect_with`](MysqlStore::connect_with).
    /// Refuses a server whose settings would break the store's promise (see
    /// [`check_server`](MysqlStore::check_server)).
    pub async fn connect(url: &str) -> Result<MysqlStore, StoreError> {
        let options = MySqlPoolOptions::new().acquire_timeout(Duration::from_secs(5));
        MysqlStore::connect_with(url, options.max_connections(10)).await
    }

    /// Connects a pool made with `options` to `url`, as [`connect`](MysqlStore::connect)
    /// does: its `max_connections` should be the consumer's concurrency plus a few
    /// (see [`MysqlStore`]).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), idempotent_runtime::StoreError> {
    /// use idempotent_runtime::MysqlStore;
    /// use sqlx::mysql::MySqlPoolOptions;
    ///
    /// // A consumer with `.concurrency(64)`:
    /// let options = MySqlPoolOptions::new().max_connections(68);
    /// let store = MysqlStore::connect_with("mysql://app@127.0.0.1/app", options).await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect_with(
        url: &str,
        options: MySqlPoolOptions,
    ) -> Result<MysqlStore, StoreError> {
        let timeout = options.get_acquire_timeout();
        let pool = options.connect(url).await.map_err(|e| sql::connect_error(e, timeout))?;
        let store = MysqlStore::from_pool(pool);
        store.check_server().await?;
        Ok(store)
    }

    /// Checks the session the pool's connections get: a binary log in
    /// `binlog_format=STATEMENT` can't log the READ COMMITTED transactions of
    /// `transactional` handlers (error 1665 on every one), so it is refused with
    /// [`StoreError::Misconfigured`], saying what to set. [`connect`](MysqlStore::connect)
    /// runs it; call it after [`from_pool`](MysqlStore::from_pool). A pool whose
    /// sessions are not in autocommit mode is refused too: no claim would commit.
    pub async fn check_server(&self) -> Result<(), StoreError> {
        let (log_bin, format, autocommit): (i64, String, i64) = sqlx::query_as(
            "SELECT @@log_bin, CAST(@@binlog_format AS CHAR), CAST(@@autocommit AS SIGNED)",
        )
        .fetch_one(&self.pool)
        .await
        .map_err(sql::store_error)?;
        if let Some(why) = binlog_refusal(log_bin != 0, &format) {
            return Err(StoreError::Misconfigured(why));
        }
        // A session outside autocommit (the server's `autocommit=0`, `init_connect`,
        // or an `after_connect` that turns it off) would leave every claim and DONE
        // uncommitted, to be rolled back when its connection goes: the handler would
        // run again at every redelivery.
        if autocommit == 0 {
            return Err(StoreError::Misconfigured(
                "the pool's sessions are not in autocommit mode (autocommit=0), so claims and \
                 DONE records would never commit: remove autocommit=0 from the server's \
                 settings, its init_connect or the pool's after_connect"
                    .to_owned(),
            ));
        }
        Ok(())
    }

    /// [`check_server`](MysqlStore::check_server), and that the records table is
    /// there with every column the store uses: a missing one is
    /// [`StoreError::Misconfigured`], naming [`migrate`](MysqlStore::migrate). Run it
    /// at start-up when the table is made by a migration tool of your own.
    pub async fn check(&self) -> Result<(), StoreError> {
        self.check_server().await?;
        let probe = format!(
            "SELECT `key`, state, attempts, token, lease_until, expires_at, fingerprint, result \
             FROM {} WHERE 1 = 0",
            self.sql.quoted
        );
        sqlx::query(AssertSqlSafe(probe)).execute(&self.pool).await.map_err(sql::store_error)?;
        // Without a unique index on `key` alone, `ON DUPLICATE KEY` never fires and
        // every claim of a key wins: each duplicate would run its handler again.
        let (database, name) = match self.sql.table.split_once('.') {
            Some((database, name)) => (Some(database), name),
            None => (None, self.sql.table.as_str()),
        };
        let unique: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM (SELECT INDEX_NAME FROM information_schema.STATISTICS \
             WHERE TABLE_SCHEMA = COALESCE(?, DATABASE()) AND TABLE_NAME = ? AND NON_UNIQUE = 0 \
             GROUP BY INDEX_NAME HAVING COUNT(*) = 1 AND MAX(COLUMN_NAME) = 'key') AS keyed",
        )
        .bind(database)
        .bind(name)
        .fetch_one(&self.pool)
        .await
        .map_err(sql::store_error)?;
        if unique == 0 {
            return Err(StoreError::Misconfigured(format!(
                "the records table {} has no primary key or unique index on `key` alone, so \
                 every claim of a key would win: make it as migrate() does (PRIMARY KEY \
                 (`key`); MysqlStore::migration_sql has the statement)",
                self.sql.table
            )));
        }
        Ok(())
    }

    /// Uses a pool configured by the caller. Its connections must be in autocommit
    /// mode (sqlx's default).
    pub fn from_pool(pool: MySqlPool) -> MysqlStore {
        MysqlStore {
            pool,
            renewals: Arc::default(),
            sql: Arc::new(Sql::new(DEFAULT_TABLE)),
            resolved: Arc::default(),
            purge: Arc::default(),
            pool_waits: Arc::default(),
            transactional_claim: TransactionalClaim::default(),
        }
    }

    /// Where `transactional` handlers take their claim: [`TransactionalClaim`] says
    /// what each choice gives and costs. Plain handlers always commit their claim.
    pub fn with_transactional_claim(mut self, claim: TransactionalClaim) -> MysqlStore {
        self.transactional_claim = claim;
        self
    }

    /// Where `transactional` handlers take their claim.
    pub fn transactional_claim(&self) -> TransactionalClaim {
        self.transactional_claim
    }

    /// Keeps records in `table` (`name` or `database.name`; letters, digits and `_`).
    pub fn with_table(mut self, table: &str) -> Result<MysqlStore, StoreError> {
        sql::check_table_name(table)?;
        self.sql = Arc::new(Sql::new(table));
        self.resolved = Arc::default();
        Ok(self)
    }

    /// The statements: naming the table in its database once a claim resolved it.
    fn statements(&self) -> &Sql {
        self.resolved.get().unwrap_or(&self.sql)
    }

    /// Resolves an unqualified table name to `database.name`, asking `conn` once.
    async fn resolve(&self, conn: &mut MySqlConnection) -> Result<(), StoreError> {
        if self.resolved.get().is_some() {
            return Ok(());
        }
        let qualified = match self.sql.table.contains('.') {
            true => self.sql.table.clone(),
            false => {
                let database: Option<String> = sqlx::query_scalar("SELECT DATABASE()")
                    .fetch_one(&mut *conn)
                    .await
                    .map_err(sql::store_error)?;
                match database {
                    Some(database) if !database.contains(['.', '`']) => {
                        format!("{database}.{}", self.sql.table)
                    }
                    // No database chosen (the name fails as it is, with its error), or
                    // one whose name can't be written as a plain part.
                    _ => self.sql.table.clone(),
                }
            }
        };
        let _ = self.resolved.set(Sql::new(&qualified));
        Ok(())
    }

    /// The pool, to run other queries on it.
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// The schema this store needs, as SQL (one statement).
    pub fn migration_sql(&self) -> String {
        let t = &self.sql.quoted;
        format!(
            "CREATE TABLE IF NOT EXISTS {t} (
    `key` VARBINARY(3072) NOT NULL,
    state CHAR(1) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    attempts INT NOT NULL,
    token BINARY(16) NULL,
    lease_until DATETIME(6) NULL,
    expires_at DATETIME(6) NOT NULL,
    fingerprint VARBINARY(32) NULL,
    result LONGBLOB NULL,
    PRIMARY KEY (`key`),
    KEY expires_at (expires_at)
) ENGINE = InnoDB"
        )
    }

    /// Creates the table if it does not exist (the server serializes concurrent
    /// callers on the table's metadata lock).
    pub async fn migrate(&self) -> Result<(), StoreError> {
        sqlx::raw_sql(AssertSqlSafe(self.migration_sql()))
            .execute(&self.pool)
            .await
            .map_err(StoreError::unavailable)?;
        self.check().await
    }

    /// Deletes up to `batch` expired records; returns how many.
    pub async fn purge_expired(&self, batch: i64) -> Result<u64, StoreError> {
        let done = sqlx::query(self.statements().purge.clone())
            .bind(batch)
            .execute(&self.pool)
            .await
            .map_err(sql::store_error)?;
        Ok(done.rows_affected())
    }

    /// A connection of the pool for a call (see [`sql::acquire`]).
    pub(crate) async fn acquire(
        &self,
    ) -> Result<sqlx::pool::PoolConnection<sqlx::MySql>, StoreError> {
        sql::acquire(&self.pool, &self.pool_waits).await
    }

    /// The renewals' pool, created on the first claim (inside the runtime).
    fn renewal_pool(&self) -> &MySqlPool {
        self.renewals.get_or_init(|| sql::renewal_pool(&self.pool))
    }

    /// [`Store::claim`] on `conn`, outside any transaction: the claim commits on its
    /// own, and `conn` can go on to run the handler's transaction.
    pub(crate) async fn claim_on(
        &self,
        conn: &mut MySqlConnection,
        key: &Key,
        lease: Duration,
        ttl: Duration,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Claim, StoreError> {
        self.renewal_pool();
        let retention = crate::claim_retention(lease, ttl);
        self.claim_with(Alone, conn, key, lease, retention, fingerprint).await
    }

    /// [`TransactionalClaim::InTransaction`]'s claim, as a statement of the caller's
    /// transaction on `conn`: the record is written DONE (kept `ttl` + `lease`), which
    /// it becomes for everyone else when, and only if, that transaction commits.
    pub(crate) async fn claim_in_transaction(
        &self,
        conn: &mut MySqlConnection,
        key: &Key,
        lease: Duration,
        ttl: Duration,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Claim, StoreError> {
        let retention = ttl.saturating_add(lease);
        self.claim_with(InTransaction, conn, key, lease, retention, fingerprint).await
    }

    /// Runs a claim (see [`claim_sql`]) and reads its verdict.
    async fn claim_with(
        &self,
        mode: ClaimMode,
        conn: &mut MySqlConnection,
        key: &Key,
        lease: Duration,
        retention: Duration,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Claim, StoreError> {
        self.maybe_purge();
        self.resolve(conn).await?;
        let stored = key.stored();
        let mut values = Values {
            key: stored.as_ref(),
            lease: micros(lease),
            retention: micros(retention),
            fingerprint: fingerprint.map(|f| f.as_bytes().as_slice()),
            ..Values::default()
        };
        let statement = match mode {
            Alone => &self.statements().claim,
            InTransaction => &self.statements().claim_done,
        };
        for _ in 0..10 {
            let token = Token::random();
            values.token = token.as_u128().to_be_bytes();
            let done = match bind(statement, &values).execute(&mut *conn).await {
                Ok(done) => done,
                // The record row stayed locked for `LOCK_TIMEOUT`: another consumer is
                // committing it, or died while it was.
                Err(e) if sql::is_lock_timeout(&e) => {
                    return Ok(Claim::InProgress { lease_left: None });
                }
                // Rolled back whole, with the transaction it was in: only a claim on
                // its own can simply be sent again (a later statement on the
                // connection would run outside any transaction).
                Err(e) if is_deadlock(&e) && mode == Alone => continue,
                Err(e) => return Err(sql::store_error(e)),
            };
            let verdict = done.last_insert_id();
            if verdict == 0 {
                // No assignment ran: the record was inserted.
                if done.rows_affected() != 1 {
                    let n = done.rows_affected();
                    return Err(StoreError::Protocol(format!("claim inserted {n} rows")));
                }
                return Ok(Claim::Won { token, attempt: 1, fence: None });
            }
            let attempts = (verdict & 0xffff_ffff) as u32;
            return match verdict >> VERDICT_SHIFT {
                WON => Ok(Claim::Won { token, attempt: attempts, fence: None }),
                DONE if verdict & CACHED != 0 => match self.cached_result(conn, &values).await? {
                    Some(result) => Ok(result),
                    // Gone or taken over since: ask again.
                    None => continue,
                },
                DONE => Ok(Claim::Done),
                FAILED => Ok(Claim::Failed { attempts }),
                // Milliseconds, or whole seconds (flagged by the cached bit) for a
                // lease longer than 32 bits of milliseconds (49.7 days).
                IN_PROGRESS if verdict & CACHED != 0 => Ok(Claim::InProgress {
                    lease_left: Some(Duration::from_secs(verdict & 0xffff_ffff)),
                }),
                IN_PROGRESS => Ok(Claim::InProgress {
                    lease_left: Some(Duration::from_millis(verdict & 0xffff_ffff)),
                }),
                MISMATCH => Ok(Claim::Mismatch),
                NEWER => Err(StoreError::NewerFormat(format::newer_state(&[verdict as u8]))),
                other => Err(StoreError::Protocol(format!("claim answered {other}"))),
            };
        }
        Err(StoreError::Protocol("claim found no answer after 10 tries".to_owned()))
    }

    /// The result a DONE record caches; `None` when the record is no longer DONE.
    async fn cached_result(
        &self,
        conn: &mut MySqlConnection,
        values: &Values<'_>,
    ) -> Result<Option<Claim>, StoreError> {
        use sqlx::Row as _;
        let row = bind(&self.statements().cached, values)
            .fetch_optional(conn)
            .await
            .map_err(sql::store_error)?;
        let Some(row) = row else { return Ok(None) };
        let result: Option<Vec<u8>> = row.try_get(0).map_err(sql::store_error)?;
        Ok(Some(result.map_or(Claim::Done, Claim::Cached)))
    }

    /// Records DONE through `conn`, inside the handler's transaction: the record
    /// becomes DONE when, and only if, that transaction commits. On MariaDB a
    /// transaction that has ended changes nothing ([`Transition::LeaseLost`]: ask
    /// the transaction's savepoint which it was).
    pub(crate) async fn complete_in_transaction(
        &self,
        conn: &mut MySqlConnection,
        key: &Key,
        token: Token,
        ttl: Duration,
        result: Option<&[u8]>,
    ) -> Result<Transition, StoreError> {
        self.complete_with(&self.statements().finish_in_transaction, conn, key, token, ttl, result)
            .await
    }

    /// Records DONE with `statement` through `on`.
    async fn complete_with(
        &self,
        statement: &Statement,
        on: impl MySqlExecutor<'_>,
        key: &Key,
        token: Token,
        ttl: Duration,
        result: Option<&[u8]>,
    ) -> Result<Transition, StoreError> {
        let stored = key.stored();
        let values = Values {
            key: stored.as_ref(),
            token: token.as_u128().to_be_bytes(),
            state: "D",
            ttl: micros(ttl),
            result,
            ..Values::default()
        };
        self.update(on, statement, &values).await
    }

    /// Dates an in-transaction claim's DONE record from now, with `result`, in the
    /// transaction on `conn` (on MariaDB, only while it stands, as
    /// [`complete_in_transaction`](Self::complete_in_transaction)).
    pub(crate) async fn redate_done(
        &self,
        conn: &mut MySqlConnection,
        key: &Key,
        token: Token,
        ttl: Duration,
        result: Option<&[u8]>,
    ) -> Result<Transition, StoreError> {
        self.complete_with(&self.statements().redate, conn, key, token, ttl, result).await
    }

    /// Turns the DONE record that a claim taken inside a handler's transaction wrote
    /// into FAILED, on its own: the handler ended that transaction early, so the
    /// implicit or explicit commit made the DONE. `false` when there is none (the
    /// claim was rolled back).
    pub(crate) async fn fail_inline_done(
        &self,
        key: &Key,
        token: Token,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let stored = key.stored();
        let values = Values {
            key: stored.as_ref(),
            token: token.as_u128().to_be_bytes(),
            ttl: micros(ttl),
            ..Values::default()
        };
        let done = self.update(&self.pool, &self.statements().fail_done, &values).await?;
        Ok(done == Transition::Applied)
    }

    async fn update(
        &self,
        on: impl MySqlExecutor<'_>,
        statement: &Statement,
        values: &Values<'_>,
    ) -> Result<Transition, StoreError> {
        let done = bind(statement, values).execute(on).await.map_err(sql::store_error)?;
        // Every update changes a column (state, or a lease deadline to the
        // microsecond), so a matched row is a changed one whether or not the
        // connection counts found rows.
        Ok(if done.rows_affected() == 1 { Transition::Applied } else { Transition::LeaseLost })
    }

    fn maybe_purge(&self) {
        if self.purge.due() {
            let store = self.clone();
            sql::spawn_purge(async move { store.purge_expired(PURGE_BATCH).await });
        }
    }
}

/// The claim's verdict, passed through `LAST_INSERT_ID(expr)`: what happened in the
/// bits from [`VERDICT_SHIFT`], whether a DONE record caches a result in bit 32, the
/// attempts in the low 32 bits (for an in-progress record, the lease's milliseconds
/// left instead, or with bit 32 set, for a lease beyond 32 bits of milliseconds, its
/// whole seconds left). 0 (a fresh insert, where no assignment ran) is never
/// a verdict.
const VERDICT_SHIFT: u32 = 33;
const WON: u64 = 1;
const DONE: u64 = 2;
const FAILED: u64 = 3;
const IN_PROGRESS: u64 = 4;
const MISMATCH: u64 = 5;
/// A state letter of a later version (`format`), the letter in the low bits.
const NEWER: u64 = 6;
const CACHED: u64 = 1 << 32;

/// Whether a claim commits on its own or is a statement of the handler's transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ClaimMode {
    Alone,
    InTransaction,
}
/// Why a server whose binary log is on (`log_bin`) in `format` is refused, if it is.
fn binlog_refusal(log_bin: bool, format: &str) -> Option<String> {
    (log_bin && format.eq_ignore_ascii_case("STATEMENT")).then(|| {
        "the server logs statements (binlog_format=STATEMENT), which it can't do for the \
         READ COMMITTED transactions of transactional handlers (error 1665, on every \
         message): set binlog_format=ROW (or MIXED), for the server or in the pool's \
         after_connect"
            .to_owned()
    })
}

use ClaimMode::{Alone, InTransaction};

/// Whether the statement was chosen as a deadlock victim (and rolled back).
fn is_deadlock(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db) if db.code().as_deref() == Some("40001"))
}

/// A duration in whole microseconds, for `INTERVAL ? MICROSECOND`.
fn micros(d: Duration) -> i64 {
    millis(d).saturating_mul(1000)
}

/// The values a statement's parameters are bound from, by name.
#[derive(Default)]
struct Values<'a> {
    key: &'a [u8],
    token: [u8; 16],
    lease: i64,
    retention: i64,
    fingerprint: Option<&'a [u8]>,
    state: &'static str,
    ttl: i64,
    result: Option<&'a [u8]>,
}

/// A statement's parameters, in the order its `?`s bind them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Param {
    Key,
    Token,
    Lease,
    Retention,
    Fingerprint,
    State,
    Ttl,
    Result,
}

/// A statement whose named parameters (`:key`, `:token`, ...) were turned into `?`s:
/// MySQL's parameters are positional, and the claim uses some several times.
struct Statement {
    sql: SqlStr,
    params: Vec<Param>,
}

impl Statement {
    fn new(named: &str) -> Statement {
        const NAMES: [(&str, Param); 8] = [
            (":key", Param::Key),
            (":token", Param::Token),
            (":lease", Param::Lease),
            (":retention", Param::Retention),
            (":fingerprint", Param::Fingerprint),
            (":state", Param::State),
            (":ttl", Param::Ttl),
            (":result", Param::Result),
        ];
        let (mut sql, mut params, mut rest) = (String::new(), Vec::new(), named);
        while let Some(at) = rest.find(':') {
            sql.push_str(&rest[..at]);
            rest = &rest[at..];
            let end =
                rest[1..].find(|c: char| !c.is_ascii_alphanumeric()).map_or(rest.len(), |e| e + 1);
            let param = NAMES.iter().find(|(name, _)| *name == &rest[..end]);
            #[allow(clippy::panic, reason = "the statements are the store's own constants")]
            let (_, param) = param.unwrap_or_else(|| panic!("unknown parameter {}", &rest[..end]));
            params.push(*param);
            sql.push('?');
            rest = &rest[end..];
        }
        sql.push_str(rest);
        Statement { sql: AssertSqlSafe(Arc::<str>::from(sql)).into_sql_str(), params }
    }
}

/// `statement` with its parameters bound from `values`.
fn bind<'a>(
    statement: &Statement,
    values: &Values<'_>,
) -> sqlx::query::Query<'a, sqlx::MySql, sqlx::mysql::MySqlArguments> {
    let mut query = sqlx::query(statement.sql.clone());
    for param in &statement.params {
        query = match param {
            Param::Key => query.bind(values.key),
            Param::Token => query.bind(values.token.as_slice()),
            Param::Lease => query.bind(values.lease),
            Param::Retention => query.bind(values.retention),
            Param::Fingerprint => query.bind(values.fingerprint),
            Param::State => query.bind(values.state),
            Param::Ttl => query.bind(values.ttl),
            Param::Result => query.bind(values.result),
        };
    }
    query
}

/// The statements, built once per table.
struct Sql {
    table: String,
    /// The table name with each part in backquotes: a valid name may still be a
    /// reserved word.
    quoted: String,
    claim: Statement,
    /// The claim that writes DONE at once, inside a handler's transaction.
    claim_done: Statement,
    /// Dates an in-transaction claim's DONE record from the handler's completion, with
    /// its cached result.
    redate: Statement,
    fail_done: Statement,
    cached: Statement,
    finish: Statement,
    /// `finish`, only inside the transaction the handler was given.
    finish_in_transaction: Statement,
    release: Statement,
    renew: Statement,
    purge: SqlStr,
}

/// The condition that a handler's transaction still stands, for the statements that
/// record DONE in it: on MariaDB `@@in_transaction` (in a `/*M! ... */` comment that
/// only MariaDB executes), so that after a handler's statement committed implicitly
/// (DDL) DONE changes nothing rather than committing on its own. MySQL has no such
/// variable, and there the condition is left out.
const STILL_IN_TRANSACTION: &str = " /*M! AND @@in_transaction = 1 */";

/// Put before each statement: MariaDB runs it with a lock wait of [`LOCK_TIMEOUT`]
/// (`SET STATEMENT ... FOR`, MariaDB's syntax, in a comment only MariaDB executes);
/// MySQL reads a comment.
const LOCK_WAIT: &str = "/*M!100300 SET STATEMENT innodb_lock_wait_timeout = 2 FOR */ ";

/// The database's clock, in UTC, fixed for the statement.
const NOW: &str = "UTC_TIMESTAMP(6)";

impl Sql {
    fn new(table: &str) -> Sql {
        debug_assert_eq!(LOCK_TIMEOUT, Duration::from_secs(2), "LOCK_WAIT says 2");
        let t: String =
            table.split('.').map(|part| format!("`{part}`")).collect::<Vec<_>>().join(".");
        let live =
            format!("`key` = :key AND state = 'P' AND token = :token AND expires_at > {NOW}");
        let finish = format!(
            "{LOCK_WAIT}UPDATE {t} SET state = :state, token = NULL, lease_until = NULL,
    expires_at = {NOW} + INTERVAL :ttl MICROSECOND, result = :result WHERE {live}"
        );
        Sql {
            table: table.to_owned(),
            claim: Statement::new(&claim_sql(&t, 'P')),
            claim_done: Statement::new(&claim_sql(&t, 'D')),
            redate: Statement::new(&format!(
                "{LOCK_WAIT}UPDATE {t} SET expires_at = {NOW} + INTERVAL :ttl MICROSECOND,
    result = :result WHERE `key` = :key AND state = 'D' AND token = :token{STILL_IN_TRANSACTION}"
            )),
            fail_done: Statement::new(&format!(
                "{LOCK_WAIT}UPDATE {t} SET state = 'F', token = NULL, result = NULL,
    expires_at = {NOW} + INTERVAL :ttl MICROSECOND WHERE `key` = :key AND state = 'D' AND token = :token"
            )),
            cached: Statement::new(&format!(
                "SELECT result FROM {t} WHERE `key` = :key AND state = 'D' AND expires_at > {NOW}"
            )),
            finish: Statement::new(&finish),
            finish_in_transaction: Statement::new(&format!("{finish}{STILL_IN_TRANSACTION}")),
            release: Statement::new(&format!(
                "{LOCK_WAIT}UPDATE {t} SET state = 'R', token = NULL, lease_until = NULL WHERE {live}"
            )),
            renew: Statement::new(&format!(
                "{LOCK_WAIT}UPDATE {t} SET lease_until = {NOW} + INTERVAL :lease MICROSECOND,
    expires_at = GREATEST(expires_at, {NOW} + INTERVAL :retention MICROSECOND) WHERE {live}"
            )),
            purge: AssertSqlSafe(format!(
                "{LOCK_WAIT}DELETE FROM {t} WHERE expires_at <= {NOW} LIMIT ?"
            ))
            .into_sql_str(),
            quoted: t,
        }
    }
}

/// The claim: inserts the record, or takes it over, or leaves it as it is, and says
/// which through `LAST_INSERT_ID` (see [`VERDICT_SHIFT`]). A won claim writes `state`:
/// `P`, in progress under a lease, or `D`, done at once, for a claim inside the
/// handler's transaction.
///
/// The first assignment decides, on the record as it was, and sets the token when
/// the claim takes it over; the others act only if that verdict, read back with
/// `LAST_INSERT_ID()` (which returns the value `LAST_INSERT_ID(expr)` just set), is
/// a win. They read no column an earlier assignment changed (`expires_at` is assigned
/// last), so the statement means the same whether assignments see the ones before
/// them (the default) or the row as it was (MariaDB's `SIMULTANEOUS_ASSIGNMENT` SQL
/// mode). The parameters are bound again where they are used rather than read with
/// `VALUES(col)`, which MySQL 8 deprecates, or an `AS new` row alias, which MariaDB
/// lacks.
fn claim_sql(t: &str, state: char) -> String {
    let won = format!("LAST_INSERT_ID() >> {VERDICT_SHIFT} = {WON}");
    format!(
        "{LOCK_WAIT}INSERT INTO {t} (`key`, state, attempts, token, lease_until, expires_at, fingerprint)
VALUES (:key, '{state}', 1, :token, {NOW} + INTERVAL :lease MICROSECOND,
        {NOW} + INTERVAL :retention MICROSECOND, :fingerprint)
ON DUPLICATE KEY UPDATE
    token = IF(LAST_INSERT_ID(CASE
            WHEN expires_at <= {NOW}
                 OR ((state = 'R' OR (state = 'P' AND lease_until <= {NOW}))
                     AND (fingerprint IS NULL OR :fingerprint IS NULL
                          OR fingerprint = :fingerprint))
                THEN ({WON} << {VERDICT_SHIFT}) | IF(expires_at <= {NOW}, 1, attempts + 1)
            WHEN state NOT IN ('P', 'R', 'D', 'F') THEN ({NEWER} << {VERDICT_SHIFT}) | ORD(state)
            WHEN fingerprint <> :fingerprint THEN {MISMATCH} << {VERDICT_SHIFT}
            WHEN state = 'D'
                THEN ({DONE} << {VERDICT_SHIFT}) | IF(result IS NULL, 0, {CACHED}) | attempts
            WHEN state = 'F' THEN ({FAILED} << {VERDICT_SHIFT}) | attempts
            ELSE ({IN_PROGRESS} << {VERDICT_SHIFT})
                 | IF(TIMESTAMPDIFF(MICROSECOND, {NOW}, lease_until) DIV 1000 > 4294967295,
                      {CACHED} | LEAST(TIMESTAMPDIFF(SECOND, {NOW}, lease_until), 4294967295),
                      GREATEST(COALESCE(TIMESTAMPDIFF(MICROSECOND, {NOW}, lease_until) DIV 1000, 0),
                               0)) END) >> {VERDICT_SHIFT} = {WON},
        :token, token),
    attempts = IF({won}, IF(expires_at <= {NOW}, 1, attempts + 1), attempts),
    result = IF({won}, NULL, result),
    state = IF({won}, '{state}', state),
    lease_until = IF({won}, {NOW} + INTERVAL :lease MICROSECOND, lease_until),
    fingerprint = IF({won},
        IF(expires_at <= {NOW}, :fingerprint, COALESCE(fingerprint, :fingerprint)), fingerprint),
    expires_at = IF({won},
        IF(expires_at <= {NOW}, {NOW} + INTERVAL :retention MICROSECOND,
           GREATEST(expires_at, {NOW} + INTERVAL :retention MICROSECOND)),
        expires_at)"
    )
}

/// The columns [`Admin`](admin::Admin) reads, against the server's clock (each one
/// cast to a signed `BIGINT` where it is a number, which is what sqlx decodes as
/// `i64`): key, state, attempts, lease ms left (live leases only, rounded up), ttl ms
/// left (rounded up), fingerprint, result length.
fn admin_columns() -> String {
    format!(
        "`key`, state, attempts,
    CASE WHEN state = 'P' AND lease_until > {NOW}
         THEN CAST((TIMESTAMPDIFF(MICROSECOND, {NOW}, lease_until) + 999) DIV 1000 AS SIGNED)
    END,
    CAST(GREATEST(0, (TIMESTAMPDIFF(MICROSECOND, {NOW}, expires_at) + 999) DIV 1000) AS SIGNED),
    fingerprint, CAST(LENGTH(result) AS SIGNED)"
    )
}

type AdminRow = (Vec<u8>, Vec<u8>, i32, Option<i64>, i64, Option<Vec<u8>>, Option<i64>);

fn admin_state(letter: &[u8]) -> Result<admin::State, StoreError> {
    match letter {
        [one] => admin::State::from_letter(*one),
        _ => None,
    }
    .ok_or_else(|| StoreError::NewerFormat(format::newer_state(letter)))
}

fn admin_record(row: AdminRow) -> Result<admin::Record, StoreError> {
    let (key, state, attempts, lease_ms, ttl_ms, fingerprint, result_len) = row;
    let state = admin_state(&state)?;
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

/// The conditions, beside the record being live, that [`Admin`](admin::Admin)'s
/// `list` (`after` the cursor) and `stats` put on the primary key and state, and the
/// values they bind, in order. A namespace is a key range, from `ns:` up to, not
/// including, `ns;` (`;` follows `:`), so the primary key's index serves it. Only the
/// conditions that apply are written: `? IS NULL OR ...` would keep the optimizer from
/// using the index's range.
fn admin_conditions(filter: &admin::Filter, after: Option<Vec<u8>>) -> (String, Vec<Vec<u8>>) {
    // Records of a later version's format (`format`) are left out.
    let mut sql = format!("expires_at > {NOW} AND state IN ('P', 'R', 'D', 'F')");
    let mut values = Vec::new();
    if let Some(after) = after {
        sql.push_str(" AND `key` > ?");
        values.push(after);
    }
    if let Some(ns) = &filter.namespace {
        sql.push_str(" AND `key` >= ? AND `key` < ?");
        values.push(format!("{ns}:").into_bytes());
        values.push(format!("{ns};").into_bytes());
    }
    if let Some(state) = filter.state {
        // A letter of a closed set: written into the text, as the store's own
        // statements write theirs.
        let _ = write!(sql, " AND state = '{}'", state.letter() as char);
    }
    (sql, values)
}

/// Reads the server's clock (`UTC_TIMESTAMP(6)`). `list` walks the primary key
/// (keyset pagination: the cursor is the last key listed); `release` is a
/// `DELETE ... WHERE` the record may go, then, when it stayed, a read to say why;
/// `purge` deletes expired records [`PURGE_BATCH`] at a time until none are left.
#[async_trait]
impl admin::Admin for MysqlStore {
    async fn inspect(&self, key: &Key) -> Result<Option<admin::Record>, StoreError> {
        let t = &self.statements().quoted;
        let columns = admin_columns();
        let row: Option<AdminRow> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT {columns} FROM {t} WHERE `key` = ? AND expires_at > {NOW}"
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
        let t = &self.statements().quoted;
        let after = cursor.map(admin::unhex).transpose()?;
        let limit = limit.max(1);
        let (conditions, values) = admin_conditions(filter, after);
        let columns = admin_columns();
        let sql = format!("SELECT {columns} FROM {t} WHERE {conditions} ORDER BY `key` LIMIT ?");
        let mut query = sqlx::query_as::<_, AdminRow>(AssertSqlSafe(sql));
        for value in values {
            query = query.bind(value);
        }
        let rows = query
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

    /// The deletes are the only writes, and each checks its own condition on the
    /// row's latest committed version (a `DELETE` is a locking read whatever the
    /// isolation level): first a live record that may go (or any live one, with
    /// `force`), then an expired one (which counts as absent: `NotFound`). The read
    /// that follows only explains why the record stayed; a record that changed in
    /// between is never deleted on the strength of that read.
    async fn release_record(
        &self,
        record_key: &[u8],
        expected: Option<admin::State>,
        force: bool,
    ) -> Result<admin::Released, StoreError> {
        let t = &self.statements().quoted;
        let mut may_go = if force {
            String::new()
        } else {
            format!(" AND (state IN ('F', 'R') OR (state = 'P' AND lease_until <= {NOW}))")
        };
        if let Some(expected) = expected {
            // A letter of ours, written like the listing's filter.
            may_go.push_str(&format!(" AND state = '{}'", expected.letter() as char));
        }
        let deleted = sqlx::query(AssertSqlSafe(format!(
            "{LOCK_WAIT}DELETE FROM {t} WHERE `key` = ? AND expires_at > {NOW}{may_go}"
        )))
        .bind(record_key)
        .execute(&self.pool)
        .await
        .map_err(sql::store_error)?;
        if deleted.rows_affected() > 0 {
            return Ok(admin::Released::Released);
        }
        let expired = sqlx::query(AssertSqlSafe(format!(
            "{LOCK_WAIT}DELETE FROM {t} WHERE `key` = ? AND expires_at <= {NOW}"
        )))
        .bind(record_key)
        .execute(&self.pool)
        .await
        .map_err(sql::store_error)?;
        if expired.rows_affected() > 0 {
            return Ok(admin::Released::NotFound);
        }
        let row: Option<(Vec<u8>, Option<i64>)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT state,
       CASE WHEN state = 'P' AND lease_until > {NOW}
            THEN CAST((TIMESTAMPDIFF(MICROSECOND, {NOW}, lease_until) + 999) DIV 1000 AS SIGNED)
       END
FROM {t} WHERE `key` = ? AND expires_at > {NOW}"
        )))
        .bind(record_key)
        .fetch_optional(&self.pool)
        .await
        .map_err(sql::store_error)?;
        // Gone since the deletes (released by someone else, or expired): absent.
        let Some((state, lease_ms)) = row else { return Ok(admin::Released::NotFound) };
        let state = match admin_state(&state) {
            Ok(state) => state,
            Err(_) => {
                let letter = state.first().copied().unwrap_or(0);
                return Ok(admin::Released::Refused(format::newer_refusal(letter)));
            }
        };
        if let Some(expected) = expected.filter(|&expected| state != expected) {
            return Ok(admin::changed(Some(state), expected));
        }
        let lease_left = lease_ms.map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0)));
        match admin::refusal(state, lease_left) {
            Some(why) => Ok(admin::Released::Refused(why)),
            // Changed between the delete's check and the read (failed, released or
            // lapsed since, or taken over): nothing was deleted; the caller may ask
            // again.
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
        let t = &self.statements().quoted;
        let (conditions, values) = admin_conditions(filter, None);
        // The namespace is the key up to its first ':' (X'3a', a binary string, so the
        // key is cut byte by byte); all of it when it has none, as `Record::split` does.
        let sql = format!(
            "SELECT SUBSTRING_INDEX(`key`, X'3a', 1), state, CAST(COUNT(*) AS SIGNED)
FROM {t} WHERE {conditions} GROUP BY 1, 2"
        );
        let mut query = sqlx::query_as::<_, (Vec<u8>, Vec<u8>, i64)>(AssertSqlSafe(sql));
        for value in values {
            query = query.bind(value);
        }
        let rows = query.fetch_all(&self.pool).await.map_err(sql::store_error)?;
        let mut counts = std::collections::BTreeMap::<(String, admin::State), u64>::new();
        for (namespace, state, count) in rows {
            let namespace = String::from_utf8_lossy(&namespace).into_owned();
            // Namespaces that differ only in bytes that are not UTF-8 fall together.
            *counts.entry((namespace, admin_state(&state)?)).or_default() +=
                u64::try_from(count).unwrap_or(0);
        }
        Ok(counts.into_iter().map(|((ns, state), n)| (ns, state, n)).collect())
    }
}

#[async_trait]
impl Store for MysqlStore {
    async fn claim(
        &self,
        key: &Key,
        lease: Duration,
        ttl: Duration,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Claim, StoreError> {
        let mut conn = self.acquire().await?;
        self.claim_on(&mut conn, key, lease, ttl, fingerprint).await
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        ttl: Duration,
        result: Option<&[u8]>,
    ) -> Result<Transition, StoreError> {
        let conn = &mut *self.acquire().await?;
        self.complete_with(&self.statements().finish, conn, key, token, ttl, result).await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<Transition, StoreError> {
        let stored = key.stored();
        let values = Values {
            key: stored.as_ref(),
            token: token.as_u128().to_be_bytes(),
            ..Values::default()
        };
        self.update(&mut *self.acquire().await?, &self.statements().release, &values).await
    }

    async fn fail(&self, key: &Key, token: Token, ttl: Duration) -> Result<Transition, StoreError> {
        let stored = key.stored();
        let values = Values {
            key: stored.as_ref(),
            token: token.as_u128().to_be_bytes(),
            state: "F",
            ttl: micros(ttl),
            ..Values::default()
        };
        self.update(&mut *self.acquire().await?, &self.statements().finish, &values).await
    }

    async fn renew(
        &self,
        key: &Key,
        token: Token,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Transition, StoreError> {
        let stored = key.stored();
        let values = Values {
            key: stored.as_ref(),
            token: token.as_u128().to_be_bytes(),
            lease: micros(lease),
            retention: micros(crate::claim_retention(lease, ttl)),
            ..Values::default()
        };
        self.update(self.renewal_pool(), &self.statements().renew, &values).await
    }

    /// Starts the release on the current Tokio runtime and returns at once; without
    /// a runtime, the lease runs out instead.
    fn abandon(&self, key: &Key, token: Token) {
        crate::store::release_in_background(self, key, token);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_statement_binary_log_is_refused_with_what_to_set() {
        let why = super::binlog_refusal(true, "STATEMENT").unwrap();
        assert!(why.contains("binlog_format=ROW"), "{why}");
        assert!(super::binlog_refusal(true, "statement").is_some());
        for (on, format) in [(true, "ROW"), (true, "MIXED"), (false, "STATEMENT")] {
            assert_eq!(super::binlog_refusal(on, format), None, "{on} {format}");
        }
    }

    use super::*;

    #[test]
    fn named_parameters_become_positional_in_order() {
        let s = Statement::new("SELECT :key, :token, :key WHERE x = :fingerprint");
        assert_eq!(s.sql.as_str(), "SELECT ?, ?, ? WHERE x = ?");
        assert_eq!(s.params, [Param::Key, Param::Token, Param::Key, Param::Fingerprint]);
    }

    #[test]
    fn table_names_are_quoted_part_by_part() {
        assert_eq!(Sql::new("billing.order").quoted, "`billing`.`order`");
    }
}

/// The row decoders, for the fuzz targets (feature `fuzzing`). Not part of the API.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    use super::{AdminRow, admin, admin_record, admin_state};
    use crate::StoreError;

    /// The state a `state` column holds.
    pub fn state(letter: &[u8]) -> Result<admin::State, StoreError> {
        admin_state(letter)
    }

    /// An admin row: key, state letter, attempts, lease ms, ttl ms, fingerprint,
    /// result length.
    pub fn record(row: AdminRow) -> Result<admin::Record, StoreError> {
        admin_record(row)
    }
}
