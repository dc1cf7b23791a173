use idempotent::{PostgresStore, idempotent};
use sqlx::{Postgres, Transaction};

struct Order {
    order_id: u64,
}

#[idempotent(key = "order:{order_id}", store = pg, transactional)]
async fn handle(msg: Order, pg: &PostgresStore, tx: &mut Transaction<'_, Postgres>) {
    let _ = (msg.order_id, tx);
}

fn main() {}
