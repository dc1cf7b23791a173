use idempotent::{Error, Outcome, idempotent};

struct Order {
    order_id: u64,
}

trait Handler {
    // A declaration has no body to wrap: the attribute goes on each impl's method.
    #[idempotent(key = "order:{order_id}")]
    async fn handle(&self, msg: Order) -> Result<Outcome<()>, Error<std::convert::Infallible>>;
}

fn main() {
    let _ = Order { order_id: 1 }.order_id;
}
