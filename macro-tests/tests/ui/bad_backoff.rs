use idempotent::idempotent;

struct Order {
    order_id: u64,
}

// Not a range nor a duration.
#[idempotent(key = "order:{order_id}", backoff = "1s-5m")]
async fn dash(msg: Order) {
    let _ = msg.order_id;
}

// A float is not a duration.
#[idempotent(key = "order:{order_id}", backoff = 1.5)]
async fn float(msg: Order) {
    let _ = msg.order_id;
}

// The cap below the base.
#[idempotent(key = "order:{order_id}", backoff = "5m..1s")]
async fn inverted(msg: Order) {
    let _ = msg.order_id;
}

// A retry that waits nothing.
#[idempotent(key = "order:{order_id}", backoff = "0ms..1s")]
async fn zero(msg: Order) {
    let _ = msg.order_id;
}

// Given twice.
#[idempotent(key = "order:{order_id}", backoff = "1s", backoff = "2s")]
async fn twice(msg: Order) {
    let _ = msg.order_id;
}

fn main() {}
