use idempotent::idempotent;

struct Order {
    order_id: u64,
}

fn always_retry(_: &std::convert::Infallible) -> idempotent::ErrorClass {
    idempotent::ErrorClass::Retryable
}

#[idempotent(key = "order:{order_id}", classify = always_retry)]
async fn handle(msg: Order) -> u64 {
    msg.order_id
}

fn main() {}
