//! [`PostgresStore`]'s transactional mode.

use std::fmt::Display;
use std::future::Future;

use sqlx::pool::PoolConnection;
use sqlx::{Postgres, Transaction};

use super::{
    Transactional, TxSlot, begin_within, commit_if_recorded, count_rolled_back_attempt, fail_ended,
    retake, rollback,
};
use crate::alert::TerminalHook;
use crate::execute::{Call, Completed, Completion, Discarded, ResultCache, Spec, run_observed};
use crate::metrics::CallMeter;
use crate::store::postgres::{ClaimCommit, TransactionalClaim};
use crate::{
    Claim, Error, ErrorClass, Fingerprint, Key, Outcome, PostgresStore, StoreError, Token,
    Transition,
};

impl Transactional for PostgresStore {
    type Database = Postgres;

    async fn run_transactional<R, T, E, C, H, F>(
        &self,
        call: Call<R>,
        slot: &TxSlot<Postgres>,
        classify: C,
        on_terminal: H,
        body: F,
    ) -> Result<Outcome<T>, Error<E>>
    where
        R: ResultCache<T>,
        E: Display,
        C: FnOnce(&E) -> ErrorClass,
        H: TerminalHook,
        F: Future<Output = Result<T, E>>,
    {
        let completion = InTransaction {
            slot,
            conn: None,
            tx: None,
            inline: self.transactional_claim() == TransactionalClaim::InTransaction,
            claimed_at: tokio::time::Instant::now(),
        };
        run_observed(call, self, completion, classify, on_terminal, body).await
    }
}

/// Claims on a pooled connection, begins the transaction on the same connection,
/// records DONE in it and commits; rolls back otherwise.
struct InTransaction<'a> {
    slot: &'a TxSlot<Postgres>,
    /// The connection the claim was won on, until `begin` starts the transaction on
    /// it: one pool checkout per message instead of two (each costs a round trip to
    /// test the connection, and another when it goes back).
    conn: Option<PoolConnection<Postgres>>,
    /// With [`TransactionalClaim::InTransaction`]: the transaction the claim was won
    /// in, until `begin` lends it to the handler.
    tx: Option<Transaction<'static, Postgres>>,
    /// Whether the claim is taken inside the handler's transaction.
    inline: bool,
    /// When the claim was sent.
    claimed_at: tokio::time::Instant,
}

