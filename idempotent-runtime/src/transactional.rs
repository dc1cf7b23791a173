//! The transactional inbox: a handler's PostgreSQL writes and its DONE record commit
//! in one transaction (`#[idempotent(store = pg, transactional)]`).
//!
//! The claim is taken as usual, in its own statement, so concurrent duplicates wait
//! or go away instead of running the handler twice. The handler then gets a
//! transaction on the connection the claim was won on; when it returns `Ok`, the DONE
//! update (fenced by the claim's token) runs in that transaction and the transaction
//! commits. A process that dies before the commit leaves neither the business rows
//! nor DONE, and the redelivery runs the handler again. An `Err` or a panic rolls
//! back; the key is then released or, on a terminal error, recorded FAILED in its own
//! statement.

use std::fmt::Display;
use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, PoisonError};

use sqlx::pool::PoolConnection;
use sqlx::{Postgres, SqlSafeStr, Transaction};

use crate::alert::TerminalEvent;
use crate::execute::{Call, Completed, Completion, Discarded, ResultCache, Spec, run_with};
use crate::store::postgres::{ClaimCommit, TransactionalClaim};
use crate::{
    Claim, Error, ErrorClass, Fingerprint, Key, Outcome, PostgresStore, StoreError, Token,
    Transition,
};

/// Runs `body` at most once per key, with its writes and the DONE record in one
/// PostgreSQL transaction. The `#[idempotent(transactional)]` expansion calls it.
///
/// As [`run`](crate::execute::run), except that:
/// * after the claim is won, a transaction is begun on the store's pool and lent to
///   `body` through `slot` ([`TxSlot::lend`]);
/// * on `Ok`, the record is marked DONE inside that transaction, which then commits.
///   If another consumer took the key meanwhile, the transaction rolls back and the
///   call is [`Error::LeaseLost`]; if the commit fails, the key is released and the
///   call is [`Error::Store`] with `handler_ran: false` (a commit that did happen,
///   its answer lost, left the record DONE, which the release does not touch);
/// * on `Err` or a panic, the transaction rolls back before the key is released or
///   recorded FAILED;
/// * if the call is dropped mid-way, the transaction is dropped (rolled back) and the
///   key given back.
pub async fn run_transactional<R, T, E, C, H, HF, F>(
    call: Call<R>,
    store: &PostgresStore,
    slot: &TxSlot,
    classify: C,
    on_terminal: H,
    body: F,
) -> Result<Outcome<T>, Error<E>>
where
    R: ResultCache<T>,
    E: Display,
    C: FnOnce(&E) -> ErrorClass,
    H: FnOnce(TerminalEvent) -> HF,
    HF: Future<Output = ()>,
    F: Future<Output = Result<T, E>>,
{
    let completion = InTransaction {
        slot,
        conn: None,
        tx: None,
        inline: store.transactional_claim() == TransactionalClaim::InTransaction,
        claimed_at: tokio::time::Instant::now(),
    };
    run_with(call, store, completion, classify, on_terminal, body).await
}

/// A store that can commit a handler's DONE record in the handler's own transaction:
/// [`PostgresStore`], or a reference or smart pointer to one.
#[diagnostic::on_unimplemented(
    message = "`transactional` needs a `PostgresStore`, and `{Self}` is not one",
    label = "records kept here can't commit in the handler's PostgreSQL transaction",
    note = "pass a `PostgresStore` (or a reference, `Arc` or `Box` of one) as `store = ...`, \
            or drop `transactional` and record DONE separately"
)]
pub trait TransactionalStore {
    /// The PostgreSQL store.
    fn postgres_store(&self) -> &PostgresStore;
}

impl TransactionalStore for PostgresStore {
    fn postgres_store(&self) -> &PostgresStore {
        self
    }
}

impl<S: TransactionalStore + ?Sized> TransactionalStore for &S {
    fn postgres_store(&self) -> &PostgresStore {
        (**self).postgres_store()
    }
}

impl<S: TransactionalStore + ?Sized> TransactionalStore for Arc<S> {
    fn postgres_store(&self) -> &PostgresStore {
        (**self).postgres_store()
    }
}

impl<S: TransactionalStore + ?Sized> TransactionalStore for Box<S> {
    fn postgres_store(&self) -> &PostgresStore {
        (**self).postgres_store()
    }
}

/// Where [`run_transactional`] keeps the transaction while the handler borrows it.
#[derive(Default)]
pub struct TxSlot(Mutex<Option<Transaction<'static, Postgres>>>);

impl TxSlot {
    /// An empty slot.
    pub fn new() -> TxSlot {
        TxSlot::default()
    }

    /// Lends the transaction to the handler until the returned guard drops.
    ///
    /// # Panics
    /// When no transaction is in the slot: outside [`run_transactional`]'s body, or
    /// lent twice at once.
    pub fn lend(&self) -> LentTx<'_> {
        let tx = self.take().expect("the transaction is lent once, inside the handler");
        LentTx { slot: self, tx: Some(tx) }
    }

    fn put(&self, tx: Transaction<'static, Postgres>) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(tx);
    }

    fn take(&self) -> Option<Transaction<'static, Postgres>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).take()
    }
}

