//! A `Result` under another name must not be read as the value of a handler that
//! cannot fail: its `Err` would be recorded as a success.

use idempotent::idempotent;

struct Order {
    order_id: u64,
}

#[derive(Debug)]
struct Declined;

type PayResult<T> = Result<T, Declined>;

#[idempotent(key = "order:{order_id}")]
async fn charge(msg: Order) -> PayResult<u64> {
    Ok(msg.order_id)
}

fn main() {}
