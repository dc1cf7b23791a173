//! The transactional inbox: a handler's SQL writes and its DONE record commit in one
//! transaction (`#[idempotent(store = db, transactional)]`), on PostgreSQL
//! (`PostgresStore`, feature `postgres`) or MySQL / MariaDB
//! (`MysqlStore`, feature `mysql`).
//!
//! The claim is taken as usual, in its own statement, so concurrent duplicates wait
//! or go away instead of running the handler twice. The handler then gets a
//! transaction on the connection the claim was won on; when it returns `Ok`, the DONE
//! update (fenced by the claim's token) runs in that transaction and the transaction
//! commits. A process that dies before the commit leaves neither the business rows
//! nor DONE, and the redelivery runs the handler again. An `Err` or a panic rolls
//! back; the key is then released or, on a terminal error, recorded FAILED in its own
//! statement.
//!
//! Isolation: the handler's transaction is begun at READ COMMITTED whatever the
//! database's default. The DONE update must see the record as lease renewals from
//! other connections left it: PostgreSQL's snapshot levels refuse such an update
//! (SQLSTATE 40001), and so does MariaDB's REPEATABLE READ with
//! `innodb_snapshot_isolation` on (error 1020). MySQL's REPEATABLE READ would let it
//! through (an `UPDATE` reads the latest row), but READ COMMITTED also spares the
//! handler's writes InnoDB's gap locks, which make concurrent consumers wait on each
//! other. A handler that needs a stable read takes a lock (`SELECT ... FOR UPDATE`).

use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, PoisonError};

use sqlx::{Database, SqlSafeStr, Transaction};

use crate::alert::TerminalHook;
use crate::execute::{Call, Completed, Discarded, ResultCache, Spec};
use crate::{Error, ErrorClass, Outcome, Store, StoreError, Transition};

#[doc(hidden)]
pub mod check;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;

/// Where a `transactional` handler's claim is taken
/// (`PostgresStore::with_transactional_claim`, `MysqlStore::with_transactional_claim`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransactionalClaim {
    /// In its own statement, committed before the handler's transaction begins
    /// (on PostgreSQL without waiting for its WAL flush); DONE is recorded in that
    /// transaction. A concurrent duplicate sees the claim at once and is answered
    /// [`InProgress`](crate::Outcome::InProgress); a consumer that dies mid-handler
    /// has still used up an attempt, so a message that kills its consumer every time
    /// is dead-lettered after `max_attempts`; the lease is renewed while the handler
    /// runs and lapses when its consumer stops.
    #[default]
    Committed,
    /// As the first statement of the handler's transaction, which records DONE right
    /// away: nothing about the message is committed until the handler's writes are,
    /// which saves a commit per message, and on PostgreSQL a statement too (the
    /// hand-written inbox's cost, with a claim). What it gives up:
    ///
    /// * a concurrent duplicate meets a record row locked by the transaction: on
    ///   PostgreSQL it is answered `InProgress` at once (the claim also takes a
    ///   transaction-scoped advisory lock on the key's hash, and a duplicate that
    ///   can't take it does not wait); on MySQL, which has no transaction-scoped
    ///   advisory locks, it waits for the transaction, and then gets the committed
    ///   answer or `InProgress`: on MariaDB up to the store's `LOCK_TIMEOUT` (2 s); on
    ///   MySQL 8, which can't bound one statement's lock wait, up to the session's
    ///   `innodb_lock_wait_timeout` (50 s unless the pool's connections set less, as
    ///   `SET SESSION innodb_lock_wait_timeout = 2` in `after_connect`);
    /// * attempts are counted when a handler returns an error or panics, or its
    ///   transaction fails to commit, but not when its consumer dies or its call is
    ///   dropped mid-handler (that rolls the attempt
    ///   back with everything else), so a message that kills its consumer every time
    ///   is redelivered for ever instead of being dead-lettered after `max_attempts`;
    /// * there is no lease: the claim lasts as long as the transaction, so a handler
    ///   that hangs without its consumer dying (or its call being dropped) holds the
    ///   key until its connection closes, and `lease` only caps how much longer than
    ///   `ttl` the DONE record may be kept;
    /// * a handler that takes longer than its lease, or caches its result, pays one
    ///   more statement to date the DONE record from its completion;
    /// * a claim-first consumer of the same record (a plain handler on this store, or
    ///   another process configured otherwise) waits up to the store's
    ///   `LOCK_TIMEOUT` (on MySQL 8, the session's `innodb_lock_wait_timeout`) on a
    ///   record this mode holds before answering `InProgress`.
    InTransaction,
}

