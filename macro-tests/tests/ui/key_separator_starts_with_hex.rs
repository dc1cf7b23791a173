use idempotent::idempotent;

struct Transfer {
    from: String,
    to: String,
}

#[idempotent(key = "transfer:{from}2{to}")]
async fn handle(msg: Transfer) {
    let _ = (msg.from, msg.to);
}

fn main() {}
