//! What an `#[idempotent]` handler does around its body: claim, run with lease
//! renewal, record the result. The attribute's expansion is a call to [`run`].

use std::fmt::Display;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures_util::FutureExt as _;

use crate::alert::TerminalEvent;
use crate::{Claim, Error, ErrorClass, Key, KeyError, Outcome, Store, Token, Transition};

/// The attempt cap when `max_attempts` is not given.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;
/// The lease when `lease` is not given (or the ttl, if that is shorter).
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// The dedupe window when `ttl` is not given: one day.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 60 * 60);

/// A handler's settings, from its attribute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spec {
    /// How long a DONE or FAILED record is kept.
    pub ttl: Duration,
    /// How long a claim holds without renewal.
    pub lease: Duration,
    /// Attempts allowed before a retryable error counts as terminal.
    pub max_attempts: u32,
}

impl Default for Spec {
    fn default() -> Self {
        Spec {
            ttl: DEFAULT_TTL,
            lease: DEFAULT_LEASE,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
        }
    }
}

/// Runs `body` at most once per key.
///
/// 1. `key` is the rendered key; an error returns [`Error::Key`] and runs nothing.
/// 2. Claims the key in `store`: a duplicate, a live claim elsewhere or a key that
///    failed before returns without running `body`.
/// 3. Runs `body` while renewing the lease every third of `spec.lease`. A panic is
///    caught and the key released. If this future is dropped mid-way, the store's
///    [`abandon`](Store::abandon) releases the key (or its lease runs out).
/// 4. Records the result: DONE on `Ok`; released on a retryable error before the
///    last attempt; FAILED, plus `on_terminal`, on a terminal error or the last
///    attempt.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use idempotent_runtime::execute::{run, Spec};
/// use idempotent_runtime::{alert, Classify, Key, MemoryStore, Outcome};
///
/// let store = MemoryStore::new();
/// let handle = || async {
///     let key = Key::new("orders", "42");
///     run(Spec::default(), &store, key, std::io::Error::class, alert::process_sink, async {
///         Ok::<_, std::io::Error>("charged")
///     })
///     .await
/// };
/// assert_eq!(handle().await.unwrap(), Outcome::Processed("charged"));
/// assert_eq!(handle().await.unwrap(), Outcome::Duplicate);
/// # }
/// ```
pub async fn run<S, T, E, C, H, HF, F>(
    spec: Spec,
    store: &S,
    key: Result<Key, KeyError>,
    classify: C,
    on_terminal: H,
    body: F,
) -> Result<Outcome<T>, Error<E>>
where
    S: Store + ?Sized,
    E: Display,
    C: FnOnce(&E) -> ErrorClass,
    H: FnOnce(TerminalEvent) -> HF,
    HF: Future<Output = ()>,
    F: Future<Output = Result<T, E>>,
{
    let key = key.map_err(Error::Key)?;
    let claim = store.claim(&key, spec.lease, spec.ttl).await;
    let (token, attempt) = match claim {
        Ok(Claim::Won { token, attempt }) => (token, attempt),
        Ok(Claim::Done) => return Ok(Outcome::Duplicate),
        Ok(Claim::InProgress) => return Ok(Outcome::InProgress),
        Ok(Claim::Failed { attempts }) => return Err(Error::PreviouslyFailed { attempts }),
        Err(error) => {
            return Err(Error::Store {
                error,
                handler_ran: false,
            });
        }
    };
    let record = Record {
        spec,
        store,
        key: &key,
        token,
        attempt,
    };

    if attempt > spec.max_attempts {
        // Every allowed attempt was started and none finished: a crash or a panic
        // each time. Stop the loop here instead of running the handler again.
        record.fail("earlier attempts never finished").await;
        let attempts = attempt - 1;
        on_terminal(record.event(true, format!("{attempts} attempt(s) never finished"))).await;
        return Err(Error::Abandoned { attempts });
    }

    let abandon = AbandonOnDrop {
        store,
        key: &key,
        token,
        armed: true,
    };
    let finished = with_renewal(&record, AssertUnwindSafe(body).catch_unwind()).await;
    abandon.disarm();

    match finished {
        Ok(Ok(value)) => match store.complete(&key, token, spec.ttl).await {
            Ok(Transition::Applied) => Ok(Outcome::Processed(value)),
            Ok(Transition::LeaseLost) => Err(Error::LeaseLost { attempt }),
            Err(error) => Err(Error::Store {
                error,
                handler_ran: true,
            }),
        },
        Ok(Err(error)) => {
            let retryable = classify(&error) == ErrorClass::Retryable;
            if retryable && attempt < spec.max_attempts {
                record.release().await;
                return Err(Error::Retryable { error, attempt });
            }
            record.fail("the handler failed for good").await;
            on_terminal(record.event(retryable, error.to_string())).await;
            Err(Error::Terminal {
                error,
                attempt,
                exhausted: retryable,
            })
        }
        Err(panic) => {
            record.release().await;
            let message = panic_message(&*panic);
            Err(Error::Panicked { message, attempt })
        }
    }
}

