//! Why a call did not end in an [`Outcome`](crate::Outcome).

use std::fmt;
use std::time::Duration;

use crate::{Disposition, ErrorClass};

/// Why a call to an `#[idempotent]` handler did not produce an
/// [`Outcome`](crate::Outcome). `E` is the handler's own error type.
///
/// Each case says what happened to the record and, through
/// [`disposition`](Error::disposition), what the consumer should do with the message.
///
/// ```
/// use std::time::Duration;
/// use idempotent_runtime::{Disposition, Error};
///
/// fn report(error: &Error<std::io::Error>) -> String {
///     match error {
///         Error::Retryable { error, attempt, .. } => format!("attempt {attempt} failed: {error}"),
///         Error::Terminal { exhausted: true, .. } => "gave up after max_attempts".into(),
///         Error::Store { handler_ran: true, .. } => "ran, but the record was not written".into(),
///         other => other.to_string(),
///     }
/// }
///
/// let error = Error::Retryable {
///     error: std::io::ErrorKind::TimedOut.into(),
///     attempt: 2,
///     retry_after: Duration::from_secs(2),
/// };
/// assert_eq!(error.disposition(), Disposition::Retry);
/// assert_eq!(error.retry_delay(), Some(Duration::from_secs(2)));
/// assert!(error.is_retryable());
/// assert_eq!(report(&error), "attempt 2 failed: timed out");
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum Error<E> {
    /// The handler failed with a retryable error; the key was released (its attempt
    /// count kept) so a redelivery runs the handler again.
    Retryable {
        /// The handler's error.
        error: E,
        /// Which attempt this was, from 1.
        attempt: u32,
        /// How long to wait before the redelivery, by the handler's `backoff`.
        retry_after: Duration,
    },
    /// The handler failed for good: its error is terminal, or it was retryable but this
    /// was attempt `max_attempts`. The key is kept as FAILED for the dedupe window and
    /// an alert was sent.
    Terminal {
        /// The handler's error.
        error: E,
        /// Which attempt this was, from 1.
        attempt: u32,
        /// `true` when the error was retryable but the attempts ran out.
        exhausted: bool,
    },
    /// Earlier attempts never finished (the process died, panicked or was cancelled
    /// mid-handler) and `max_attempts` is used up. The handler did not run this time;
    /// the key is now FAILED and an alert was sent.
    Abandoned {
        /// How many attempts were started before this one.
        attempts: u32,
    },
    /// An earlier delivery of this key already failed for good (the record is FAILED
    /// and still within its dedupe window). The handler did not run.
    PreviouslyFailed {
        /// How many attempts the key had.
        attempts: u32,
    },
    /// The handler panicked. Before the last allowed attempt the key was released, so
    /// a redelivery runs it again; on attempt `max_attempts` it is kept as FAILED, an
    /// alert was sent, and the message is dead-lettered (`exhausted: true`).
    Panicked {
        /// The panic payload, when it was a string.
        message: String,
        /// Which attempt this was, from 1.
        attempt: u32,
        /// `true` when this was the last allowed attempt: the key is FAILED.
        exhausted: bool,
        /// How long to wait before the redelivery, by the handler's `backoff` (unused
        /// when `exhausted`).
        retry_after: Duration,
    },
    /// The idempotency key could not be built from the message. The handler did not run.
    Key(KeyError),
    /// The call was not made on a Tokio runtime with its timer enabled, which lease
    /// renewal needs. Nothing was claimed and the handler did not run, so a redelivery
    /// to a consumer on a suitable runtime processes the message.
    Runtime {
        /// What is missing.
        reason: &'static str,
        /// How long to wait before the redelivery, by the handler's `backoff`.
        retry_after: Duration,
    },
    /// The store could not be reached or gave an unusable answer.
    Store {
        /// What the store reported.
        error: StoreError,
        /// Whether the handler's effects may stand without a DONE record. `false`:
        /// redeliver; nothing took effect (the handler did not run, or its transaction
        /// was rolled back), or, with `transactional`, a commit whose answer was lost
        /// committed the effects and DONE together, and the redelivery is a duplicate.
        /// `true`: the handler's effects happened but could not be recorded as done;
        /// the key stays claimed until its lease runs out, then a redelivery runs again.
        handler_ran: bool,
        /// How long to wait before the redelivery (unused for a permanent store
        /// error): by the handler's `backoff`, counting attempts by the key's record,
        /// or, before the claim was answered, by the broker's delivery count.
        retry_after: Duration,
    },
    /// The claim expired and another consumer took the key before this attempt's
    /// result could be recorded. Nothing was overwritten, released or marked failed,
    /// and no alert was sent: the key is the other consumer's. When a lease renewal
    /// found the claim taken while the handler ran, the handler was stopped at its next
    /// await (as a crash would stop it) rather than left to run beside the new owner.
    LeaseLost {
        /// Which attempt this was, from 1.
        attempt: u32,
        /// How long to wait before the redelivery, by the handler's `backoff`.
        retry_after: Duration,
    },
    /// The key was seen before with a different payload (only with `validate = true`).
    /// The handler did not run.
    PayloadMismatch,
    /// A duplicate's stored value could not be read back as `T` (only with `cache =
    /// true`; for example `T` changed shape since it was stored). The handler did not
    /// run and the message's effect is recorded DONE: ack it. (A value that cannot be
    /// stored is [`Outcome::ProcessedNotCached`](crate::Outcome::ProcessedNotCached),
    /// which carries it.)
    Cache {
        /// What went wrong.
        reason: String,
    },
}

