//! What a call shows through `tracing`: one span per call, and how keys appear in it.
//!
//! Every call of an `#[idempotent]` handler runs in an info-level span named
//! `idempotent`, a child of the caller's span, with the fields `namespace`, `key`,
//! `attempt` (once the claim is won), `outcome` ([`Outcome::label`] or
//! [`Error::label`](crate::Error::label); `cancelled` for a call dropped before it
//! ended) and `disposition` (`ack`, `retry` or `dead_letter`). The terminal alert, the
//! library's warnings and the handler body's own events are inside it (but not the
//! warning of a claim given back in the background after its call was dropped). At
//! debug level, events mark the steps: the claim won (`attempt`), and each record
//! written (`state` = `done`, `released` or `failed`). (Steps are events rather than
//! child spans: a span around each step costs a wrapper around its future, which
//! measured about 150 ns a call.)
//!
//! Keys may hold personal data (an email, an account number): with
//! [`set_key_logging`]`(`[`KeyLogging::Hashed`]`)` (or
//! [`HashedWithSecret`](KeyLogging::HashedWithSecret)) every span and event of this
//! library, and the store errors it writes itself, show a key as its namespace and a
//! hash of its id instead.

use std::fmt::{self, Display};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{PoisonError, RwLock};

use sha2::{Digest as _, Sha256};
use tracing::{Instrument as _, Span};

use crate::metrics::CallMeter;
use crate::{Disposition, DispositionExt, Error, Key, Outcome};

/// How this library's spans and log events show an idempotency key.
#[derive(Clone, PartialEq, Eq, Default)]
pub enum KeyLogging {
    /// The key as it is stored, non-printable bytes escaped (the default).
    #[default]
    Plain,
    /// The namespace, then `sha256:` and the first 16 hex digits of the SHA-256 of
    /// the id: the same id always shows the same, so a key's calls can still be
    /// followed, but the id itself is not in the logs. Ids with few possible values (an
    /// email, a phone number) can still be found by hashing candidates: use
    /// [`HashedWithSecret`](KeyLogging::HashedWithSecret) where that matters.
    Hashed,
    /// As [`Hashed`](KeyLogging::Hashed), with a secret hashed before the id, so that
    /// only those who hold the secret can check a candidate id against the logs.
    /// Give every process of a service the same secret to follow a key across them.
    /// An empty secret is the same as [`Hashed`](KeyLogging::Hashed).
    HashedWithSecret(Vec<u8>),
}

/// Never shows the secret.
impl fmt::Debug for KeyLogging {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyLogging::Plain => f.write_str("Plain"),
            KeyLogging::Hashed => f.write_str("Hashed"),
            KeyLogging::HashedWithSecret(_) => f.write_str("HashedWithSecret(..)"),
        }
    }
}

/// The policy in force: `None` for plain keys, else the secret (empty for none).
static HASHING: RwLock<Option<Vec<u8>>> = RwLock::new(None);
/// Whether the policy is plain: read on every call, without the lock.
static PLAIN: AtomicBool = AtomicBool::new(true);

/// Sets how keys appear in this library's spans and events, for the whole process.
///
/// ```
/// use idempotent_runtime::trace::{KeyLogging, set_key_logging};
/// use idempotent_runtime::Key;
///
/// let key = Key::new("signup", "ada@example.com").unwrap();
/// set_key_logging(KeyLogging::Hashed);
/// assert_eq!(key.logged().to_string(), "signup:sha256:b5fc85e55755f9e0");
/// set_key_logging(KeyLogging::HashedWithSecret(b"s3cret".to_vec()));
/// assert_ne!(key.logged().to_string(), "signup:sha256:b5fc85e55755f9e0");
/// set_key_logging(KeyLogging::Plain);
/// assert_eq!(key.logged().to_string(), "signup:ada@example.com");
/// ```
pub fn set_key_logging(how: KeyLogging) {
    let secret = match how {
        KeyLogging::Plain => None,
        KeyLogging::Hashed => Some(Vec::new()),
        KeyLogging::HashedWithSecret(secret) => Some(secret),
    };
    let mut hashing = HASHING.write().unwrap_or_else(PoisonError::into_inner);
    PLAIN.store(secret.is_none(), Ordering::Relaxed);
    *hashing = secret;
}

