use idempotent::idempotent;

struct Order {
    order_id: u64,
    customer: String,
}

// Nothing like any field.
#[idempotent(key = "order:{shipment}")]
async fn handle(msg: Order) {
    let _ = (msg.order_id, msg.customer);
}

fn main() {}
