//! A mistake in the attribute of an `#[async_trait]` method is one error: the method
//! keeps the signature the trait declares, so no mismatch against the trait follows.
use std::sync::Arc;

use idempotent::{Error, MemoryStore, Outcome, async_trait, idempotent};

struct Order {
    order_id: u64,
}

#[async_trait]
trait Handler {
    async fn handle(&self, msg: &Order) -> Result<Outcome<u64>, Error<std::io::Error>>;
}

struct Billing {
    store: Arc<MemoryStore>,
}

#[async_trait]
impl Handler for Billing {
    #[idempotent(key = "order:{order_id}", store = self.store, namespace = "billing", tll = 60)]
    async fn handle(&self, msg: &Order) -> Result<u64, std::io::Error> {
        Ok(msg.order_id)
    }
}

fn main() {}
