//! A raw-identifier message read by a JSON pointer and `validate`, a `#[cfg]`-gated
//! first argument that is not the message, and `impl Trait` inside a tuple return
//! type all compile and run. So do infallible handlers whose value is an alias of a
//! plain type, or holds a `Result` inside another type.

use idempotent::serde_json::{Value, json};
use idempotent::{MemoryStore, Outcome, idempotent};

static STORE: std::sync::LazyLock<MemoryStore> = std::sync::LazyLock::new(MemoryStore::new);

#[idempotent(key = "{/id}", validate = true, store = STORE)]
async fn raw(r#type: Value) -> u64 {
    r#type["id"].as_u64().unwrap_or_default()
}

struct Order {
    order_id: u64,
}

#[idempotent(key = "order:{order_id}", store = STORE)]
async fn gated(#[cfg(any())] absent: u32, msg: Order) -> u64 {
    msg.order_id
}

#[idempotent(key = "tuple:{order_id}", store = STORE)]
async fn tuple(msg: Order) -> (impl std::fmt::Display, u64) {
    ("shipped", msg.order_id)
}

type Count = u64;

#[idempotent(key = "alias:{order_id}", store = STORE)]
async fn alias(msg: Order) -> Count {
    msg.order_id
}

#[idempotent(key = "nested:{order_id}", store = STORE)]
async fn nested(msg: Order) -> Option<Result<u64, String>> {
    Some(Ok(msg.order_id))
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    assert_eq!(raw(json!({"id": 3})).await.unwrap(), Outcome::Processed(3));
    assert_eq!(gated(Order { order_id: 4 }).await.unwrap(), Outcome::Processed(4));
    let shipped = tuple(Order { order_id: 5 }).await.unwrap().into_value().unwrap();
    assert_eq!((shipped.0.to_string(), shipped.1), ("shipped".to_owned(), 5));
    assert_eq!(alias(Order { order_id: 6 }).await.unwrap(), Outcome::Processed(6));
    assert_eq!(nested(Order { order_id: 7 }).await.unwrap(), Outcome::Processed(Some(Ok(7))));
}
