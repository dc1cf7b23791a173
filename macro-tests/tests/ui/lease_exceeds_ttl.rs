use idempotent::idempotent;

struct Order {
    order_id: u64,
}

#[idempotent(key = "order:{order_id}", ttl = 60, lease = "2m")]
async fn handle(msg: Order) {
    let _ = msg.order_id;
}

fn main() {}
