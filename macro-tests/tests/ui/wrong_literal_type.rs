use idempotent::idempotent;

struct Order {
    order_id: u64,
}

#[idempotent(key = 42, ttl = true, max_attempts = "5")]
async fn handle(msg: Order) {
    let _ = msg.order_id;
}

fn main() {}
