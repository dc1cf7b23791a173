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

/// Lease renewals' own connections, with `pool`'s connect options, opened on first
/// use: a renewal must not wait behind the handlers whose leases it keeps, which hold
/// the pool's connections for their transactions.
pub(crate) fn renewal_pool<DB: sqlx::Database>(pool: &sqlx::Pool<DB>) -> sqlx::Pool<DB> {
    sqlx::pool::PoolOptions::<DB>::new()
        .min_connections(1)
        .max_connections(RENEWAL_CONNECTIONS)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with((*pool.connect_options()).clone())
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
pub(crate) fn store_error(error: sqlx::Error) -> StoreError {
    if let sqlx::Error::Database(db) = &error {
        let code = db.code();
        let class = |c: &str| code.as_deref().is_some_and(|code| code.starts_with(c));
        // Data too long, row size too large, out of range, incorrect value.
        let mysql_data = mysql_number(&**db).is_some_and(|n| [1406, 1118, 1264, 1366].contains(&n));
        if class("54") || class("22") || mysql_data {
            return StoreError::Rejected(Box::new(error));
        }
    }
    StoreError::unavailable(error)
}

/// Whether the statement gave up waiting for a row lock (PostgreSQL's SQLSTATE 55P03,
/// MySQL's error 1205).
pub(crate) fn is_lock_timeout(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db)
        if db.code().as_deref() == Some("55P03") || mysql_number(&**db) == Some(1205))
}

/// MySQL's (or MariaDB's) own error number, which says more than its SQLSTATE: many
/// errors, lock wait timeouts among them, share the catch-all `HY000`.
#[cfg(feature = "mysql")]
fn mysql_number(db: &dyn sqlx::error::DatabaseError) -> Option<u16> {
    db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>().map(|e| e.number())
}

#[cfg(not(feature = "mysql"))]
fn mysql_number(_: &dyn sqlx::error::DatabaseError) -> Option<u16> {
    None
}

/// MySQL and MariaDB errors, by number, that a retry can get past although their
/// SQLSTATE does not say so: lock wait timeout (1205), deadlock (1213), too many
/// connections (1040, 1203), server shutting down (1053), statement interrupted or
/// timed out (1317, 1969, 3024), connection killed (1927) or closed for inactivity
/// (4031), a server that is read-only for now, as during a failover (1290, 1792,
/// 1836), and a write to a row changed since the transaction's snapshot under
/// MariaDB's `innodb_snapshot_isolation` (1020, on by default from 11.6.2).
const MYSQL_RETRYABLE: [u16; 14] =
    [1205, 1213, 1040, 1203, 1053, 1317, 1969, 3024, 1927, 4031, 1290, 1792, 1836, 1020];

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
/// statement timeouts) and lock timeouts (55P03) retry, as do the MySQL errors listed
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
                        || code == "55P03"
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
