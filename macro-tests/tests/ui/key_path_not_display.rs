use idempotent::idempotent;

struct Id(u64);

struct Customer {
    id: Id,
}

struct Order {
    customer: Customer,
}

// A field path: rustc can only point at the whole template.
#[idempotent(key = "customer:{customer.id}")]
async fn handle(msg: Order) {
    let _ = msg.customer.id.0;
}

fn main() {}
