use idempotent::{PostgresStore, idempotent};

struct Order {
    order_id: u64,
}

/// Not sqlx's transaction: the handler's writes would not commit with DONE.
struct Transaction;

#[idempotent(key = "order:{order_id}", store = pg, transactional)]
async fn handle(msg: Order, pg: &PostgresStore, tx: &mut Transaction) -> Result<(), sqlx::Error> {
    let _ = (msg.order_id, tx);
    Ok(())
}

fn main() {}