impl<E> Error<E> {
    /// Whether a redelivery may succeed: retryable handler errors, panics, store
    /// errors and lost leases. ([`Error::Cache`] is neither retryable nor terminal:
    /// the message took effect.)
    pub fn is_retryable(&self) -> bool {
        self.disposition() == Disposition::Retry
    }

    /// Whether the message can never succeed: terminal handler errors, exhausted
    /// attempts, key errors, payload mismatches and keys that failed before.
    pub fn is_terminal(&self) -> bool {
        self.disposition() == Disposition::DeadLetter
    }

    /// Its name in the call's span (`outcome`) and metrics: `retryable_error`,
    /// `terminal_error`, `abandoned`, `previously_failed`, `panicked`, `key_error`,
    /// `runtime_error`, `store_error`, `lease_lost`, `payload_mismatch` or
    /// `cache_error`.
    pub fn label(&self) -> &'static str {
        match self {
            Error::Retryable { .. } => "retryable_error",
            Error::Terminal { .. } => "terminal_error",
            Error::Abandoned { .. } => "abandoned",
            Error::PreviouslyFailed { .. } => "previously_failed",
            Error::Panicked { .. } => "panicked",
            Error::Key(_) => "key_error",
            Error::Runtime { .. } => "runtime_error",
            Error::Store { .. } => "store_error",
            Error::LeaseLost { .. } => "lease_lost",
            Error::PayloadMismatch => "payload_mismatch",
            Error::Cache { .. } => "cache_error",
        }
    }

    /// What the consumer should tell its broker.
    pub fn disposition(&self) -> Disposition {
        match self {
            Error::Store { error, .. } if error.is_permanent() => Disposition::DeadLetter,
            Error::Panicked { exhausted: true, .. } => Disposition::DeadLetter,
            Error::Retryable { .. }
            | Error::Panicked { .. }
            | Error::Store { .. }
            | Error::Runtime { .. }
            | Error::LeaseLost { .. } => Disposition::Retry,
            Error::Cache { .. } => Disposition::Ack,
            Error::Terminal { .. }
            | Error::Abandoned { .. }
            | Error::PreviouslyFailed { .. }
            | Error::Key(_)
            | Error::PayloadMismatch => Disposition::DeadLetter,
        }
    }

    /// How long the consumer should wait before the message is delivered again: `Some`
    /// exactly when the [`disposition`](Error::disposition) is
    /// [`Retry`](Disposition::Retry), by the handler's `backoff` and the attempt.
    pub fn retry_delay(&self) -> Option<Duration> {
        if self.disposition() != Disposition::Retry {
            return None;
        }
        match self {
            Error::Retryable { retry_after, .. }
            | Error::Panicked { retry_after, .. }
            | Error::Runtime { retry_after, .. }
            | Error::Store { retry_after, .. }
            | Error::LeaseLost { retry_after, .. } => Some(*retry_after),
            _ => None,
        }
    }

    /// The class of a handler error as it was treated, if the handler failed.
    pub fn class(&self) -> Option<ErrorClass> {
        match self {
            Error::Retryable { .. } => Some(ErrorClass::Retryable),
            Error::Terminal { .. } => Some(ErrorClass::Terminal),
            _ => None,
        }
    }

    /// The handler's own error, when the handler returned one.
    pub fn handler_error(&self) -> Option<&E> {
        match self {
            Error::Retryable { error, .. } | Error::Terminal { error, .. } => Some(error),
            _ => None,
        }
    }

    /// Takes the handler's own error, when the handler returned one.
    pub fn into_handler_error(self) -> Option<E> {
        match self {
            Error::Retryable { error, .. } | Error::Terminal { error, .. } => Some(error),
            _ => None,
        }
    }
}

