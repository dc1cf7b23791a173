//! Deciding whether a handler error is worth another delivery.

use std::convert::Infallible;
use std::io;

/// What a handler's error means for its message: worth another delivery, never
/// worth one, or not a failure at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorClass {
    /// A passing condition (timeout, lost connection, lock contention): the key is
    /// released and the broker should redeliver, up to `max_attempts`.
    Retryable,
    /// Trying again cannot help (invalid data, insufficient funds): the key is kept
    /// as FAILED for the dedupe window, an alert is sent, the message is dead-lettered.
    Terminal,
    /// The handler found its effect already applied (a state-machine guard saw the
    /// target state, a unique constraint refused the second insert): the key is
    /// recorded DONE, the call answers `Ok(Outcome::Duplicate)`, the message is acked,
    /// and no alert is sent. In a `transactional` handler, the transaction's writes are
    /// rolled back, as for any error, and DONE is recorded on its own.
    Duplicate,
}

/// Classifies a handler's error type.
///
/// Derive it on an error enum with `#[derive(Classify)]` and mark variants
/// `#[idempotent(retryable)]`, `#[idempotent(terminal)]` or `#[idempotent(duplicate)]`
/// (a mark on the enum itself is the default for unmarked variants), or implement it
/// by hand:
///
/// ```
/// use idempotent_runtime::{Classify, ErrorClass};
///
/// enum ChargeError { Timeout, Declined, AlreadyCharged }
///
/// impl Classify for ChargeError {
///     fn class(&self) -> ErrorClass {
///         match self {
///             ChargeError::Timeout => ErrorClass::Retryable,
///             ChargeError::Declined => ErrorClass::Terminal,
///             ChargeError::AlreadyCharged => ErrorClass::Duplicate,
///         }
///     }
/// }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` does not implement `Classify`, so #[idempotent] can't tell its retryable errors from its terminal ones",
    label = "the handler's error type",
    note = "add `#[derive(idempotent::Classify)]` with `#[idempotent(retryable)]` / `#[idempotent(terminal)]` marks, implement `Classify`, or pass `classify = path` to #[idempotent]"
)]
pub trait Classify {
    /// The class of this error.
    fn class(&self) -> ErrorClass;
}

impl<T: Classify + ?Sized> Classify for &T {
    fn class(&self) -> ErrorClass {
        (**self).class()
    }
}

impl<T: Classify + ?Sized> Classify for Box<T> {
    fn class(&self) -> ErrorClass {
        (**self).class()
    }
}

impl Classify for Infallible {
    fn class(&self) -> ErrorClass {
        match *self {}
    }
}

/// Transport and resource conditions retry; malformed input and refused permission
/// do not. Kinds not listed retry: `max_attempts` still bounds them.
impl Classify for io::Error {
    fn class(&self) -> ErrorClass {
        use io::ErrorKind::*;
        match self.kind() {
            InvalidInput | InvalidData | PermissionDenied | Unsupported | AlreadyExists => {
                ErrorClass::Terminal
            }
            _ => ErrorClass::Retryable,
        }
    }
}

/// A deadline passed; the next attempt may be faster.
impl Classify for tokio::time::error::Elapsed {
    fn class(&self) -> ErrorClass {
        ErrorClass::Retryable
    }
}

macro_rules! terminal {
    ($($ty:ty),* $(,)?) => {$(
        /// Bad input parses the same way every time.
        impl Classify for $ty {
            fn class(&self) -> ErrorClass {
                ErrorClass::Terminal
            }
        }
    )*};
}

terminal!(
    std::num::ParseIntError,
    std::num::ParseFloatError,
    std::num::TryFromIntError,
    std::str::ParseBoolError,
    std::str::Utf8Error,
    std::string::FromUtf8Error,
    std::char::ParseCharError,
);

/// `E`'s [`Classify::class`] as a function pointer: what the expansion passes to `run`
/// for a handler without `classify = ..`. Asking `E: Classify` here, at the error type's
/// span, makes a missing implementation one error there.
#[doc(hidden)]
pub fn classifier<E: Classify>() -> fn(&E) -> ErrorClass {
    E::class
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_errors_split_by_kind() {
        let timeout = io::Error::new(io::ErrorKind::TimedOut, "slow");
        let bad = io::Error::new(io::ErrorKind::InvalidData, "garbage");
        assert_eq!(timeout.class(), ErrorClass::Retryable);
        assert_eq!(bad.class(), ErrorClass::Terminal);
        assert_eq!(Classify::class(&&bad), ErrorClass::Terminal);
        assert_eq!(Box::new(timeout).class(), ErrorClass::Retryable);
    }

    #[test]
    fn parse_errors_are_terminal() {
        let e = "x".parse::<u32>().unwrap_err();
        assert_eq!(e.class(), ErrorClass::Terminal);
    }
}
