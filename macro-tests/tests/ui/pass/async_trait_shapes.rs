//! `#[idempotent]` on methods of `#[async_trait]` impls: dispatched through
//! `Arc<dyn Handler>`, reading `self` fields in the key, `store = self.store`, with and
//! without `?Send`, fallible and not, with a custom `key_fn`.

use std::sync::Arc;

use idempotent::{Error, MemoryStore, Outcome, async_trait, idempotent};

#[derive(Debug, thiserror::Error, idempotent::Classify)]
#[idempotent(retryable)]
#[error("busy")]
struct Busy;

struct Order {
    order_id: u64,
}

#[async_trait]
trait Handler: Send + Sync {
    async fn handle(&self, msg: &Order) -> Result<Outcome<u64>, Error<Busy>>;
    async fn by_value(&self, msg: Order) -> Result<Outcome<()>, Error<std::convert::Infallible>>;
}

struct Billing {
    store: Arc<MemoryStore>,
    tenant: String,
}

fn order_key(msg: &Order) -> u64 {
    msg.order_id
}

#[async_trait]
impl Handler for Billing {
    #[idempotent(key = "{self.tenant}:{order_id}", store = self.store, namespace = "billing.handle")]
    async fn handle(&self, msg: &Order) -> Result<u64, Busy> {
        Ok(msg.order_id)
    }

    #[idempotent(key_fn = order_key, store = self.store, namespace = "billing.by_value")]
    async fn by_value(&self, msg: Order) {
        let _ = msg.order_id;
    }
}

/// `?Send`: the future need not be `Send`.
#[async_trait(?Send)]
trait LocalHandler {
    async fn handle(&self, msg: Order) -> Result<Outcome<u64>, Error<Busy>>;
}

struct Local {
    store: std::rc::Rc<MemoryStore>,
}

#[async_trait(?Send)]
impl LocalHandler for Local {
    #[idempotent(key = "{order_id}", store = self.store, namespace = "local")]
    async fn handle(&self, msg: Order) -> Result<u64, Busy> {
        Ok(msg.order_id)
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let handler: Arc<dyn Handler> =
        Arc::new(Billing { store: Arc::new(MemoryStore::new()), tenant: "acme".into() });
    assert_eq!(handler.handle(&Order { order_id: 1 }).await.unwrap(), Outcome::Processed(1));
    assert_eq!(handler.handle(&Order { order_id: 1 }).await.unwrap(), Outcome::Duplicate);
    let spawned = tokio::spawn({
        let handler = handler.clone();
        async move { handler.by_value(Order { order_id: 2 }).await }
    });
    assert_eq!(spawned.await.unwrap().unwrap(), Outcome::Processed(()));
    assert_eq!(handler.by_value(Order { order_id: 2 }).await.unwrap(), Outcome::Duplicate);

    let local = Local { store: std::rc::Rc::new(MemoryStore::new()) };
    assert_eq!(local.handle(Order { order_id: 3 }).await.unwrap(), Outcome::Processed(3));
    assert_eq!(local.handle(Order { order_id: 3 }).await.unwrap(), Outcome::Duplicate);
}
