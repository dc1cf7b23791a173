use idempotent::idempotent;

struct Order {
    order_id: u64,
}

fn order_key(msg: &Order) -> u64 {
    msg.order_id
}

#[idempotent(key = "order:{order_id}", key_fn = order_key)]
async fn handle(msg: Order) {
    let _ = msg.order_id;
}

fn main() {}