impl<E: fmt::Display> fmt::Display for Error<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Retryable { error, attempt, .. } => {
                write!(f, "handler failed on attempt {attempt} (retryable, key released): {error}")
            }
            Error::Terminal { error, attempt, exhausted: false } => {
                write!(
                    f,
                    "handler failed on attempt {attempt} (terminal, key kept as failed): {error}"
                )
            }
            Error::Terminal { error, attempt, exhausted: true } => {
                write!(
                    f,
                    "handler failed on attempt {attempt}, the last allowed (key kept as failed): {error}"
                )
            }
            Error::Abandoned { attempts } => write!(
                f,
                "{attempts} earlier attempt(s) never finished and no attempts are left (key kept as failed)"
            ),
            Error::PreviouslyFailed { attempts } => {
                write!(f, "key already failed for good after {attempts} attempt(s)")
            }
            Error::Panicked { message, attempt, exhausted: false, .. } => {
                write!(f, "handler panicked on attempt {attempt} (key released): {message}")
            }
            Error::Panicked { message, attempt, exhausted: true, .. } => write!(
                f,
                "handler panicked on attempt {attempt}, the last allowed (key kept as failed): \
                 {message}"
            ),
            Error::Key(e) => write!(f, "idempotency key could not be built: {e}"),
            Error::Runtime { reason, .. } => {
                write!(f, "handler not run, nothing claimed: {reason}")
            }
            Error::Store { error, handler_ran: false, .. } => write!(
                f,
                "store failed; no effect of the handler stands without its DONE record (it \
                 did not run, or its transaction was rolled back or committed together with \
                 DONE): {error}"
            ),
            Error::Store { error, handler_ran: true, .. } => write!(
                f,
                "store failed after the handler ran; its result was not recorded: {error}"
            ),
            Error::LeaseLost { attempt, .. } => write!(
                f,
                "attempt {attempt} lost its claim (it expired and another consumer took the key); nothing was recorded"
            ),
            Error::PayloadMismatch => {
                write!(f, "key was seen before with a different payload")
            }
            Error::Cache { reason } => write!(f, "message processed and recorded; {reason}"),
        }
    }
}

impl<E> std::error::Error for Error<E>
where
    E: std::error::Error + 'static,
{
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Retryable { error, .. } | Error::Terminal { error, .. } => Some(error),
            Error::Key(e) => Some(e),
            Error::Store { error, .. } => Some(error),
            _ => None,
        }
    }
}

/// Why an idempotency key could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// A placeholder rendered as the empty string.
    #[error("placeholder `{{{placeholder}}}` is empty")]
    EmptyPlaceholder {
        /// The placeholder as written in the template.
        placeholder: &'static str,
    },
    /// A placeholder's `Display` implementation returned an error (perhaps after
    /// writing part of the value).
    #[error("placeholder `{{{placeholder}}}` could not be rendered: its `Display` failed")]
    Unprintable {
        /// The placeholder as written in the template.
        placeholder: &'static str,
    },
    /// The key (namespace included) is longer than [`MAX_KEY_LEN`](crate::MAX_KEY_LEN).
    #[error("key is {len} bytes long; the limit is {max}")]
    TooLong {
        /// The key's length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The key's id part is empty.
    #[error("key is empty")]
    Empty,
    /// A `{/json/pointer}` placeholder's message is not JSON.
    #[error("`{{{pointer}}}` can't be read: the payload is not JSON ({reason})")]
    NotJson {
        /// The pointer as written.
        pointer: &'static str,
        /// The parser's complaint.
        reason: String,
    },
    /// A `{/json/pointer}` placeholder found nothing usable as a key part.
    #[error("`{{{pointer}}}` can't be a key part: {why}")]
    Pointer {
        /// The pointer as written.
        pointer: &'static str,
        /// What was (or was not) there.
        why: crate::payload::Unusable,
    },
    /// A placeholder of a hand-driven [`KeyBuilder`](crate::KeyBuilder) is followed by
    /// another one without text between them, or with text that starts with `%`, a
    /// digit or `A`–`F`: different values could then render the same key. The
    /// `#[idempotent]` macro rejects such templates at compile time.
    #[error(
        "placeholder `{{{placeholder}}}` must be separated from the next one by text that \
         does not start with `%`, a digit or `A`-`F`"
    )]
    Unseparated {
        /// The placeholder before the missing or unusable separator.
        placeholder: &'static str,
    },
    /// The namespace is empty or contains `:`.
    #[error("namespace `{namespace}` must be non-empty and must not contain `:`")]
    InvalidNamespace {
        /// The namespace given.
        namespace: String,
    },
}