/// Runs `body` at most once per key, with its writes and the DONE record in one
/// transaction. The `#[idempotent(transactional)]` expansion calls it.
///
/// As [`run`](crate::execute::run), except that:
/// * after the claim is won, a transaction is begun on the connection the claim was
///   won on and lent to `body` through `slot` ([`TxSlot::lend`]);
/// * on `Ok`, the record is marked DONE inside that transaction, which then commits.
///   If another consumer took the key meanwhile, the transaction rolls back and the
///   call is [`Error::LeaseLost`]; if the commit fails, the key is released and the
///   call is [`Error::Store`] with `handler_ran: false` (a commit that did happen,
///   its answer lost, left the record DONE, which the release does not touch);
/// * on `Err` or a panic, the transaction rolls back before the key is released or
///   recorded FAILED;
/// * if the call is dropped mid-way, the transaction is dropped (rolled back) and the
///   key given back.
pub async fn run_transactional<S, R, T, E, C, H, F>(
    call: Call<R>,
    store: &S,
    slot: &TxSlot<S::Database>,
    classify: C,
    on_terminal: H,
    body: F,
) -> Result<Outcome<T>, Error<E>>
where
    S: Transactional + ?Sized,
    R: ResultCache<T>,
    E: std::fmt::Display,
    C: FnOnce(&E) -> ErrorClass,
    H: TerminalHook,
    F: Future<Output = Result<T, E>>,
{
    store.run_transactional(call, slot, classify, on_terminal, body).await
}

/// A store whose DONE record can commit in the handler's own transaction:
/// `PostgresStore` and `MysqlStore` (each with its feature).
/// Sealed: the work is done by each store's own code.
pub trait Transactional: Store + sealed::Sealed {
    /// The database the handler's transaction runs on.
    type Database: Database;

    /// [`run_transactional`] for this store.
    #[doc(hidden)]
    #[allow(async_fn_in_trait)]
    async fn run_transactional<R, T, E, C, H, F>(
        &self,
        call: Call<R>,
        slot: &TxSlot<Self::Database>,
        classify: C,
        on_terminal: H,
        body: F,
    ) -> Result<Outcome<T>, Error<E>>
    where
        R: ResultCache<T>,
        E: std::fmt::Display,
        C: FnOnce(&E) -> ErrorClass,
        H: TerminalHook,
        F: Future<Output = Result<T, E>>;
}

mod sealed {
    pub trait Sealed {}
    #[cfg(feature = "postgres")]
    impl Sealed for crate::PostgresStore {}
    #[cfg(feature = "mysql")]
    impl Sealed for crate::MysqlStore {}
}

/// What `store = ...` may name for a `transactional` handler: a
/// [`Transactional`] store, or a reference or smart pointer to one.
#[diagnostic::on_unimplemented(
    message = "`transactional` needs a `PostgresStore` or a `MysqlStore`, and `{Self}` is not one",
    label = "records kept here can't commit in the handler's SQL transaction",
    note = "pass a `PostgresStore` or `MysqlStore` (or a reference, `Arc`, `Box` or \
            `LazyLock` of one) as `store = ...`, or drop `transactional` and record DONE \
            separately"
)]
pub trait TransactionalStore {
    /// The store itself.
    type Target: Transactional + ?Sized;

    /// The store itself.
    fn transactional_store(&self) -> &Self::Target;
}

#[cfg(feature = "postgres")]
impl TransactionalStore for crate::PostgresStore {
    type Target = crate::PostgresStore;
    fn transactional_store(&self) -> &Self::Target {
        self
    }
}

#[cfg(feature = "mysql")]
impl TransactionalStore for crate::MysqlStore {
    type Target = crate::MysqlStore;
    fn transactional_store(&self) -> &Self::Target {
        self
    }
}

impl<S: TransactionalStore + ?Sized> TransactionalStore for &S {
    type Target = S::Target;
    fn transactional_store(&self) -> &Self::Target {
        (**self).transactional_store()
    }
}

impl<S: TransactionalStore + ?Sized> TransactionalStore for Arc<S> {
    type Target = S::Target;
    fn transactional_store(&self) -> &Self::Target {
        (**self).transactional_store()
    }
}

impl<S: TransactionalStore + ?Sized> TransactionalStore for Box<S> {
    type Target = S::Target;
    fn transactional_store(&self) -> &Self::Target {
        (**self).transactional_store()
    }
}

