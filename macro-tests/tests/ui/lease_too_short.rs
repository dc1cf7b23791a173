use idempotent::idempotent;

struct Order {
    order_id: u64,
}

#[idempotent(key = "order:{order_id}", ttl = "20ms", lease = "10ms")]
async fn handle(msg: Order) {
    let _ = msg.order_id;
}

fn main() {}
