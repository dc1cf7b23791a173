use idempotent::idempotent;

struct Order {
    order_id: u64,
}

// A format spec, as rustc's `{:?}` hint for a field without `Display` might suggest.
#[idempotent(key = "order:{order_id:?}")]
async fn handle(msg: Order) {
    let _ = msg.order_id;
}

fn main() {}
