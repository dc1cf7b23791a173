//! What a successful call returns, and what the consumer should tell its broker.

use std::time::Duration;

use crate::Error;

/// What happened to a message whose call did not fail.
///
/// ```
/// use std::time::Duration;
/// use idempotent_runtime::{Disposition, Outcome};
///
/// fn log(outcome: &Outcome<u64>) -> String {
///     match outcome {
///         Outcome::Processed(receipt) => format!("charged, receipt {receipt}"),
///         Outcome::Replayed(receipt) => format!("already charged, receipt {receipt}"),
///         Outcome::Duplicate => "already charged".to_owned(),
///         Outcome::InProgress { .. } => "being charged by another consumer".to_owned(),
///         Outcome::ProcessedNotCached { value, reason } => format!("charged, receipt {value} ({reason})"),
///     }
/// }
///
/// assert_eq!(log(&Outcome::Processed(7)), "charged, receipt 7");
/// let busy = Outcome::<u64>::InProgress { retry_after: Duration::from_secs(20) };
/// assert_eq!(busy.disposition(), Disposition::Retry);
/// assert_eq!(busy.retry_delay(), Some(Duration::from_secs(20)));
/// assert_eq!(Outcome::Processed(7).map(|r| r + 1).into_value(), Some(8));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "an Outcome says whether the handler ran; a consumer acks on `disposition()`"]
pub enum Outcome<T> {
    /// The handler ran now and its success was recorded.
    Processed(T),
    /// The key was already processed within the dedupe window; the handler did not run.
    Duplicate,
    /// Another consumer holds a live claim on the key; the handler did not run.
    /// Redeliver later: by then the key is done (a duplicate) or released.
    InProgress {
        /// About how long the other claim's lease has left (when the store could
        /// tell; else the handler's first `backoff` delay): by then that consumer has
        /// finished, renewed its lease, or lost the key to the next claim.
        retry_after: Duration,
    },
    /// A duplicate whose recorded result was returned (only with `cache = true`).
    Replayed(T),
    /// The handler ran now and its success was recorded, but its value could not be
    /// kept for duplicates (only with `cache = true`: too large, not serializable, or
    /// its JSON would not read back, like a NaN). Duplicates get [`Outcome::Duplicate`].
    ProcessedNotCached {
        /// The handler's value.
        value: T,
        /// Why it was not cached.
        reason: String,
    },
}

impl<T> Outcome<T> {
    /// Ack for everything but `InProgress`, which is retry.
    pub fn disposition(&self) -> Disposition {
        match self {
            Outcome::InProgress { .. } => Disposition::Retry,
            Outcome::Processed(_)
            | Outcome::ProcessedNotCached { .. }
            | Outcome::Duplicate
            | Outcome::Replayed(_) => Disposition::Ack,
        }
    }

    /// How long to wait before redelivering: `Some` for `InProgress` (the other
    /// claim's lease), `None` for the rest, which are acked.
    pub fn retry_delay(&self) -> Option<Duration> {
        match self {
            Outcome::InProgress { retry_after } => Some(*retry_after),
            _ => None,
        }
    }

    /// Its name in the call's span (`outcome`) and metrics: `processed`,
    /// `processed_not_cached`, `duplicate`, `replayed` or `in_progress`.
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Processed(_) => "processed",
            Outcome::ProcessedNotCached { .. } => "processed_not_cached",
            Outcome::Duplicate => "duplicate",
            Outcome::Replayed(_) => "replayed",
            Outcome::InProgress { .. } => "in_progress",
        }
    }

    /// Whether the handler ran during this call.
    pub fn is_processed(&self) -> bool {
        matches!(self, Outcome::Processed(_) | Outcome::ProcessedNotCached { .. })
    }

    /// The handler's value, fresh or replayed.
    pub fn into_value(self) -> Option<T> {
        match self {
            Outcome::Processed(v) | Outcome::Replayed(v) => Some(v),
            Outcome::ProcessedNotCached { value, .. } => Some(value),
            Outcome::Duplicate | Outcome::InProgress { .. } => None,
        }
    }

    /// Maps the handler's value.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Outcome<U> {
        match self {
            Outcome::Processed(v) => Outcome::Processed(f(v)),
            Outcome::Replayed(v) => Outcome::Replayed(f(v)),
            Outcome::ProcessedNotCached { value, reason } => {
                Outcome::ProcessedNotCached { value: f(value), reason }
            }
            Outcome::Duplicate => Outcome::Duplicate,
            Outcome::InProgress { retry_after } => Outcome::InProgress { retry_after },
        }
    }
}

/// What a consumer should do with the delivery it just handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Disposition {
    /// Acknowledge (commit the offset): the message's effect is recorded, or it is a
    /// duplicate of one that is.
    Ack,
    /// Leave it for redelivery (nack with requeue, do not commit): nothing was
    /// recorded as done, so the next delivery will run the handler.
    Retry,
    /// Move it to the dead-letter destination: retrying cannot succeed.
    DeadLetter,
}

/// [`Outcome::disposition`] and [`Error::disposition`] (and their `retry_delay`) on the
/// whole result a handler returns, so a consumer loop can write
/// `handler(msg).await.disposition()`.
///
/// ```
/// use idempotent_runtime::{Disposition, DispositionExt, Error, Outcome};
///
/// let done: Result<Outcome<u32>, Error<std::io::Error>> = Ok(Outcome::Duplicate);
/// assert_eq!(done.disposition(), Disposition::Ack);
/// ```
pub trait DispositionExt {
    /// What to tell the broker.
    fn disposition(&self) -> Disposition;

    /// How long to wait before the message is delivered again, for a
    /// [`Retry`](Disposition::Retry); `None` for the rest, or when the result does not
    /// say (then the consumer's own retry delay applies). `None` unless implemented.
    fn retry_delay(&self) -> Option<std::time::Duration> {
        None
    }

    /// Whether the handler did not run because the key was claimed elsewhere
    /// ([`Outcome::InProgress`]). A consumer that runs deliveries concurrently runs
    /// such a delivery again once the others have settled: the claim may have been a
    /// delivery of the same key in the same batch. `false` unless implemented.
    fn is_in_progress(&self) -> bool {
        false
    }
}

impl<T, E> DispositionExt for Result<Outcome<T>, Error<E>> {
    fn disposition(&self) -> Disposition {
        match self {
            Ok(outcome) => outcome.disposition(),
            Err(error) => error.disposition(),
        }
    }

    fn retry_delay(&self) -> Option<Duration> {
        match self {
            Ok(outcome) => outcome.retry_delay(),
            Err(error) => error.retry_delay(),
        }
    }

    fn is_in_progress(&self) -> bool {
        matches!(self, Ok(Outcome::InProgress { .. }))
    }
}
