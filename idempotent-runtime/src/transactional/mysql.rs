//! [`MysqlStore`]'s transactional mode.

use std::fmt::Display;
use std::future::Future;

use sqlx::pool::PoolConnection;
use sqlx::{MySql, SqlSafeStr, Transaction};

use super::{Transactional, TxSlot, begin_within, commit_if_recorded, rollback};
use crate::alert::TerminalEvent;
use crate::execute::{Call, Completed, Completion, Discarded, ResultCache, Spec, run_with};
use crate::{Claim, Error, ErrorClass, Fingerprint, Key, MysqlStore, Outcome, StoreError, Token};

impl Transactional for MysqlStore {
    type Database = MySql;

    async fn run_transactional<R, T, E, C, H, HF, F>(
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
        H: FnOnce(TerminalEvent) -> HF,
        HF: Future<Output = ()>,
        F: Future<Output = Result<T, E>>,
    {
        let completion = InTransaction { slot, conn: None };
        run_with(call, self, completion, classify, on_terminal, body).await
    }
}

/// Claims on a pooled connection, begins the transaction on the same connection,
/// records DONE in it and commits; rolls back otherwise.
struct InTransaction<'a> {
    slot: &'a TxSlot<MySql>,
    /// The connection the claim was won on, until `begin` starts the transaction on
    /// it: one pool checkout per message instead of two.
    conn: Option<PoolConnection<MySql>>,
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
        let mut conn = store.pool().acquire().await.map_err(StoreError::unavailable)?;
        let claim = store.claim_on(&mut conn, key, spec.lease(), spec.ttl(), fingerprint).await?;
        if matches!(claim, Claim::Won { .. }) {
            self.conn = Some(conn);
        }
        Ok(claim)
    }

    /// Begins at READ COMMITTED whatever the server's default (see
    /// [`crate::transactional`]), in one round trip: `SET TRANSACTION` sets the level
    /// of the next transaction only, and the two statements go as one text query.
    async fn begin(&mut self, _: &MysqlStore, spec: &Spec) -> Result<(), StoreError> {
        let Some(conn) = self.conn.take() else {
            return Err(StoreError::Protocol("the claim's connection went missing".to_owned()));
        };
        let statement =
            "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION".into_sql_str();
        let tx = begin_within(Transaction::begin(conn, Some(statement)), spec).await?;
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
    ) -> Completed {
        let Some(mut tx) = self.slot.take() else {
            let error = StoreError::Protocol("the handler's transaction went missing".to_owned());
            return Completed::Failed { error, effects_kept: false };
        };
        let recorded = store.complete_on(&mut *tx, key, token, spec.ttl(), result).await;
        commit_if_recorded(tx, recorded).await
    }

    async fn discard(
        self,
        _: &MysqlStore,
        _: &Key,
        _: &Spec,
        _: Option<&Fingerprint>,
    ) -> Discarded {
        drop(self.conn);
        if let Some(tx) = self.slot.take() {
            rollback(tx).await;
        }
        Discarded::Held
    }
}
