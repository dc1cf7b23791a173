use idempotent::idempotent;

struct Order {
    order_id: u64,
}

struct Consumer;

impl Consumer {
    #[idempotent(key = "order:{order_id}", message = self, namespace = "orders")]
    async fn handle(&self, msg: Order) {
        let _ = msg.order_id;
    }
}

fn main() {}
