//! What the SQL stores share: table names, the background purge, the renewals'
//! connections, durations as milliseconds, and how a database error is classified.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::StoreError;

/// The table records live in unless `with_table` says otherwise.
pub const DEFAULT_TABLE: &str = "idempotent_records";
/// One claim in this many also deletes up to [`PURGE_BATCH`] expired records, in the
/// background, so the table does not grow without a cron job.
pub const PURGE_EVERY_CLAIMS: u64 = 1024;
/// How many expired records one background purge deletes at most.
pub const PURGE_BATCH: i64 = 1000;
/// How many connections lease renewals keep, beside the pool.
pub const RENEWAL_CONNECTIONS: u32 = 2;

/// Lease renewals' own connections, opened on first use: a renewal must not wait
/// behind the handlers whose leases it keeps, which hold the pool's connections for
/// their transactions. With `pool`'s connect options and its pool options, hooks
/// included: a session set up in `after_connect` (a `search_path`, a session
/// variable) is the renewals' session too, or their statements would miss the table
/// and the lease would lapse while the handler runs.
pub(crate) fn renewal_pool<DB: sqlx::Database>(pool: &sqlx::Pool<DB>) -> sqlx::Pool<DB> {
    // No test before each acquire: a renewal is one statement, and the test's round
    // trip would double its time to answer (a broken connection fails the statement,
    // which the renewal loop sends again).
    pool.options()
        .clone()
        .test_before_acquire(false)
        .min_connections(1)
        .max_connections(RENEWAL_CONNECTIONS)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with((*pool.connect_options()).clone())
}

/// How long a call may wait for one of the pool's connections before the wait is
/// worth a warning: past it, the pool, not the database, is what paces the calls.
pub(crate) const POOL_WAIT_WARNING: Duration = Duration::from_millis(100);

/// A connection of `pool` for one of a call's statements (or, in `transactional`
/// mode, for its whole transaction). A call that found the pool full and waited
/// [`POOL_WAIT_WARNING`] or more logs a warning, at most once a minute per store
/// (`warned`), saying how to size the pool; one that got no connection within the
/// pool's acquire timeout fails with an error saying why: the pool was full, or the
/// server took no connection (sqlx reports both as "pool timed out").
pub(crate) async fn acquire<DB: sqlx::Database>(
    pool: &sqlx::Pool<DB>,
    warned: &Throttle,
) -> Result<sqlx::pool::PoolConnection<DB>, StoreError> {
    let max = pool.options().get_max_connections();
    let full = pool.num_idle() == 0 && pool.size() >= max;
    let asked_at = std::time::Instant::now();
    match pool.acquire().await {
        Ok(conn) => {
            let waited = asked_at.elapsed();
            if full && waited >= POOL_WAIT_WARNING {
                warn_pool_full(max, waited, warned);
            }
            Ok(conn)
        }
        Err(sqlx::Error::PoolTimedOut) if full => {
            let timeout = pool.options().get_acquire_timeout();
            Err(StoreError::unavailable(format!(
                "none of the store pool's {max} connections came free within {timeout:?}: \
                 more calls run at once than the pool has connections (a transactional \
                 handler holds one until it commits); give the pool more connections \
                 (`max_connections`, through the store's `connect_with` or your own pool) or \
                 run fewer calls at once"
            )))
        }
        Err(error) => Err(connect_error(error, pool.options().get_acquire_timeout())),
    }
}

/// An error opening a connection within `timeout` as a store error: sqlx tries a
/// server that refuses connections again until the timeout, then reports only "pool
/// timed out".
pub(crate) fn connect_error(error: sqlx::Error, timeout: Duration) -> StoreError {
    match error {
        sqlx::Error::PoolTimedOut => StoreError::unavailable(format!(
            "the database accepted no connection within {timeout:?}: check that the server \
             is up and reachable at the URL the store was given"
        )),
        error => store_error(error),
    }
}

