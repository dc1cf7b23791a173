use idempotent::Classify;

#[derive(Debug, Classify)]
enum PayError {
    #[idempotent(transparent)]
    Io(std::io::Error, u32),
}

fn main() {}
