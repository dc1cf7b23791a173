use std::sync::Arc;

use idempotent::{MemoryStore, idempotent};

struct Order {
    id: String,
}

struct Consumer {
    store: Arc<MemoryStore>,
    tenant: String,
}

impl Consumer {
    #[idempotent(key = "{self.tenant}/{id}", store = self.store, lease = "10s", ttl = "1h", max_attempts = 3, backoff = "500ms..1m", namespace = "billing.charge")]
    async fn handle(&self, order: &Order) {
        let _ = &order.id;
    }
}