impl Completion<PostgresStore> for InTransaction<'_> {
    /// The claim's commit need not wait for its WAL flush here: a claim lost in a
    /// server crash only makes the DONE update find nothing, which rolls the handler's
    /// writes back, and the DONE commit flushes the claim anyway.
    ///
    /// The connection is taken from the pool before the claim, so a full pool delays
    /// the claim rather than eating into its lease, and is kept for the transaction
    /// when the claim is won.
    async fn claim(
        &mut self,
        store: &PostgresStore,
        key: &Key,
        spec: &Spec,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Claim, StoreError> {
        let mut conn = store.acquire().await?;
        let (lease, ttl) = (spec.lease(), spec.ttl());
        self.claimed_at = tokio::time::Instant::now();
        if self.inline {
            let mut tx = begin_read_committed(conn, spec).await?;
            let claim = store.claim_in_transaction(&mut tx, key, lease, ttl, fingerprint).await?;
            if matches!(claim, Claim::Won { .. }) {
                self.tx = Some(tx);
            }
            // Otherwise the transaction, which changed nothing, is rolled back when its
            // connection is next used.
            return Ok(claim);
        }
        let claim =
            store.claim_on(&mut conn, key, lease, ttl, fingerprint, ClaimCommit::Deferred).await?;
        if matches!(claim, Claim::Won { .. }) {
            self.conn = Some(conn);
        }
        Ok(claim)
    }

    /// Begins at READ COMMITTED whatever the database's default: lease renewals update
    /// the record row from other connections while the handler runs, and a snapshot
    /// isolation level would refuse the DONE update for it (SQLSTATE 40001). Gives up
    /// after a third of the lease, the renewal period, which is not running yet.
    async fn begin(&mut self, _: &PostgresStore, spec: &Spec) -> Result<(), StoreError> {
        let tx = match (self.tx.take(), self.conn.take()) {
            (Some(tx), _) => tx,
            (None, Some(conn)) => begin_read_committed(conn, spec).await?,
            (None, None) => {
                let error = "the claim's connection went missing".to_owned();
                return Err(StoreError::Protocol(error));
            }
        };
        self.slot.put(tx);
        Ok(())
    }

    async fn complete(
        self,
        store: &PostgresStore,
        key: &Key,
        token: Token,
        spec: &Spec,
        result: Option<&[u8]>,
        _: &CallMeter,
    ) -> Completed {
        let Some(mut tx) = self.slot.take() else {
            let error = StoreError::Protocol("the handler's transaction went missing".to_owned());
            return Completed::Failed { error, effects_kept: false };
        };
        let inline = self.inline.then_some(self.claimed_at);
        let mut recorded = record_done(store, &mut tx, inline, key, token, spec, result).await;
        // The statement recording DONE checks that the transaction still stands too:
        // the transaction is asked only when none ran or it changed nothing, so the
        // common path pays no round trip for the check.
        let confirmed = matches!(recorded, Some(Ok(Transition::Applied)));
        let begun = if confirmed { Begun::Marked } else { still_begun(&mut tx).await };
        if begun == Begun::Unmarked && remark(&mut tx).await {
            recorded = record_done(store, &mut tx, inline, key, token, spec, result).await;
        }
        if begun == Begun::Aborted {
            // Its `COMMIT` would be answered as a rollback, without an error.
            recorded = Some(Err(StoreError::unavailable(ABORTED)));
        }
        if begun == Begun::Ended {
            rollback(tx).await;
            let inline_done = match self.inline {
                true => Some(store.fail_inline_done(key, spec.ttl()).await),
                false => None,
            };
            return Completed::Ended(fail_ended(store, key, token, spec, inline_done).await);
        }
        let recorded = recorded.unwrap_or(Ok(Transition::Applied));
        let completed = commit_if_recorded(tx, recorded).await;
        if self.inline && matches!(completed, Completed::Failed { effects_kept: false, .. }) {
            let (lease, ttl) = (spec.lease(), spec.ttl());
            let claim = store.claim_with(key, lease, ttl, None, ClaimCommit::Deferred);
            count_rolled_back_attempt(store, claim, key).await;
        }
        completed
    }

    /// With [`TransactionalClaim::InTransaction`] the rollback takes the claim with
    /// it: the key is claimed again, on its own and committed, to count the attempt
    /// and to be released or marked FAILED.
    async fn discard(
        self,
        store: &PostgresStore,
        key: &Key,
        token: Token,
        spec: &Spec,
        fingerprint: Option<&Fingerprint>,
    ) -> Discarded {
        drop(self.conn);
        if let Some(mut lent) = self.slot.take() {
            let begun = still_begun(&mut lent).await;
            rollback(lent).await;
            if begun == Begun::Ended {
                let inline_done = match self.inline {
                    true => Some(store.fail_inline_done(key, spec.ttl()).await),
                    false => None,
                };
                return Discarded::Ended(fail_ended(store, key, token, spec, inline_done).await);
            }
        }
        if let Some(tx) = self.tx {
            rollback(tx).await;
        }
        if !self.inline {
            return Discarded::Held;
        }
        let (lease, ttl) = (spec.lease(), spec.ttl());
        retake(store.claim_with(key, lease, ttl, fingerprint, ClaimCommit::Deferred), key).await
    }

    fn claim_committed(&self) -> bool {
        !self.inline
    }
}

