use idempotent::{PostgresStore, idempotent};
use sqlx::{PgTransaction, Postgres, Transaction};

struct Order {
    order_id: u64,
}

#[idempotent(key = "order:{order_id}", store = pg, transactional)]
async fn handle(
    msg: Order,
    pg: &PostgresStore,
    tx: &mut Transaction<'_, Postgres>,
    audit: &mut PgTransaction<'_>,
) -> Result<(), sqlx::Error> {
    let _ = (msg.order_id, tx, audit);
    Ok(())
}

fn main() {}
