use idempotent::{TerminalEvent, idempotent};

#[derive(Debug, thiserror::Error, idempotent::Classify)]
#[idempotent(terminal)]
#[error("refused")]
struct Refused;

struct Order {
    order_id: u64,
}

// Not `async`: the hook is awaited.
fn page_someone(event: TerminalEvent) {
    let _ = event;
}

#[idempotent(key = "order:{order_id}", on_terminal = page_someone)]
async fn handle(msg: Order) -> Result<(), Refused> {
    let _ = msg.order_id;
    Err(Refused)
}

fn main() {}