/// Logs that calls queue on the pool, unless `warned` did within the minute.
fn warn_pool_full(max: u32, waited: Duration, warned: &Throttle) {
    if warned.due() {
        tracing::warn!(
            max_connections = max,
            waited_ms = u64::try_from(waited.as_millis()).unwrap_or(u64::MAX),
            "a call waited for one of the idempotency store pool's connections: more calls \
             run at once than the pool has connections, so the pool paces the consumer (a \
             transactional handler holds its connection until it commits). Give the pool \
             the consumer's concurrency plus a few (`max_connections`, through the store's \
             `connect_with` or your own pool), or lower the concurrency"
        );
    }
}

/// Lets a log line through at most once a minute.
#[derive(Debug, Default)]
pub(crate) struct Throttle {
    last: std::sync::Mutex<Option<std::time::Instant>>,
}

impl Throttle {
    const fn new() -> Throttle {
        Throttle { last: std::sync::Mutex::new(None) }
    }

    /// Whether a minute or more has passed since it last said so (true the first time).
    fn due(&self) -> bool {
        let now = std::time::Instant::now();
        let mut last = self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let due = last.is_none_or(|at| now.duration_since(at) >= Duration::from_secs(60));
        if due {
            *last = Some(now);
        }
        due
    }
}

/// Begins a transaction on a connection of `pool` in a task of its own, so that it
/// always finishes: sqlx counts a transaction as open only once the server answered
/// its `BEGIN`, so a begin dropped halfway (a start-up `timeout`, a `select!`) would
/// pool the connection inside a transaction nothing rolls back, and the claims and
/// records later written on it would stay invisible. Begun after nobody waits for it,
/// the transaction is dropped, which rolls it back.
#[cfg(feature = "postgres")]
pub(crate) async fn begin_detached<DB: sqlx::Database>(
    pool: &sqlx::Pool<DB>,
) -> Result<sqlx::Transaction<'static, DB>, StoreError> {
    let pool = pool.clone();
    match tokio::spawn(async move { pool.begin().await }).await {
        Ok(begun) => begun.map_err(StoreError::unavailable),
        Err(join) => Err(StoreError::unavailable(join)),
    }
}

/// Accepts `name` or `schema.name` made of ASCII letters, digits and `_`, not starting
/// with a digit: the name is written into SQL text, so nothing else may pass.
pub(crate) fn check_table_name(table: &str) -> Result<(), StoreError> {
    let valid = |part: &str| {
        part.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && part.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    if table.split('.').count() > 2 || !table.split('.').all(valid) {
        return Err(StoreError::Protocol(format!(
            "table name `{table}` must be `name` or `schema.name` of letters, digits and `_`"
        )));
    }
    Ok(())
}

/// Counts claims and says when one should also purge expired records.
#[derive(Debug, Default)]
pub(crate) struct PurgeSchedule {
    claims: AtomicU64,
}

impl PurgeSchedule {
    /// Counts a claim; true once every [`PURGE_EVERY_CLAIMS`].
    pub(crate) fn due(&self) -> bool {
        self.claims.fetch_add(1, Ordering::Relaxed) % PURGE_EVERY_CLAIMS == PURGE_EVERY_CLAIMS - 1
    }
}

/// Runs a purge on the current Tokio runtime without waiting for it; a failure is a
/// warning (the next purge picks the rows up). Without a runtime it does nothing.
pub(crate) fn spawn_purge<F>(purge: F)
where
    F: Future<Output = Result<u64, StoreError>> + Send + 'static,
{
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(async move {
            if let Err(error) = purge.await {
                tracing::warn!(%error, "purging expired idempotency records failed");
            }
        });
    }
}

