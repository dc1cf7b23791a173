use idempotent::idempotent;

struct Order {
    order_id: u64,
}

#[idempotent(key = "order:{order_id}")]
async fn handle(Order { order_id }: Order) {
    let _ = order_id;
}

fn main() {}
