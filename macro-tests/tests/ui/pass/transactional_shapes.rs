//! `transactional` with the transaction first, an alias type, a `mut` binding, a
//! store behind `Arc` on `self`, a JSON payload with `validate`, and `cache`.

use std::sync::Arc;

use idempotent::{Outcome, PostgresStore, idempotent};
use idempotent::serde_json::Value;
use sqlx::PgTransaction;

struct Ledger {
    store: Arc<PostgresStore>,
}

impl Ledger {
    #[idempotent(key = "order:{/order_id}", store = self.store, transactional, validate, cache, namespace = "tx_shapes")]
    async fn debit(&self, mut tx: &mut PgTransaction<'_>, msg: &Value) -> Result<u64, sqlx::Error> {
        sqlx::query("SELECT 1").execute(&mut **tx).await?;
        tx = &mut *tx;
        sqlx::query("SELECT 2").execute(&mut **tx).await?;
        Ok(msg["order_id"].as_u64().unwrap_or(0))
    }
}

fn assert_send<T: Send>(_: T) {}

fn handler_is_send(ledger: Ledger, order: Value) {
    assert_send(async move {
        let _: Result<Outcome<u64>, idempotent::Error<sqlx::Error>> = ledger.debit(&order).await;
    });
}

fn main() {
    let _ = handler_is_send;
}
