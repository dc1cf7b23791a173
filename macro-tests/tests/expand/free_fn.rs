use idempotent::{Classify, idempotent};

struct OrderPlaced {
    order_id: u64,
    customer: Customer,
}

struct Customer {
    id: u64,
}

#[derive(Debug, Classify)]
#[idempotent(retryable)]
struct PayError;

impl std::fmt::Display for PayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("pay error")
    }
}

#[idempotent(key = "order:{order_id}:{customer.id}", ttl = 600)]
async fn process_order(msg: OrderPlaced) -> Result<u64, PayError> {
    Ok(msg.order_id)
}
