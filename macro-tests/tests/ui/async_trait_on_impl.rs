use idempotent::{Error, Outcome, async_trait, idempotent};

struct Order {
    order_id: u64,
}

#[async_trait]
trait Handler {
    async fn handle(&self, msg: &Order) -> Result<Outcome<()>, Error<std::convert::Infallible>>;
}

struct Billing;

// On the impl, not on its method.
#[idempotent(key = "order:{order_id}")]
#[async_trait]
impl Handler for Billing {
    async fn handle(&self, msg: &Order) -> Result<Outcome<()>, Error<std::convert::Infallible>> {
        let _ = msg.order_id;
        Ok(Outcome::Processed(()))
    }
}

fn main() {}
