use idempotent::Classify;

#[derive(Debug, Classify)]
enum PayError {
    #[idempotent(retryable)]
    DbTimeout,
    InsufficientFunds,
}

fn main() {}
