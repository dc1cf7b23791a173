//! A crate that re-exports `idempotent` under another path points the macro at it.

mod reexport {
    pub use idempotent as idem;
}

use reexport::idem::{Classify, MemoryStore};

#[derive(Debug, Classify)]
#[idempotent(crate = "crate::reexport::idem", retryable)]
struct Flaky;

impl std::fmt::Display for Flaky {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("flaky")
    }
}

struct Order {
    order_id: u64,
}

static STORE: std::sync::LazyLock<MemoryStore> = std::sync::LazyLock::new(MemoryStore::new);

#[reexport::idem::idempotent(key = "order:{order_id}", crate = crate::reexport::idem, store = STORE)]
async fn handle(msg: Order) -> Result<u64, Flaky> {
    Ok(msg.order_id)
}

fn main() {
    let _ = handle(Order { order_id: 1 });
}
