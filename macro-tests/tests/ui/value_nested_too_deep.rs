use idempotent::idempotent;

struct Order {
    order_id: u64,
}

// A value nested deeper than the parser takes: one error, not a compiler crash.
#[idempotent(key = "order:{order_id}", store = <<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<<)]
async fn handle(msg: Order) {
    let _ = msg.order_id;
}

fn main() {}