/// A key as [`set_key_logging`] says to show it: [`Key::logged`].
#[derive(Debug, Clone, Copy)]
pub struct LoggedKey<'a>(&'a Key);

impl Key {
    /// This key as this library's spans and events show it ([`set_key_logging`]): for
    /// a handler's own log lines, so they follow the same policy.
    pub fn logged(&self) -> LoggedKey<'_> {
        LoggedKey(self)
    }
}

impl Display for LoggedKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if PLAIN.load(Ordering::Relaxed) {
            return Display::fmt(self.0, f);
        }
        let hashing = HASHING.read().unwrap_or_else(PoisonError::into_inner);
        let Some(secret) = hashing.as_deref() else {
            return Display::fmt(self.0, f);
        };
        let mut hasher = Sha256::new();
        if !secret.is_empty() {
            // The secret's length first, so that secret and id can't trade bytes.
            hasher.update((secret.len() as u64).to_be_bytes());
            hasher.update(secret);
        }
        hasher.update(self.0.id());
        let digest = hasher.finalize();
        write!(f, "{}:sha256:", self.0.namespace().as_bytes().escape_ascii())?;
        digest[..8].iter().try_for_each(|byte| write!(f, "{byte:02x}"))
    }
}

/// The span a call runs in; its key is `None` when it could not be built.
pub(crate) fn call_span(key: Option<&Key>) -> Span {
    let span = tracing::info_span!(
        "idempotent",
        namespace = tracing::field::Empty,
        key = tracing::field::Empty,
        attempt = tracing::field::Empty,
        outcome = tracing::field::Empty,
        disposition = tracing::field::Empty,
    );
    if let Some(key) = key {
        if !span.is_disabled() {
            span.record("namespace", key.namespace());
            span.record("key", tracing::field::display(key.logged()));
        }
    }
    span
}

/// Runs `call` in `span`, and records there how it ended. The call is held through a
/// pinned reference: its future is large, and a wrapper owning it would copy it.
/// How it ended is also counted on `meter`.
pub(crate) async fn traced<T, E, F>(span: &Span, meter: &CallMeter, call: Pin<&mut F>) -> F::Output
where
    F: Future<Output = Result<Outcome<T>, Error<E>>>,
{
    // A call dropped before it ends (a timeout around it, a consumer stopping) says
    // so on its span.
    let mut unfinished = Unfinished(Some((span, meter)));
    let result = call.instrument(span.clone()).await;
    unfinished.0 = None;
    let outcome = match &result {
        Ok(outcome) => outcome.label(),
        Err(error) => error.label(),
    };
    meter.ended(outcome);
    record_end(span, outcome, &result);
    result
}

/// Marks a call dropped before it ended: `outcome = "cancelled"`.
struct Unfinished<'a>(Option<(&'a Span, &'a CallMeter)>);

impl Drop for Unfinished<'_> {
    fn drop(&mut self) {
        if let Some((span, meter)) = self.0 {
            span.record("outcome", "cancelled");
            meter.ended("cancelled");
        }
    }
}

/// Records how the call ended on its span.
fn record_end<T, E>(span: &Span, outcome: &str, result: &Result<Outcome<T>, Error<E>>) {
    if span.is_disabled() {
        return;
    }
    let disposition = match result.disposition() {
        Disposition::Ack => "ack",
        Disposition::Retry => "retry",
        Disposition::DeadLetter => "dead_letter",
    };
    span.record("outcome", outcome);
    span.record("disposition", disposition);
}
