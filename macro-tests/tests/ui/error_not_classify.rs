use idempotent::idempotent;

struct Order {
    order_id: u64,
}

#[derive(Debug)]
struct PayError;

impl std::fmt::Display for PayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("pay error")
    }
}

#[idempotent(key = "order:{order_id}")]
async fn handle(msg: Order) -> Result<u64, PayError> {
    Ok(msg.order_id)
}

fn main() {}
