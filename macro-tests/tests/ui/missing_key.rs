use idempotent::idempotent;

struct Order {
    order_id: u64,
}

#[idempotent(ttl = 600)]
async fn handle(msg: Order) {
    let _ = msg.order_id;
}

fn main() {}
