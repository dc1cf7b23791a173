//! `#[derive(Classify)]` on an empty enum (an error type no value inhabits), and on a
//! generic enum whose `transparent` variant wraps the type parameter.

use idempotent::{Classify, ErrorClass};

#[derive(Debug, Classify)]
#[allow(dead_code)]
enum Never {}

#[derive(Debug, Classify)]
enum Wrapped<E> {
    #[idempotent(transparent)]
    Inner(E),
    #[idempotent(terminal)]
    Refused,
}

fn main() {
    let timeout = Wrapped::Inner(std::io::Error::from(std::io::ErrorKind::TimedOut));
    assert_eq!(timeout.class(), ErrorClass::Retryable);
    assert_eq!(Wrapped::<std::io::Error>::Refused.class(), ErrorClass::Terminal);
    fn classify(never: &Never) -> ErrorClass {
        never.class()
    }
    let _ = classify;
}
