use idempotent::{PostgresStore, idempotent};
use sqlx::{MySql, Transaction};

struct Order {
    order_id: u64,
}

/// A MySQL transaction, but the records are kept in PostgreSQL: the two can't commit
/// together.
#[idempotent(key = "order:{order_id}", store = pg, transactional)]
async fn handle(
    msg: Order,
    pg: &PostgresStore,
    tx: &mut Transaction<'_, MySql>,
) -> Result<(), sqlx::Error> {
    let _ = (msg.order_id, tx);
    Ok(())
}

fn main() {}