/// A database error as a store error: one that retrying the same statement can't fix
/// (the record can't be stored: PostgreSQL's program limits, class 54; bad data, class
/// 22 on both databases; a row or value too large for MySQL) is
/// [`StoreError::Rejected`], so the message is dead-lettered instead of retried for
/// ever; anything else is [`StoreError::Unavailable`].
///
/// A records table that is missing or lacks a column (PostgreSQL's 42P01 and 42703,
/// MySQL's 1146 and 1054), and a user refused the table (42501, 1142) are
/// [`StoreError::Misconfigured`], with what to do: retried, never dead-lettered, and
/// logged at ERROR (at most once a minute), since no claim can succeed until someone
/// acts, and the message's attempts are never counted meanwhile.
pub(crate) fn store_error(error: sqlx::Error) -> StoreError {
    if let sqlx::Error::Database(db) = &error {
        let code = db.code();
        let class = |c: &str| code.as_deref().is_some_and(|code| code.starts_with(c));
        let number = mysql_number(&**db);
        // Data too long, row size too large, out of range, incorrect value.
        let mysql_data = number.is_some_and(|n| [1406, 1118, 1264, 1366].contains(&n));
        if class("54") || class("22") || mysql_data {
            return StoreError::Rejected(Box::new(error));
        }
        let what = match (code.as_deref(), number) {
            (_, Some(1146 | 1054)) | (Some("42P01" | "42703"), None) => Some(
                "the records table is missing or is not the one this version needs: \
                 run the store's `migrate()` (or apply `migration_sql()`), and check the \
                 name given to `with_table` and the connection's schema or `search_path`",
            ),
            (_, Some(1142)) | (Some("42501"), None) => Some(
                "the database user may not use the records table: grant it SELECT, \
                 INSERT, UPDATE and DELETE on the table",
            ),
            _ => None,
        };
        if let Some(what) = what {
            let text = format!("{what} ({error})");
            log_misconfigured(&text);
            return StoreError::Misconfigured(text);
        }
    }
    StoreError::unavailable(error)
}

/// Logs a configuration error at ERROR, at most once a minute for the process.
fn log_misconfigured(text: &str) {
    static LOGGED: Throttle = Throttle::new();
    if LOGGED.due() {
        tracing::error!(
            error = text,
            "the SQL store can't record anything; every claim is refused until this is fixed"
        );
    }
}

/// Whether the statement gave up waiting for a row lock (PostgreSQL's SQLSTATE 55P03,
/// MySQL's error 1205).
pub(crate) fn is_lock_timeout(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db)
        if db.code().as_deref() == Some("55P03") || mysql_number(&**db) == Some(1205))
}

/// Whether the statement failed for a concurrent change its snapshot could not see
/// (SQLSTATE 40001, under REPEATABLE READ or SERIALIZABLE).
#[cfg(feature = "postgres")]
pub(crate) fn is_serialization_failure(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db) if db.code().as_deref() == Some("40001"))
}

/// MySQL's (or MariaDB's) own error number, which says more than its SQLSTATE: many
/// errors, lock wait timeouts among them, share the catch-all `HY000`.
#[cfg(feature = "mysql")]
pub(crate) fn mysql_number(db: &dyn sqlx::error::DatabaseError) -> Option<u16> {
    db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>().map(|e| e.number())
}

#[cfg(not(feature = "mysql"))]
pub(crate) fn mysql_number(_: &dyn sqlx::error::DatabaseError) -> Option<u16> {
    None
}

/// MySQL and MariaDB errors, by number, that a retry can get past although their
/// SQLSTATE does not say so: lock wait timeout (1205), deadlock (1213), too many
/// connections (1040, 1203), server shutting down (1053), statement interrupted or
/// timed out (1317, 1969, 3024), connection killed (1927) or closed for inactivity
/// (4031), a server that is read-only for now, as during a failover (1290, 1792,
/// 1836), a write to a row changed since the transaction's snapshot under
/// MariaDB's `innodb_snapshot_isolation` (1020, on by default from 11.6.2), and a
/// statement that `binlog_format=STATEMENT` can't log at the READ COMMITTED the
/// transactional mode begins at (1665): a setting of the server, which the store
/// refuses at connect, so a message that meets it waits for the server to be fixed
/// rather than being dead-lettered.
const MYSQL_RETRYABLE: [u16; 15] =
    [1205, 1213, 1040, 1203, 1053, 1317, 1969, 3024, 1927, 4031, 1290, 1792, 1836, 1020, 1665];

/// A duration in whole milliseconds for SQL parameters: at least 1, at most
/// `Spec::MAX_DURATION` (100 years: a PostgreSQL interval ends at about 178 million
/// years, and a MySQL `DATETIME` at the end of year 9999).
pub(crate) fn millis(d: Duration) -> i64 {
    let capped = d.min(crate::execute::Spec::MAX_DURATION);
    i64::try_from(capped.as_millis()).unwrap_or(i64::MAX).max(1)
}

