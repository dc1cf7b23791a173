//! What the SQL stores share: table names, the background purge, durations as
//! milliseconds, and how a database error is classified.

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
/// (the record can't be stored: program limits, class 54; bad data, class 22) is
/// [`StoreError::Rejected`], so the message is dead-lettered instead of retried for
/// ever; anything else is [`StoreError::Unavailable`].
pub(crate) fn store_error(error: sqlx::Error) -> StoreError {
    if let sqlx::Error::Database(db) = &error {
        let code = db.code();
        if code.as_deref().is_some_and(|c| c.starts_with("54") || c.starts_with("22")) {
            return StoreError::Rejected(Box::new(error));
        }
    }
    StoreError::unavailable(error)
}

/// Whether the statement gave up waiting for a row lock (SQLSTATE 55P03).
pub(crate) fn is_lock_timeout(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db) if db.code().as_deref() == Some("55P03"))
}

/// A duration in whole milliseconds for SQL parameters: at least 1, at most
/// `Spec::MAX_DURATION` (a PostgreSQL interval ends at about 178 million years).
pub(crate) fn millis(d: Duration) -> i64 {
    let capped = d.min(crate::execute::Spec::MAX_DURATION);
    i64::try_from(capped.as_millis()).unwrap_or(i64::MAX).max(1)
}

/// Database errors by SQLSTATE class: serialization failures and deadlocks (40),
/// lost connections (08), exhausted resources (53), operator intervention such as
/// a terminated backend (57) and lock timeouts (55P03) retry; constraint
/// violations (23), bad data (22) and the rest are terminal. Connection, pool and
/// I/O errors retry; decoding and "row not found" errors are terminal.
impl crate::Classify for sqlx::Error {
    fn class(&self) -> crate::ErrorClass {
        use crate::ErrorClass::{Retryable, Terminal};
        match self {
            sqlx::Error::Database(e) => {
                let code = e.code();
                let code = code.as_deref().unwrap_or("");
                let retryable =
                    ["40", "08", "53", "57"].iter().any(|class| code.starts_with(class))
                        || code == "55P03";
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
