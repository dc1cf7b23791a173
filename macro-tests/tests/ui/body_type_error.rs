use idempotent::idempotent;

struct Order {
    order_id: u64,
}

#[idempotent(key = "order:{order_id}")]
async fn handle(msg: Order) -> Result<u64, std::io::Error> {
    Ok("not a number")
}

fn main() {}