impl<S: TransactionalStore, F: FnOnce() -> S> TransactionalStore for std::sync::LazyLock<S, F> {
    type Target = S::Target;
    fn transactional_store(&self) -> &Self::Target {
        (**self).transactional_store()
    }
}

/// Where [`run_transactional`] keeps the transaction while the handler borrows it.
pub struct TxSlot<DB: Database>(Mutex<Option<Transaction<'static, DB>>>);

impl<DB: Database> Default for TxSlot<DB> {
    fn default() -> Self {
        TxSlot(Mutex::new(None))
    }
}

impl<DB: Database> TxSlot<DB> {
    /// An empty slot.
    pub fn new() -> TxSlot<DB> {
        TxSlot::default()
    }

    /// An empty slot for `store`'s database.
    pub fn for_store<S: Transactional<Database = DB> + ?Sized>(store: &S) -> TxSlot<DB> {
        let _ = store;
        TxSlot::default()
    }

    /// Lends the transaction to the handler until the returned guard drops.
    ///
    /// # Panics
    /// When no transaction is in the slot: outside [`run_transactional`]'s body, or
    /// lent twice at once.
    #[allow(clippy::expect_used, reason = "documented: the expansion lends it once per call")]
    pub fn lend(&self) -> LentTx<'_, DB> {
        let tx = self.take().expect("the transaction is lent once, inside the handler");
        LentTx { slot: self, tx: Some(tx) }
    }

    pub(crate) fn put(&self, tx: Transaction<'static, DB>) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(tx);
    }

    pub(crate) fn take(&self) -> Option<Transaction<'static, DB>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).take()
    }
}

/// The handler's transaction, lent from a [`TxSlot`]; dereferences to the
/// [`Transaction`]. Dropping it puts the transaction back for the commit.
pub struct LentTx<'a, DB: Database> {
    slot: &'a TxSlot<DB>,
    tx: Option<Transaction<'static, DB>>,
}

impl<DB: Database> LentTx<'_, DB> {
    /// The transaction, as the handler's argument's type `T`: sqlx's [`Transaction`]
    /// on `DB`, which anything else fails to compile, with a message saying so.
    pub fn as_handler_tx<T: check::HandlerTransaction<DB> + ?Sized>(&mut self) -> &mut T {
        T::from_lent(self)
    }
}

impl<DB: Database> Deref for LentTx<'_, DB> {
    type Target = Transaction<'static, DB>;
    #[allow(clippy::expect_used, reason = "`tx` is only taken in `drop`")]
    fn deref(&self) -> &Self::Target {
        self.tx.as_ref().expect("held until drop")
    }
}

impl<DB: Database> DerefMut for LentTx<'_, DB> {
    #[allow(clippy::expect_used, reason = "`tx` is only taken in `drop`")]
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.tx.as_mut().expect("held until drop")
    }
}

impl<DB: Database> Drop for LentTx<'_, DB> {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            self.slot.put(tx);
        }
    }
}

/// Begins the handler's transaction on `conn` with `statement`, giving up after a
/// third of the lease (the renewal period; renewal is not running yet).
///
/// The begin runs as a task of its own, so it always finishes: sqlx counts a
/// transaction as open only once the server has answered its `BEGIN`, so a begin
/// dropped halfway (a consumer's deadline, a shutdown, this function's own timeout)
/// would give the connection back to the pool inside a transaction that nothing will
/// roll back, and the next autocommit statement on it would hold its locks,
/// uncommitted, while it stays pooled. A transaction that begins after nobody waits
/// for it is dropped, which rolls it back before the connection is pooled again.
pub(crate) async fn begin_within<DB: Database>(
    conn: sqlx::pool::PoolConnection<DB>,
    statement: &'static str,
    spec: &Spec,
) -> Result<Transaction<'static, DB>, StoreError> {
    let begin = tokio::spawn(Transaction::begin(conn, Some(statement.into_sql_str())));
    match crate::execute::within(tokio::time::Instant::now() + spec.lease() / 3, begin).await {
        Some(Ok(tx)) => tx.map_err(StoreError::unavailable),
        Some(Err(join)) => Err(StoreError::unavailable(join)),
        None => Err(StoreError::unavailable(format!(
            "the handler's transaction did not begin within {:?} (a third of the lease)",
            spec.lease() / 3
        ))),
    }
}

