use idempotent::Classify;

#[derive(Debug, Classify)]
enum PayError {
    #[idempotent(retry)]
    DbTimeout,
}

fn main() {}
