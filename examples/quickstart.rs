use idempotent::{Classify, idempotent};
#[derive(Debug, Classify)]
enum E {
    #[idempotent(retryable)]
    A,
}
#[idempotent(key = "x")]
async fn f(_x: u32) {}
fn main() {
    let _ = E::A;
    let _ = f(1);
}
