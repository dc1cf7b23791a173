//! Arguments and return types passed through `macro_rules!` fragments arrive wrapped
//! in invisible groups; the attribute must read them as written. In particular a
//! `$ret:ty` that is a `Result` must be treated as one: an `Err` must fail the call,
//! not be recorded as the handler's success.

use idempotent::{Classify, Error, MemoryStore, Outcome, idempotent};

struct Order {
    order_id: u64,
}

#[derive(Debug, thiserror::Error, Classify)]
#[error("declined")]
#[idempotent(terminal)]
struct Declined;

static STORE: std::sync::LazyLock<MemoryStore> = std::sync::LazyLock::new(MemoryStore::new);

macro_rules! handler {
    ($name:ident, $key:literal, $ttl:expr, $attempts:literal, $ret:ty, $classify:path) => {
        #[idempotent(key = $key, ttl = $ttl, max_attempts = $attempts, store = STORE, classify = $classify)]
        async fn $name(msg: Order) -> $ret {
            if msg.order_id == 0 { Err(Declined) } else { Ok(msg.order_id) }
        }
    };
}

fn terminal(_: &Declined) -> idempotent::ErrorClass {
    idempotent::ErrorClass::Terminal
}

handler!(charge, "order:{order_id}", 600, 3, Result<u64, Declined>, terminal);
handler!(charge_paren, "paren:{order_id}", "10m", 3, (Result<u64, Declined>), terminal);

#[tokio::main(flavor = "current_thread")]
async fn main() {
    assert_eq!(charge(Order { order_id: 7 }).await.unwrap(), Outcome::Processed(7));
    let failed: Result<Outcome<u64>, Error<Declined>> = charge(Order { order_id: 0 }).await;
    assert!(matches!(failed, Err(Error::Terminal { .. })));
    let failed: Result<Outcome<u64>, Error<Declined>> = charge_paren(Order { order_id: 0 }).await;
    assert!(matches!(failed, Err(Error::Terminal { .. })));
}
