//! Arguments the store expression borrows stay usable in the body; a destructured
//! first argument is fine when the key reads other arguments.

use std::sync::Arc;

use idempotent::{MemoryStore, idempotent};

struct Consumer {
    store: MemoryStore,
    seen: std::sync::Mutex<Vec<u64>>,
}

struct Order {
    order_id: u64,
}

impl Consumer {
    #[idempotent(key = "order:{order_id}", store = self.store, namespace = "borrowing")]
    async fn owned_self(self: Arc<Self>, msg: Order) {
        self.seen.lock().unwrap().push(msg.order_id);
    }

    #[idempotent(key = "order:{order_id}", store = self.store, namespace = "mut_self")]
    async fn mut_self(&mut self, msg: Order) -> Result<u64, std::io::Error> {
        self.seen.get_mut().unwrap().push(msg.order_id);
        let n: u64 = "1".parse().map_err(std::io::Error::other)?;
        Ok(n + msg.order_id)
    }
}

#[idempotent(key = "pair:{id}", store = store)]
async fn pattern_first((a, b): (u32, u32), id: u64, store: &MemoryStore) -> u64 {
    u64::from(a + b) + id
}

fn main() {
    let consumer = Arc::new(Consumer { store: MemoryStore::new(), seen: Default::default() });
    let _ = consumer.owned_self(Order { order_id: 1 });
    let _ = pattern_first;
}
