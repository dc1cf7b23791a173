use std::sync::Arc;

use idempotent::{Error, MemoryStore, Outcome, async_trait, idempotent};

struct Order {
    id: String,
}

#[async_trait]
trait Handler {
    async fn handle(&self, order: &Order) -> Result<Outcome<()>, Error<std::convert::Infallible>>;
}

struct Consumer {
    store: Arc<MemoryStore>,
    tenant: String,
}

#[async_trait]
impl Handler for Consumer {
    #[idempotent(key = "{self.tenant}/{id}", store = self.store, namespace = "billing.charge")]
    async fn handle(&self, order: &Order) {
        let _ = &order.id;
    }
}