/// Ends the handler's transaction once the DONE update ran in it: commits when the
/// update applied, rolls back when the claim was lost or the update failed.
pub(crate) async fn commit_if_recorded<DB: Database>(
    tx: Transaction<'static, DB>,
    recorded: Result<Transition, StoreError>,
) -> Completed {
    match recorded {
        Ok(Transition::Applied) => match tx.commit().await {
            Ok(()) => Completed::Applied,
            // Whether it committed is unknown. The caller releases the key, which only
            // takes effect if the record is still in progress, i.e. if the commit did
            // not happen.
            Err(e) => Completed::Failed { error: StoreError::unavailable(e), effects_kept: false },
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

/// What happened when a handler's transaction is found to have ended before its
/// DONE record.
const ENDED: &str = "the handler's transaction ended before its DONE record was written \
    (a COMMIT or ROLLBACK the handler sent, AND CHAIN too, or a statement that commits \
    implicitly such as DDL or START TRANSACTION): the writes before that committed or were \
    rolled back, and those after it committed one by one or in a transaction of their own";

/// After the handler's transaction ended early (its connection already given back):
/// records the key FAILED on its own, so that a redelivery neither runs the handler
/// again over writes that stand nor takes a DONE that the handler's own commit wrote
/// as the truth. `inline_done`: with the claim taken inside the transaction, whether
/// the store turned a DONE committed with it into FAILED (`Ok(false)`: there was none,
/// the claim was rolled back; the key is claimed again to be failed). Returns the
/// error the call ends with (dead-letter).
pub(crate) async fn fail_ended<S: Store + ?Sized>(
    store: &S,
    key: &crate::Key,
    token: crate::Token,
    spec: &Spec,
    inline_done: Option<Result<bool, StoreError>>,
) -> StoreError {
    let failed = |token| async move {
        store.fail(key, token, spec.ttl()).await.map(|done| done == Transition::Applied)
    };
    let recorded = match inline_done {
        None => failed(token).await,
        Some(Ok(false)) => {
            match retake(store.claim(key, spec.lease(), spec.ttl(), None), key).await {
                Discarded::Retaken(token) => failed(token).await,
                _ => Ok(false),
            }
        }
        Some(done) => done,
    };
    let what = match recorded {
        Ok(true) => "the key is recorded FAILED, so the message does not run again".to_owned(),
        Ok(false) => "the key could not be recorded FAILED: another consumer holds it".to_owned(),
        Err(error) => format!("recording the key FAILED failed too ({error})"),
    };
    StoreError::Rejected(
        format!(
            "{ENDED}; {what}. Check this message's writes by hand; releasing the key (the \
             `idempotent` command) lets it run again. A handler must leave its transaction \
             to the store: no COMMIT, ROLLBACK or DDL inside it"
        )
        .into(),
    )
}

/// Rolls back; if that fails, the connection is closed by the pool, which rolls back.
pub(crate) async fn rollback<DB: Database>(tx: Transaction<'static, DB>) {
    if let Err(error) = tx.rollback().await {
        tracing::warn!(%error, "rollback failed; the connection is dropped instead");
    }
}

/// After an in-transaction claim was rolled back with the handler's writes: the key
/// claimed again, on its own and committed, to count the attempt and to be released
/// or marked FAILED.
/// After the transaction of a claim taken inside it failed to commit: the claim went
/// with it, so its attempt was not counted. Claims the key again, on its own and
/// committed, and releases it, so that a commit that fails every time (a constraint
/// checked at commit) ends `Abandoned` after `max_attempts`, as failing attempts do,
/// instead of being retried for ever. Changes nothing when the record moved on (the
/// commit happened after all, or another consumer holds the key).
pub(crate) async fn count_rolled_back_attempt<S: Store + ?Sized>(
    store: &S,
    claim: impl Future<Output = Result<crate::Claim, StoreError>>,
    key: &crate::Key,
) {
    if let Discarded::Retaken(token) = retake(claim, key).await {
        if let Err(error) = store.release(key, token).await {
            tracing::warn!(key = %key.logged(), %error, "the attempt was counted but not released; its lease will run out");
        }
    }
}

pub(crate) async fn retake(
    claim: impl Future<Output = Result<crate::Claim, StoreError>>,
    key: &crate::Key,
) -> Discarded {
    match claim.await {
        Ok(crate::Claim::Won { token, .. }) => Discarded::Retaken(token),
        Ok(_) => Discarded::Gone,
        Err(error) => {
            tracing::warn!(key = %key.logged(), %error, "the attempt could not be recorded");
            Discarded::Gone
        }
    }
}