/// The handler's transaction, lent from a [`TxSlot`]; dereferences to the
/// [`Transaction`]. Dropping it puts the transaction back for the commit.
pub struct LentTx<'a> {
    slot: &'a TxSlot,
    tx: Option<Transaction<'static, Postgres>>,
}

impl Deref for LentTx<'_> {
    type Target = Transaction<'static, Postgres>;
    fn deref(&self) -> &Self::Target {
        self.tx.as_ref().expect("held until drop")
    }
}

impl DerefMut for LentTx<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.tx.as_mut().expect("held until drop")
    }
}

impl Drop for LentTx<'_> {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            self.slot.put(tx);
        }
    }
}

/// Claims on a pooled connection, begins the transaction on the same connection,
/// records DONE in it and commits; rolls back otherwise.
struct InTransaction<'a> {
    slot: &'a TxSlot,
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
        let mut conn = store.pool().acquire().await.map_err(StoreError::unavailable)?;
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
    ) -> Completed {
        let Some(mut tx) = self.slot.take() else {
            let error = StoreError::Protocol("the handler's transaction went missing".to_owned());
            return Completed::Failed { error, effects_kept: false };
        };
        let recorded = if !self.inline {
            store.complete_on(&mut tx, key, token, spec.ttl(), result).await
        } else if result.is_some() || self.claimed_at.elapsed() > spec.lease() {
            // The claim wrote DONE, without the result, kept `ttl` + `lease` from the
            // claim: date it from now when that is too short.
            store.redate_done(&mut tx, key, spec.ttl(), result).await
        } else {
            Ok(Transition::Applied)
        };
        match recorded {
            Ok(Transition::Applied) => match tx.commit().await {
                Ok(()) => Completed::Applied,
                // Whether it committed is unknown. The caller releases the key, which
                // only takes effect if the record is still in progress, i.e. if the
                // commit did not happen.
                Err(e) => {
                    Completed::Failed { error: StoreError::unavailable(e), effects_kept: false }
                }
            },
            Ok(Transition::LeaseLost) => {
                rollback(tx).await;
                Completed::LeaseLost
            }
            Err(error) => {
                rollback(tx).await;
                Completed::Failed { error, effects_kept: false }
            }
        }
    }

    /// With [`TransactionalClaim::InTransaction`] the rollback takes the claim with
    /// it: the key is claimed again, on its own and committed, to count the attempt
    /// and to be released or marked FAILED.
    async fn discard(
        self,
        store: &PostgresStore,
        key: &Key,
        spec: &Spec,
        fingerprint: Option<&Fingerprint>,
    ) -> Discarded {
        drop(self.conn);
        for tx in [self.tx, self.slot.take()].into_iter().flatten() {
            rollback(tx).await;
        }
        if !self.inline {
            return Discarded::Held;
        }
        let (lease, ttl) = (spec.lease(), spec.ttl());
        match store.claim_with(key, lease, ttl, fingerprint, ClaimCommit::Deferred).await {
            Ok(Claim::Won { token, .. }) => Discarded::Retaken(token),
            Ok(_) => Discarded::Gone,
            Err(error) => {
                tracing::warn!(%key, %error, "the attempt could not be recorded");
                Discarded::Gone
            }
        }
    }

    fn claim_committed(&self) -> bool {
        !self.inline
    }
}

/// Begins at READ COMMITTED on `conn`, giving up after a third of the lease. A dropped
/// or failed begin drops the connection, which the pool rolls back.
async fn begin_read_committed(
    conn: PoolConnection<Postgres>,
    spec: &Spec,
) -> Result<Transaction<'static, Postgres>, StoreError> {
    let statement = "BEGIN ISOLATION LEVEL READ COMMITTED".into_sql_str();
    let begin = Transaction::begin(conn, Some(statement));
    match tokio::time::timeout(spec.lease() / 3, begin).await {
        Ok(tx) => tx.map_err(StoreError::unavailable),
        Err(_) => Err(StoreError::unavailable(format!(
            "the handler's transaction did not begin within {:?} (a third of the lease)",
            spec.lease() / 3
        ))),
    }
}

/// Rolls back; if that fails, the connection is closed by the pool, which rolls back.
async fn rollback(tx: Transaction<'static, Postgres>) {
    if let Err(error) = tx.rollback().await {
        tracing::warn!(%error, "rollback failed; the connection is dropped instead");
    }
}