/// Records DONE in the handler's transaction; `None` when the claim taken in it
/// (`inline`, with when it was sent) wrote DONE and that stands as written.
async fn record_done(
    store: &PostgresStore,
    tx: &mut Transaction<'static, Postgres>,
    inline: Option<tokio::time::Instant>,
    key: &Key,
    token: Token,
    spec: &Spec,
    result: Option<&[u8]>,
) -> Option<Result<Transition, StoreError>> {
    match inline {
        None => Some(store.complete_in_transaction(tx, key, token, spec.ttl(), result).await),
        // The claim wrote DONE, without the result, kept `ttl` + `lease` from the
        // claim: date it from now when that is too short.
        Some(claimed_at) if result.is_some() || claimed_at.elapsed() > spec.lease() => {
            Some(store.redate_done(tx, key, spec.ttl(), result).await)
        }
        Some(_) => None,
    }
}

/// Begins at READ COMMITTED on `conn`, giving up after a third of the lease. The
/// same round trip marks the transaction twice, with marks that go when it ends, so
/// that [`still_begun`] can tell it from one the handler began after ending it:
/// `SET LOCAL idempotent.transaction`, which the DONE statement checks at no cost,
/// and a shared advisory lock (class `0x69646d70`, object the backend's pid, so that
/// sessions share no lock entry), asked only when the
/// first is missing (a handler's `RESET ALL` clears it, not the lock).
async fn begin_read_committed(
    conn: PoolConnection<Postgres>,
    spec: &Spec,
) -> Result<Transaction<'static, Postgres>, StoreError> {
    let begin = "BEGIN ISOLATION LEVEL READ COMMITTED; \
                 SET LOCAL idempotent.transaction = 'begun'; \
                 SELECT pg_advisory_xact_lock_shared(1768189296, pg_backend_pid())";
    begin_within(conn, begin, spec).await
}

/// Whether the handler's transaction is the one [`begin_read_committed`] began.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Begun {
    /// It is, and marked.
    Marked,
    /// It is, but its `SET LOCAL` mark was cleared (`RESET ALL`).
    Unmarked,
    /// It ended: a handler that sent its own `COMMIT` or `ROLLBACK` (`AND CHAIN`
    /// too) ended it, and its later statements ran on their own or in a transaction
    /// of their own.
    Ended,
    /// It stands but is aborted (a statement of it failed: the handler returned Ok
    /// over an error it did not return): nothing of it can commit.
    Aborted,
}

/// Why a call whose handler succeeded in an aborted transaction is not DONE.
const ABORTED: &str = "the handler's transaction was aborted by a statement error the handler \
    did not return (SQLSTATE 25P02 after it): nothing of it committed, so the message is \
    retried; return the statement's error, or roll back to a savepoint of your own after it";

/// Asks which [`Begun`] `tx` is. Assumed [`Begun::Marked`] when the check can't be
/// made (the connection failed: nothing more commits on it).
async fn still_begun(tx: &mut Transaction<'static, Postgres>) -> Begun {
    let marks = sqlx::query_as::<_, (bool, bool)>(
        // `pg_locks` reads the whole lock table under every partition's lock: asked
        // only when the mark is missing (`CASE` evaluates the branch it takes), not on
        // every message of a claim taken in the transaction.
        "SELECT marked, CASE WHEN marked THEN true ELSE \
                EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' \
                        AND pid = pg_backend_pid() AND classid = 1768189296 \
                        AND objid::bigint = pg_backend_pid() \
                        AND objsubid = 2 AND mode = 'ShareLock' AND granted) END \
         FROM (SELECT coalesce(current_setting('idempotent.transaction', true) = 'begun', \
                               false) AS marked) AS mark",
    )
    .fetch_one(&mut **tx)
    .await;
    match marks {
        Ok((true, _)) => Begun::Marked,
        Ok((false, true)) => Begun::Unmarked,
        Ok((false, false)) => Begun::Ended,
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("25P02") => Begun::Aborted,
        Err(_) => Begun::Marked,
    }
}

/// Sets the `SET LOCAL` mark again in a transaction that still holds its lock;
/// whether it was.
async fn remark(tx: &mut Transaction<'static, Postgres>) -> bool {
    sqlx::query("SELECT set_config('idempotent.transaction', 'begun', true)")
        .execute(&mut **tx)
        .await
        .is_ok()
}
