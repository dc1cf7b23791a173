use idempotent::{MemoryStore, idempotent};
use sqlx::{Postgres, Transaction};

struct Order {
    order_id: u64,
}

#[idempotent(key = "order:{order_id}", store = store, transactional)]
async fn handle(
    msg: Order,
    store: &MemoryStore,
    tx: &mut Transaction<'_, Postgres>,
) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").bind(msg.order_id as i64).execute(&mut **tx).await?;
    Ok(())
}

fn main() {}
