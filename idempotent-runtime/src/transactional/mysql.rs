//! [`MysqlStore`]'s transactional mode.

use std::fmt::Display;
use std::future::Future;

use sqlx::mysql::MySqlRow;
use sqlx::pool::PoolConnection;
use sqlx::{MySql, Row, Transaction};

use super::{
    Transactional, TransactionalClaim, TxSlot, begin_within, commit_if_recorded,
    count_rolled_back_attempt, fail_ended, retake, rollback,
};
use crate::alert::TerminalHook;
use crate::execute::{Call, Completed, Completion, Discarded, ResultCache, Spec, run_observed};
use crate::metrics::CallMeter;
use crate::{
    Claim, Error, ErrorClass, Fingerprint, Key, MysqlStore, Outcome, Store, StoreError, Token,
    Transition,
};

impl Transactional for MysqlStore {
    type Database = MySql;

    async fn run_transactional<R, T, E, C, H, F>(
        &self,
        call: Call<R>,
        slot: &TxSlot<MySql>,
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
    slot: &'a TxSlot<MySql>,
    /// The connection the claim was won on, until `begin` starts the transaction on
    /// it: one pool checkout per message instead of two.
    conn: Option<PoolConnection<MySql>>,
    /// With [`TransactionalClaim::InTransaction`]: the transaction the claim was won
    /// in, until `begin` lends it to the handler.
    tx: Option<Transaction<'static, MySql>>,
    inline: bool,
    /// When the claim was sent.
    claimed_at: tokio::time::Instant,
}

impl Completion<MysqlStore> for InTransaction<'_> {
    /// The connection is taken from the pool before the claim, so a full pool delays
    /// the claim rather than eating into its lease, and is kept for the transaction
    /// when the claim is won. The claim commits on its own (autocommit).
    async fn claim(
        &mut self,
        store: &MysqlStore,
        key: &Key,
        spec: &Spec,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Claim, StoreError> {
        let mut conn = store.acquire().await?;
        self.claimed_at = tokio::time::Instant::now();
        if self.inline {
            let mut tx = begin_read_committed(conn, spec).await?;
            let (lease, ttl) = (spec.lease(), spec.ttl());
            let claim = store.claim_in_transaction(&mut tx, key, lease, ttl, fingerprint).await?;
            if matches!(claim, Claim::Won { .. }) {
                self.tx = Some(tx);
            }
            // Otherwise the transaction, which changed nothing, is rolled back when
            // its connection is next used.
            return Ok(claim);
        }
        let claim = store.claim_on(&mut conn, key, spec.lease(), spec.ttl(), fingerprint).await?;
        if matches!(claim, Claim::Won { .. }) {
            self.conn = Some(conn);
        }
        Ok(claim)
    }

    /// Begins the handler's transaction, unless the claim was won inside it.
    async fn begin(&mut self, _: &MysqlStore, spec: &Spec) -> Result<(), StoreError> {
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
        store: &MysqlStore,
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
        // What recording DONE answered; `None` when the claim's DONE stands as written.
        let recorded = if !self.inline {
            Some(store.complete_in_transaction(&mut tx, key, token, spec.ttl(), result).await)
        } else if result.is_some() || self.claimed_at.elapsed() > spec.lease() {
            // The claim wrote DONE, without the result, kept `ttl` + `lease` from the
            // claim: date it from now when that is too short.
            Some(store.redate_done(&mut tx, key, token, spec.ttl(), result).await)
        } else {
            None
        };
        // The statement recording DONE checks that the transaction still stands too:
        // the transaction is asked only when none ran or it changed nothing, so the
        // common path pays no round trip for the check.
        let confirmed = matches!(recorded, Some(Ok(Transition::Applied)));
        if !confirmed && !still_begun(&mut tx).await {
            rollback(tx).await;
            let inline_done = match self.inline {
                true => Some(store.fail_inline_done(key, token, spec.ttl()).await),
                false => None,
            };
            return Completed::Ended(fail_ended(store, key, token, spec, inline_done).await);
        }
        let recorded = recorded.unwrap_or(Ok(Transition::Applied));
        let completed = commit_if_recorded(tx, recorded).await;
        if self.inline && matches!(completed, Completed::Failed { effects_kept: false, .. }) {
            let claim = store.claim(key, spec.lease(), spec.ttl(), None);
            count_rolled_back_attempt(store, claim, key).await;
        }
        completed
    }

    /// With [`TransactionalClaim::InTransaction`] the rollback takes the claim with
    /// it: the key is claimed again, on its own and committed, to count the attempt
    /// and to be released or marked FAILED.
    async fn discard(
        self,
        store: &MysqlStore,
        key: &Key,
        token: Token,
        spec: &Spec,
        fingerprint: Option<&Fingerprint>,
    ) -> Discarded {
        drop(self.conn);
        if let Some(mut lent) = self.slot.take() {
            // Asked first: any other statement would clear the error it reads.
            let rolled_back = rolled_back_by_server(&mut lent).await;
            let begun = rolled_back || still_begun(&mut lent).await;
            rollback(lent).await;
            if !begun {
                let inline_done = match self.inline {
                    true => Some(store.fail_inline_done(key, token, spec.ttl()).await),
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
        retake(store.claim(key, spec.lease(), spec.ttl(), fingerprint), key).await
    }

    fn claim_committed(&self) -> bool {
        !self.inline
    }
}

/// Begins at READ COMMITTED whatever the server's default (see
/// [`crate::transactional`]), in one round trip: `SET TRANSACTION` sets the level of
/// the next transaction only, and the statements go as one text query. The same
/// round trip sets the `idempotent_begun` savepoint, which marks the
/// transaction: it goes with it however it ends. Gives up after a third of the lease.
async fn begin_read_committed(
    conn: PoolConnection<MySql>,
    spec: &Spec,
) -> Result<Transaction<'static, MySql>, StoreError> {
    let begin = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION; \
                 SAVEPOINT idempotent_begun";
    begin_within(conn, begin, spec).await
}

/// Whether `tx` is still the transaction [`begin_read_committed`] began, told by its
/// `idempotent_begun` savepoint, which is released here. It is gone once the handler's
/// transaction ended: a statement that committed implicitly (DDL, `START
/// TRANSACTION`), a `COMMIT` or `ROLLBACK` the handler sent (`AND CHAIN` too: the
/// chained transaction has no savepoints), or a rollback by the server (a deadlock; a
/// lock-wait timeout with `innodb_rollback_on_timeout`). The handler's later
/// statements ran on their own or in a transaction of their own. When the check
/// itself fails (the connection broke), the transaction is assumed to stand: nothing
/// more commits on that connection.
async fn still_begun(tx: &mut Transaction<'static, MySql>) -> bool {
    match sqlx::raw_sql("RELEASE SAVEPOINT idempotent_begun").execute(&mut **tx).await {
        Ok(_) => true,
        // 1305: the savepoint does not exist.
        Err(sqlx::Error::Database(e)) => crate::store::sql::mysql_number(&*e) != Some(1305),
        Err(_) => true,
    }
}

/// Whether the handler's last statement was refused by a rollback of its whole
/// transaction by the server: a deadlock (1213), or a lock-wait timeout (1205) on a
/// server with `innodb_rollback_on_timeout` (without it, only the statement is rolled
/// back and the transaction stands, which [`still_begun`] then tells). Its
/// transaction is gone, but nothing of it committed, and since that error is still
/// the session's last, the handler ran nothing after it: the call can be retried like
/// any rolled-back one. Read from `SHOW ERRORS`, which must be the first statement
/// after the handler's. Not told apart: a handler whose transaction had ended before
/// (DDL, its own `COMMIT`, an earlier deadlock it caught) and whose statements after
/// that committed one by one until one of them met the deadlock.
async fn rolled_back_by_server(tx: &mut Transaction<'static, MySql>) -> bool {
    let Ok(errors) = sqlx::raw_sql("SHOW ERRORS").fetch_all(&mut **tx).await else {
        return false;
    };
    let code = |row: &MySqlRow| {
        let code = row.try_get::<u32, _>("Code");
        code.ok().or_else(|| u32::try_from(row.try_get::<i64, _>("Code").ok()?).ok())
    };
    match errors.last().and_then(code) {
        Some(1213) => true,
        Some(1205) => {
            let setting =
                sqlx::query_scalar::<_, i64>("SELECT CAST(@@innodb_rollback_on_timeout AS SIGNED)");
            setting.fetch_one(&mut **tx).await.is_ok_and(|on| on != 0)
        }
        _ => false,
    }
}
