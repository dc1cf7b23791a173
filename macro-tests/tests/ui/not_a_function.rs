use idempotent::idempotent;

struct Order {
    order_id: u64,
}

#[idempotent(key = "order:{order_id}")]
struct Handler;

fn main() {
    let _ = Order { order_id: 1 }.order_id;
}
