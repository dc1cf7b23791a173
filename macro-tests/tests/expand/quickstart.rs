//! The quickstart's handler (`examples/quickstart.rs`), whose expansion the crate docs
//! show; `expand.rs` checks that this file, the example and the docs agree.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use idempotent::{Classify, idempotent};

#[derive(Debug, Clone)]
struct OrderPlaced {
    order_id: u64,
    amount_cents: i64,
}

#[derive(Debug, thiserror::Error, Classify)]
enum PayError {
    #[error("database timed out")]
    #[idempotent(retryable)]
    DbTimeout,
    #[error("insufficient funds")]
    #[idempotent(terminal)]
    InsufficientFunds,
}

/// What the world saw: how many times each order was charged.
static CHARGES: LazyLock<Mutex<HashMap<u64, u32>>> = LazyLock::new(Default::default);
/// How many times each order's handler body started.
static STARTS: LazyLock<Mutex<HashMap<u64, u32>>> = LazyLock::new(Default::default);

#[idempotent(key = "order:{order_id}", ttl = "10m", lease = "5s", max_attempts = 3)]
async fn charge(msg: OrderPlaced) -> Result<u64, PayError> {
    let start = {
        let mut starts = STARTS.lock().unwrap();
        let n = starts.entry(msg.order_id).or_default();
        *n += 1;
        *n
    };
    match (msg.order_id, start) {
        (3, 1) => return Err(PayError::DbTimeout), // flaky once, then fine
        (4, 1) => tokio::time::sleep(Duration::from_secs(60)).await, // the consumer dies here
        (6, _) => return Err(PayError::DbTimeout), // down for good
        _ => {}
    }
    if msg.amount_cents > 10_000 {
        return Err(PayError::InsufficientFunds);
    }
    *CHARGES.lock().unwrap().entry(msg.order_id).or_default() += 1;
    Ok(msg.order_id)
}
