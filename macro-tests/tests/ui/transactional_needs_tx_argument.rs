use idempotent::{PostgresStore, idempotent};

struct Order {
    order_id: u64,
}

#[idempotent(key = "order:{order_id}", store = pg, transactional)]
async fn handle(msg: Order, pg: &PostgresStore) -> Result<(), sqlx::Error> {
    let _ = msg.order_id;
    Ok(())
}

fn main() {}
