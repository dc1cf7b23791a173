use idempotent::idempotent;

struct Order {
    order_id: u64,
}

struct Id(u64);

struct Keyed {
    id: Id,
}

#[idempotent(key = "k:{id}")]
async fn handle(msg: Keyed) {
    let _ = msg.id.0;
}

fn main() {
    let _ = Order { order_id: 1 }.order_id;
}