/// The handler result type of a function whose return type is spelled as a one-argument
/// alias such as `io::Result<T>`: the expansion names its parts through this trait.
pub trait HandlerResult {
    /// The success type.
    type Ok;
    /// The error type.
    type Err;
}

impl<T, E> HandlerResult for Result<T, E> {
    type Ok = T;
    type Err = E;
}

/// [`run`] for a handler that cannot fail.
pub async fn run_infallible<S, T, F>(
    spec: Spec,
    store: &S,
    key: Result<Key, KeyError>,
    body: F,
) -> Result<Outcome<T>, Error<std::convert::Infallible>>
where
    S: Store + ?Sized,
    F: Future<Output = T>,
{
    let body = body.map(Ok);
    run(
        spec,
        store,
        key,
        |e| match *e {},
        crate::alert::process_sink,
        body,
    )
    .await
}

/// A claim that was won, and the transitions that end it.
struct Record<'a, S: ?Sized> {
    spec: Spec,
    store: &'a S,
    key: &'a Key,
    token: Token,
    attempt: u32,
}

impl<S: Store + ?Sized> Record<'_, S> {
    /// Releases the claim. On failure the lease runs out instead, which has the same
    /// effect later, so the caller's answer does not change.
    async fn release(&self) {
        match self.store.release(self.key, self.token).await {
            Ok(Transition::Applied) => {}
            Ok(Transition::LeaseLost) => {
                tracing::warn!(key = %self.key, "release skipped: the claim was already lost")
            }
            Err(error) => {
                tracing::warn!(key = %self.key, %error, "release failed; the lease will run out")
            }
        }
    }

    /// Marks the claim FAILED. On failure the message is still dead-lettered by the
    /// caller; the record is then released by lease expiry.
    async fn fail(&self, why: &str) {
        match self.store.fail(self.key, self.token, self.spec.ttl).await {
            Ok(Transition::Applied) => {}
            Ok(Transition::LeaseLost) => {
                tracing::warn!(key = %self.key, why, "could not mark failed: the claim was already lost")
            }
            Err(error) => {
                tracing::warn!(key = %self.key, why, %error, "could not mark failed")
            }
        }
    }

    fn event(&self, exhausted: bool, error: String) -> TerminalEvent {
        TerminalEvent {
            namespace: self.key.namespace().to_owned(),
            key: self.key.id().escape_ascii().to_string(),
            attempt: self.attempt,
            exhausted,
            error,
        }
    }
}

/// Polls `body` to completion while renewing the claim's lease every third of it.
async fn with_renewal<S, F>(record: &Record<'_, S>, body: F) -> F::Output
where
    S: Store + ?Sized,
    F: Future,
{
    let period = (record.spec.lease / 3).max(Duration::from_millis(1));
    let renew = async {
        loop {
            tokio::time::sleep(period).await;
            match record
                .store
                .renew(record.key, record.token, record.spec.lease)
                .await
            {
                Ok(Transition::Applied) => {}
                Ok(Transition::LeaseLost) => {
                    tracing::warn!(key = %record.key, "lease lost while the handler ran");
                    return std::future::pending().await;
                }
                Err(error) => tracing::warn!(key = %record.key, %error, "lease renewal failed"),
            }
        }
    };
    tokio::select! {
        biased;
        out = body => out,
        never = renew => never,
    }
}

/// Gives the claim back if the handler's future is dropped before it finishes.
struct AbandonOnDrop<'a, S: Store + ?Sized> {
    store: &'a S,
    key: &'a Key,
    token: Token,
    armed: bool,
}

impl<S: Store + ?Sized> AbandonOnDrop<'_, S> {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl<S: Store + ?Sized> Drop for AbandonOnDrop<'_, S> {
    fn drop(&mut self) {
        if self.armed {
            self.store.abandon(self.key, self.token);
        }
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}
