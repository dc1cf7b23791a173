use idempotent::idempotent;

struct Order {
    order_id: u64,
}

struct Receipt;

#[idempotent(key = "order:{order_id}", cache)]
async fn handle(msg: Order) -> Receipt {
    let _ = msg.order_id;
    Receipt
}

fn main() {}
