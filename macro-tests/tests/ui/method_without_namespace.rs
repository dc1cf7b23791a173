use idempotent::idempotent;

struct Order {
    order_id: u64,
}

struct Billing;

impl Billing {
    #[idempotent(key = "order:{order_id}")]
    async fn handle(&self, msg: Order) {
        let _ = msg.order_id;
    }
}

fn main() {}
