use idempotent::idempotent;

struct Order {
    order_id: u64,
}

#[idempotent(key = "order:{/order~2id}")]
async fn handle(msg: idempotent::serde_json::Value) {
    let _ = msg;
}

fn main() {
    let _ = Order { order_id: 1 }.order_id;
}
