//! How the expansion has rustc report a wrong `transactional` store or transaction
//! argument once, on the user's token, in words about the transaction.
//!
//! ## The store
//!
//! `require_transactional(&store)` asks for [`TransactionalStore`] once, at
//! `store = ..`'s expression. The store is then handed to [`run_transactional`]
//! through `TxStore(store).transactional_store()`, which resolves to the store itself
//! ([`CheckedTxStore`]) or, when it is not transactional, one auto-reference further,
//! to a stand-in that is ([`UncheckedTxStore`]), so that `run_transactional`'s own
//! bounds report nothing more. The stand-in is never part of a program that
//! compiles; should it ever run, every operation is refused.
//!
//! ## The transaction argument
//!
//! The handler's `tx: &mut T` is bound to [`HandlerTransaction::from_lent`] at `T`'s
//! span: a `T` that is not sqlx's `Transaction` of the store's database fails that
//! trait, whose message names the type to write, instead of a type mismatch inside
//! the expansion.
//!
//! [`run_transactional`]: super::run_transactional

use std::future::Future;
use std::marker::PhantomData;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::{Database, Transaction};

use super::{LentTx, Transactional, TransactionalStore, TxSlot};
use crate::alert::TerminalHook;
use crate::execute::{Call, ResultCache};
use crate::store::{Claim, Token};
use crate::{Error, ErrorClass, Fingerprint, Key, Outcome, Store, StoreError, Transition};

/// Asks, at `store = ..`'s span, that the store be one a transaction can record in.
pub fn require_transactional<S: TransactionalStore + ?Sized>(_: &S) {}

/// `store = ..` of a `transactional` handler, for [`CheckedTxStore`] or
/// [`UncheckedTxStore`].
pub struct TxStore<'a, S: ?Sized>(pub &'a S);

/// Chosen when the store is transactional.
pub trait CheckedTxStore<'a> {
    /// The store itself.
    type Target: Transactional + ?Sized;
    /// The store itself.
    fn transactional_store(self) -> &'a Self::Target;
}

impl<'a, S: TransactionalStore + ?Sized> CheckedTxStore<'a> for TxStore<'a, S> {
    type Target = S::Target;
    fn transactional_store(self) -> &'a S::Target {
        self.0.transactional_store()
    }
}

/// Chosen otherwise, beside a [`require_transactional`] that fails to compile.
pub trait UncheckedTxStore {
    /// A store that refuses everything.
    fn transactional_store<DB: Database>(self) -> &'static NotTransactional<DB>;
}

impl<S: ?Sized> UncheckedTxStore for &TxStore<'_, S> {
    fn transactional_store<DB: Database>(self) -> &'static NotTransactional<DB> {
        // Zero-sized: leaking it allocates nothing.
        Box::leak(Box::new(NotTransactional(PhantomData)))
    }
}

/// The stand-in [`UncheckedTxStore`] gives: refuses every operation.
pub struct NotTransactional<DB>(PhantomData<fn() -> DB>);

impl<DB> NotTransactional<DB> {
    fn refusal() -> StoreError {
        StoreError::Rejected("`transactional` needs a `PostgresStore` or a `MysqlStore`".into())
    }
}

#[async_trait]
impl<DB: Database> Store for NotTransactional<DB> {
    async fn claim(
        &self,
        _: &Key,
        _: Duration,
        _: Duration,
        _: Option<&Fingerprint>,
    ) -> Result<Claim, StoreError> {
        Err(Self::refusal())
    }

    async fn complete(
        &self,
        _: &Key,
        _: Token,
        _: Duration,
        _: Option<&[u8]>,
    ) -> Result<Transition, StoreError> {
        Err(Self::refusal())
    }

    async fn release(&self, _: &Key, _: Token) -> Result<Transition, StoreError> {
        Err(Self::refusal())
    }

    async fn fail(&self, _: &Key, _: Token, _: Duration) -> Result<Transition, StoreError> {
        Err(Self::refusal())
    }

    async fn renew(
        &self,
        _: &Key,
        _: Token,
        _: Duration,
        _: Duration,
    ) -> Result<Transition, StoreError> {
        Err(Self::refusal())
    }
}

impl<DB> super::sealed::Sealed for NotTransactional<DB> {}

impl<DB: Database> Transactional for NotTransactional<DB> {
    type Database = DB;

    async fn run_transactional<R, T, E, C, H, F>(
        &self,
        _: Call<R>,
        _: &TxSlot<DB>,
        _: C,
        _: H,
        _: F,
    ) -> Result<Outcome<T>, Error<E>>
    where
        R: ResultCache<T>,
        E: std::fmt::Display,
        C: FnOnce(&E) -> ErrorClass,
        H: TerminalHook,
        F: Future<Output = Result<T, E>>,
    {
        Err(Error::Store {
            error: Self::refusal(),
            handler_ran: false,
            retry_after: Duration::ZERO,
        })
    }
}

/// What a `transactional` handler's transaction argument may be: sqlx's transaction
/// on the store's database.
#[diagnostic::on_unimplemented(
    message = "a `transactional` handler borrows sqlx's transaction on the store's database: `&mut sqlx::Transaction<'_, {DB}>`, not `&mut {Self}`",
    label = "not `sqlx::Transaction<'_, {DB}>`",
    note = "write the argument as `tx: &mut sqlx::Transaction<'_, {DB}>`; the handler's writes and the DONE record commit in it"
)]
pub trait HandlerTransaction<DB: Database> {
    /// The transaction in `lent`.
    fn from_lent<'s>(lent: &'s mut LentTx<'_, DB>) -> &'s mut Self;
}

impl<DB: Database> HandlerTransaction<DB> for Transaction<'static, DB> {
    fn from_lent<'s>(lent: &'s mut LentTx<'_, DB>) -> &'s mut Self {
        lent
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::execute::Spec;

    #[tokio::test]
    async fn the_stand_in_refuses_every_operation() {
        let store = (&TxStore(&())).transactional_store::<sqlx::Postgres>();
        let key = Key::new("t", "1").unwrap();
        let day = Duration::from_secs(86_400);
        assert!(matches!(store.claim(&key, day, day, None).await, Err(StoreError::Rejected(_))));
        let token = Token::random();
        assert!(store.complete(&key, token, day, None).await.is_err());
        assert!(store.release(&key, token).await.is_err());
        assert!(store.fail(&key, token, day).await.is_err());
        assert!(store.renew(&key, token, day, day).await.is_err());

        let mut ran = false;
        let call = Call::new(Spec::default(), Ok(key));
        let slot = TxSlot::new();
        let out = store
            .run_transactional(
                call,
                &slot,
                |_: &String| ErrorClass::Retryable,
                crate::alert::process_sink,
                async {
                    ran = true;
                    Ok::<(), String>(())
                },
            )
            .await;
        assert!(matches!(out, Err(Error::Store { handler_ran: false, .. })));
        assert!(!ran, "the handler never runs");
    }
}
