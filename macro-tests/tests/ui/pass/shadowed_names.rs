//! User names that collide with what the expansion uses do not break it.
#![allow(dead_code, non_camel_case_types)]

use idempotent::{MemoryStore, idempotent};

struct Result;
struct Outcome;
struct Error;
struct Duration;
struct Spec;
mod core {}
mod std {}

struct Order {
    order_id: u64,
}

#[idempotent(key = "order:{order_id}", store = store)]
async fn handle(msg: Order, store: &MemoryStore, key: u32) -> u64 {
    let __idempotent_key = key;
    let __idempotent_store = 1;
    msg.order_id + __idempotent_key as u64 + __idempotent_store
}

fn main() {
    let store = MemoryStore::new();
    let _ = handle(Order { order_id: 1 }, &store, 2);
}