/// A store could not carry out an operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// No `store = ...` on the handler and no process-wide default store.
    #[error(
        "no store configured: pass `store = ...` to #[idempotent] or call idempotent::set_default_store(..) at start-up"
    )]
    NotConfigured,
    /// The backend failed or could not be reached.
    #[error("store unavailable: {0}")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The backend answered with something this store cannot interpret.
    #[error("store returned an unexpected reply: {0}")]
    Protocol(String),
    /// The backend refused this record and will refuse it again: retrying can't help
    /// (a value it cannot hold, a key of another type or format under the store's
    /// name). The call's disposition is dead-letter, so the message is kept aside
    /// instead of being retried for ever.
    #[error("store refused the record: {0}")]
    Rejected(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The record under the key was written by a newer version of this library, in a
    /// format this version does not read (a rolling upgrade, or a rollback after one).
    /// It is left as it is, and the message is retried with the handler's backoff
    /// until a consumer of the newer version takes it or the record expires. See
    /// [`store::format`](mod@crate::store::format).
    #[error(
        "the record was written by a newer version of idempotent ({0}); it is left as it is and the message is retried: finish the upgrade, or wait for the record to expire"
    )]
    NewerFormat(String),
    /// The store's server is set up so that it can't keep the store's promise: it
    /// would lose records (a message would run again) or refuse them (a message would
    /// be retried for ever). Found when the store connects, or at run time when the
    /// server turns so (a user's permission revoked, a command renamed): the call's
    /// disposition is retry, never dead-letter (a broker's own redelivery limit still
    /// applies), and a `RedisStore` refuses every claim until its server passes its
    /// check again. The text names the setting and what to do.
    #[error("the store's server is misconfigured: {0}")]
    Misconfigured(String),
    /// A bounded store holds as much as it may, none of it expired: the claim of a
    /// new key is refused rather than evict a record still in use. Retry later, when
    /// records have expired.
    #[error(
        "store is full: it holds its capacity of {capacity}, none expired; new keys are refused until records expire"
    )]
    Full {
        /// How much the store holds at most.
        capacity: Capacity,
    },
}

/// How much a bounded store holds at most: a number of records, or the bytes its
/// records take (each counted as its fixed size plus its long key, fingerprint and
/// cached result).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capacity {
    /// At most this many records.
    Records(usize),
    /// At most this many bytes of records.
    Bytes(usize),
}

impl std::fmt::Display for Capacity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Capacity::Records(n) => write!(f, "{n} records"),
            Capacity::Bytes(n) => write!(f, "{n} bytes of records"),
        }
    }
}

impl StoreError {
    /// Wraps a backend error.
    pub fn unavailable(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        StoreError::Unavailable(error.into())
    }

    /// Whether retrying can never succeed ([`StoreError::Rejected`]).
    pub fn is_permanent(&self) -> bool {
        matches!(self, StoreError::Rejected(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_error_that_retrying_cannot_fix_is_dead_lettered() {
        let retry_after = Duration::from_secs(2);
        let refused = Error::<std::io::Error>::Store {
            error: StoreError::Rejected("index row too large".into()),
            handler_ran: false,
            retry_after,
        };
        assert_eq!(refused.disposition(), Disposition::DeadLetter);
        assert_eq!(refused.retry_delay(), None, "no retry, no delay");
        let down = Error::<std::io::Error>::Store {
            error: StoreError::unavailable("connection refused"),
            handler_ran: false,
            retry_after,
        };
        assert_eq!(down.disposition(), Disposition::Retry);
        assert_eq!(down.retry_delay(), Some(retry_after));
    }

    #[test]
    fn a_delay_exactly_for_the_retry_dispositions() {
        let d = Duration::from_millis(1500);
        let retried: [Error<&str>; 5] = [
            Error::Retryable { error: "down", attempt: 1, retry_after: d },
            Error::Panicked {
                message: "boom".into(),
                attempt: 1,
                exhausted: false,
                retry_after: d,
            },
            Error::Runtime { reason: "no timer", retry_after: d },
            Error::Store {
                error: StoreError::unavailable("down"),
                handler_ran: true,
                retry_after: d,
            },
            Error::LeaseLost { attempt: 2, retry_after: d },
        ];
        for error in retried {
            assert_eq!((error.disposition(), error.retry_delay()), (Disposition::Retry, Some(d)));
        }
        let settled: [Error<&str>; 6] = [
            Error::Terminal { error: "bad", attempt: 1, exhausted: false },
            Error::Panicked { message: "boom".into(), attempt: 5, exhausted: true, retry_after: d },
            Error::Abandoned { attempts: 5 },
            Error::PreviouslyFailed { attempts: 5 },
            Error::PayloadMismatch,
            Error::Cache { reason: "changed shape".into() },
        ];
        for error in settled {
            assert_ne!(error.disposition(), Disposition::Retry, "{error:?}");
            assert_eq!(error.retry_delay(), None, "{error:?}");
        }
    }
}