/// Database errors by SQLSTATE class: serialization failures and deadlocks (40),
/// lost connections (08), exhausted resources (53), operator intervention such as
/// a terminated backend (57), interrupted statements (70, MySQL's `KILL QUERY` and
/// statement timeouts), lock timeouts (55P03), a session ended for idling inside its
/// transaction (25P03, `idle_in_transaction_session_timeout`) and a server that is
/// read-only for now, as during a failover (25006), retry, as do the MySQL errors listed
/// by number in `MYSQL_RETRYABLE` whose SQLSTATE is the catch-all `HY000`; constraint
/// violations (23), bad data (22) and the rest are terminal. Connection, pool and I/O
/// errors retry; decoding and "row not found" errors are terminal.
impl crate::Classify for sqlx::Error {
    fn class(&self) -> crate::ErrorClass {
        use crate::ErrorClass::{Retryable, Terminal};
        match self {
            sqlx::Error::Database(e) => {
                let code = e.code();
                let code = code.as_deref().unwrap_or("");
                let retryable =
                    ["40", "08", "53", "57", "70"].iter().any(|class| code.starts_with(class))
                        || ["55P03", "25P03", "25006"].contains(&code)
                        || mysql_number(&**e).is_some_and(|n| MYSQL_RETRYABLE.contains(&n));
                if retryable { Retryable } else { Terminal }
            }
            sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed => Retryable,
            _ => Terminal,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use super::*;
    use crate::{Classify, ErrorClass};

    /// A database error with only a SQLSTATE, as PostgreSQL reports them.
    #[derive(Debug)]
    struct State(&'static str);

    impl std::fmt::Display for State {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "SQLSTATE {}", self.0)
        }
    }

    impl std::error::Error for State {}

    impl sqlx::error::DatabaseError for State {
        fn message(&self) -> &str {
            self.0
        }
        fn code(&self) -> Option<Cow<'_, str>> {
            Some(Cow::Borrowed(self.0))
        }
        fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
            self
        }
        fn kind(&self) -> sqlx::error::ErrorKind {
            sqlx::error::ErrorKind::Other
        }
    }

    fn error(code: &'static str) -> sqlx::Error {
        sqlx::Error::Database(Box::new(State(code)))
    }

    /// Every SQLSTATE the stores and handlers meet, in one table: how a handler's
    /// error is classed, and what a store's own statement failing with it is.
    #[test]
    fn each_sqlstate_is_classed_deliberately() {
        use ErrorClass::{Retryable, Terminal};
        #[derive(Debug, PartialEq)]
        enum Store {
            Unavailable,
            Misconfigured,
            Rejected,
        }
        let table = [
            ("40001", Retryable, Store::Unavailable), // serialization failure
            ("40P01", Retryable, Store::Unavailable), // deadlock
            ("08006", Retryable, Store::Unavailable), // connection failure
            ("53300", Retryable, Store::Unavailable), // too many connections
            ("57P01", Retryable, Store::Unavailable), // admin shutdown
            ("55P03", Retryable, Store::Unavailable), // lock not available
            ("25P03", Retryable, Store::Unavailable), // idle in transaction timeout
            ("25006", Retryable, Store::Unavailable), // read-only (failover)
            ("42P01", Terminal, Store::Misconfigured), // undefined table
            ("42703", Terminal, Store::Misconfigured), // undefined column
            ("42501", Terminal, Store::Misconfigured), // insufficient privilege
            ("23505", Terminal, Store::Unavailable),  // unique violation
            ("22001", Terminal, Store::Rejected),     // string too long
            ("54000", Terminal, Store::Rejected),     // program limit
        ];
        for (code, class, store) in table {
            assert_eq!(error(code).class(), class, "{code}");
            let got = match store_error(error(code)) {
                StoreError::Unavailable(_) => Store::Unavailable,
                StoreError::Misconfigured(text) => {
                    assert!(text.contains("migrate()") || text.contains("grant"), "{text}");
                    Store::Misconfigured
                }
                StoreError::Rejected(_) => Store::Rejected,
                other => panic!("{code}: {other:?}"),
            };
            assert_eq!(got, store, "{code}");
        }
    }
}
