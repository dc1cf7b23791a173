//! What an `#[idempotent]` handler does around its body: claim, run with lease
//! renewal, record the result. The attribute's expansion is a call to [`run`].

use std::fmt::Display;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::Ordering::Relaxed;
use std::task::Poll;
use std::time::Duration;

use futures_util::FutureExt as _;

use crate::alert::{TerminalEvent, TerminalHook};
use crate::current::Current;
use crate::metrics::{CallMeter, Operation};
use crate::{
    Backoff, Claim, Error, ErrorClass, Fingerprint, Key, KeyError, Outcome, Store, StoreError,
    Token, Transition,
};

/// The attempt cap when `max_attempts` is not given.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;
/// The lease when `lease` is not given (or the ttl, if that is shorter).
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// The dedupe window when `ttl` is not given: one day.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 60 * 60);

/// A handler's settings, from its attribute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spec {
    ttl: Duration,
    lease: Duration,
    max_attempts: u32,
    backoff: Backoff,
}

impl Spec {
    /// The shortest lease: renewal runs every third of the lease, so a shorter one
    /// could lapse between renewals.
    pub const MIN_LEASE: Duration = Duration::from_millis(30);

    /// The longest `ttl` or `lease` a store is asked to keep: 100 years. Every store
    /// can hold an expiry that far ahead; `Duration::MAX` could not be.
    pub const MAX_DURATION: Duration = Duration::from_secs(36_500 * 24 * 60 * 60);

    /// Settings with a dedupe window of `ttl`, claims held for `lease` between
    /// renewals, and `max_attempts` attempts. A lease under [`Spec::MIN_LEASE`] is
    /// raised to it; `ttl` and `lease` over [`Spec::MAX_DURATION`] are lowered to it
    /// (the `#[idempotent]` attribute refuses such values at compile time);
    /// `max_attempts` is at least 1. Retries wait by [`Backoff::DEFAULT`] unless
    /// [`with_backoff`](Spec::with_backoff) says otherwise.
    pub const fn new(ttl: Duration, lease: Duration, max_attempts: u32) -> Spec {
        let cap = Spec::MAX_DURATION;
        let ttl = if ttl.as_nanos() > cap.as_nanos() { cap } else { ttl };
        let lease = if lease.as_nanos() > cap.as_nanos() { cap } else { lease };
        let lease =
            if lease.as_nanos() < Spec::MIN_LEASE.as_nanos() { Spec::MIN_LEASE } else { lease };
        let max_attempts = if max_attempts == 0 { 1 } else { max_attempts };
        Spec { ttl, lease, max_attempts, backoff: Backoff::DEFAULT }
    }

    /// These settings, with retries waiting by `backoff` (`#[idempotent(backoff = ...)]`).
    pub const fn with_backoff(mut self, backoff: Backoff) -> Spec {
        self.backoff = backoff;
        self
    }

    /// How long a DONE or FAILED record is kept.
    pub const fn ttl(&self) -> Duration {
        self.ttl
    }

    /// How long a claim holds without renewal.
    pub const fn lease(&self) -> Duration {
        self.lease
    }

    /// Attempts allowed before a retryable error counts as terminal.
    pub const fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// How long a retry waits, by attempt.
    pub const fn backoff(&self) -> Backoff {
        self.backoff
    }
}

impl Default for Spec {
    fn default() -> Self {
        Spec::new(DEFAULT_TTL, DEFAULT_LEASE, DEFAULT_MAX_ATTEMPTS)
    }
}

/// The largest result `cache = true` stores, in bytes of JSON: 64 KiB. A larger
/// result is not cached (nor truncated): the call returns
/// [`Outcome::ProcessedNotCached`].
pub const MAX_CACHED_RESULT: usize = 64 * 1024;

/// One delivery: the handler's settings, the rendered key, and what `validate` and
/// `cache` add. The `#[idempotent]` expansion builds it.
pub struct Call<C = NoCache> {
    spec: Spec,
    key: Result<Key, KeyError>,
    fingerprint: Option<Fingerprint>,
    cache: C,
}

impl Call {
    /// A delivery whose key is `key`, run with `spec`.
    pub fn new(spec: Spec, key: Result<Key, KeyError>) -> Call {
        Call { spec, key, fingerprint: None, cache: NoCache }
    }
}

impl<C> Call<C> {
    /// The span this call runs in.
    pub(crate) fn span(&self) -> tracing::Span {
        crate::trace::call_span(self.key.as_ref().ok())
    }

    /// Stores `fingerprint` with the claim; a record holding another one makes the call
    /// [`Error::PayloadMismatch`] (`validate = true`).
    pub fn validated(mut self, fingerprint: Fingerprint) -> Call<C> {
        self.fingerprint = Some(fingerprint);
        self
    }

    /// Stores the handler's `Ok` value, a `T`, as JSON and returns it to duplicates
    /// as [`Outcome::Replayed`] (`cache = true`).
    pub fn cached<T: Cacheable>(self) -> Call<JsonCache<T>> {
        let Call { spec, key, fingerprint, .. } = self;
        Call { spec, key, fingerprint, cache: JsonCache::new() }
    }
}

/// A value `cache = true` can keep: `Serialize` and `Deserialize`, asked as one bound
/// so that a value with neither is one error, saying both.
#[diagnostic::on_unimplemented(
    message = "`cache` keeps the handler's value as JSON, so `{Self}` must implement `serde::Serialize` and `serde::Deserialize`",
    label = "the handler's value must be `Serialize` and `Deserialize`",
    note = "derive both on the value's type: `#[derive(serde::Serialize, serde::Deserialize)]`, or drop `cache`"
)]
pub trait Cacheable: serde::Serialize + serde::de::DeserializeOwned {}

#[diagnostic::do_not_recommend]
impl<T: serde::Serialize + serde::de::DeserializeOwned> Cacheable for T {}

/// How a handler's `Ok` value is kept for duplicates.
pub trait ResultCache<T> {
    /// The bytes to store, `Ok(None)` for none, or why the value can't be stored.
    fn encode(&self, value: &T) -> Result<Option<Vec<u8>>, String>;
    /// The value back from stored bytes; `None` when this handler does not cache.
    fn decode(&self, bytes: &[u8]) -> Option<Result<T, String>>;
}

/// Keeps nothing: duplicates are [`Outcome::Duplicate`].
#[derive(Debug, Clone, Copy, Default)]
pub struct NoCache;

impl<T> ResultCache<T> for NoCache {
    fn encode(&self, _: &T) -> Result<Option<Vec<u8>>, String> {
        Ok(None)
    }
    fn decode(&self, _: &[u8]) -> Option<Result<T, String>> {
        None
    }
}

/// Keeps the value as JSON (`serde_json`), up to [`MAX_CACHED_RESULT`] bytes. Built by
/// [`Call::cached`], which is where `T`'s serde bounds are checked.
pub struct JsonCache<T> {
    encode: fn(&T) -> Result<Option<Vec<u8>>, String>,
    decode: fn(&[u8]) -> Result<T, String>,
}

impl<T: serde::Serialize + serde::de::DeserializeOwned> JsonCache<T> {
    /// The cache [`Call::cached`] sets up.
    pub(crate) fn new() -> JsonCache<T> {
        JsonCache { encode: encode_json::<T>, decode: decode_json::<T> }
    }
}

impl<T> ResultCache<T> for JsonCache<T> {
    fn encode(&self, value: &T) -> Result<Option<Vec<u8>>, String> {
        (self.encode)(value)
    }
    fn decode(&self, bytes: &[u8]) -> Option<Result<T, String>> {
        Some((self.decode)(bytes))
    }
}

/// The value as JSON, if it fits and reads back: serde_json writes a non-finite float
/// and a `Some` of a null as `null` (which an `Option` reads back as `None`:
/// `lossy_json`), and a `Serialize` may
/// not mirror its `Deserialize`. A value that would not read back as itself is not
/// stored, so its duplicates are plain ones rather than failed or wrong replays.
fn encode_json<T: serde::Serialize + serde::de::DeserializeOwned>(
    value: &T,
) -> Result<Option<Vec<u8>>, String> {
    if let Some(why) = crate::lossy_json::lossy(value) {
        return Err(format!("result not cached: {why}, so it would not read back as itself"));
    }
    let bytes = serde_json::to_vec(value).map_err(|e| format!("result not cached: {e}"))?;
    if bytes.len() > MAX_CACHED_RESULT {
        return Err(format!(
            "result not cached: {} bytes of JSON, over the {MAX_CACHED_RESULT}-byte limit",
            bytes.len()
        ));
    }
    if let Err(e) = serde_json::from_slice::<T>(&bytes) {
        return Err(format!("result not cached: its JSON would not read back ({e})"));
    }
    Ok(Some(bytes))
}

fn decode_json<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    serde_json::from_slice(bytes).map_err(|e| format!("cached result unreadable: {e}"))
}

/// Runs `body` at most once per key.
///
/// 1. The call's key is rendered; a key error returns [`Error::Key`] and runs nothing.
/// 2. Claims the key in `store`: a duplicate (replayed with `cache`), a live claim
///    elsewhere, a key that failed before or another payload under the same key
///    (with `validate`) returns without running `body`.
/// 3. Runs `body` while renewing the lease every third of `spec.lease()`. A panic is
///    caught and the key released. If this future is dropped mid-way, the store's
///    [`abandon`](Store::abandon) releases the key (or its lease runs out).
/// 4. Records the result: DONE (with the value, under `cache`) on `Ok`; released on a
///    retryable error before the last attempt; FAILED, plus `on_terminal`, on a
///    terminal error or the last attempt.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use idempotent_runtime::execute::{Call, Spec, run};
/// use idempotent_runtime::{Classify, Key, MemoryStore, Outcome, alert};
///
/// let store = MemoryStore::new();
/// let handle = || async {
///     let call = Call::new(Spec::default(), Key::new("orders", "42"));
///     run(call, &store, std::io::Error::class, alert::process_sink, async {
///         Ok::<_, std::io::Error>("charged")
///     })
///     .await
/// };
/// assert_eq!(handle().await.unwrap(), Outcome::Processed("charged"));
/// assert_eq!(handle().await.unwrap(), Outcome::Duplicate);
/// # }
/// ```
pub async fn run<S, R, T, E, C, H, F>(
    call: Call<R>,
    store: &S,
    classify: C,
    on_terminal: H,
    body: F,
) -> Result<Outcome<T>, Error<E>>
where
    S: Store + ?Sized,
    R: ResultCache<T>,
    E: Display,
    C: FnOnce(&E) -> ErrorClass,
    H: TerminalHook,
    F: Future<Output = Result<T, E>>,
{
    run_observed(call, store, StoreCompletion, classify, on_terminal, body).await
}

/// [`run_with`], in the call's span and with its metrics.
pub(crate) async fn run_observed<S, U, R, T, E, C, H, F>(
    call: Call<R>,
    store: &S,
    completion: U,
    classify: C,
    on_terminal: H,
    body: F,
) -> Result<Outcome<T>, Error<E>>
where
    S: Store + ?Sized,
    U: Completion<S>,
    R: ResultCache<T>,
    E: Display,
    C: FnOnce(&E) -> ErrorClass,
    H: TerminalHook,
    F: Future<Output = Result<T, E>>,
{
    let span = call.span();
    let meter = CallMeter::new(call.key.as_ref().ok());
    let call = run_with(&span, &meter, call, store, completion, classify, on_terminal, body);
    crate::trace::traced(&span, &meter, std::pin::pin!(call)).await
}

/// How a handler's effects are made to stick together with its DONE record.
pub(crate) trait Completion<S: ?Sized> {
    /// Claims the key.
    async fn claim(
        &mut self,
        store: &S,
        key: &Key,
        spec: &Spec,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Claim, StoreError>;
    /// Gets ready for the body, once the claim is won; the claim is held, without
    /// renewal, while this runs, so it must finish well within `spec.lease()`.
    async fn begin(&mut self, store: &S, spec: &Spec) -> Result<(), StoreError>;
    /// Records DONE with `result` (kept for `spec.ttl()`) and keeps the body's effects.
    /// Failed tries it makes again are counted on `meter`; the caller counts a
    /// [`Completed::Failed`].
    async fn complete(
        self,
        store: &S,
        key: &Key,
        token: Token,
        spec: &Spec,
        result: Option<&[u8]>,
        meter: &CallMeter,
    ) -> Completed;
    /// Throws away what the body did, when it failed or panicked, and gives back what
    /// the claim or `begin` took (a connection); also called without a body run. Says
    /// whether the claim still stands, so that the caller can release it or mark it
    /// FAILED.
    async fn discard(
        self,
        store: &S,
        key: &Key,
        token: Token,
        spec: &Spec,
        fingerprint: Option<&Fingerprint>,
    ) -> Discarded;
    /// Whether the claim is committed while the body runs, with a lease to renew and a
    /// release to send if the call is dropped. A claim held inside the body's own
    /// transaction has neither: it lasts exactly as long as that transaction.
    fn claim_committed(&self) -> bool {
        true
    }
}

/// What is left of the claim once [`Completion::discard`] threw the body's effects away.
// Only the SQL stores' in-transaction claims go with the transaction.
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
pub(crate) enum Discarded {
    /// The claim stands, under its token.
    Held,
    /// The claim went with the body's transaction and was taken again, under this token.
    Retaken(Token),
    /// The claim went with the body's transaction, and could not be taken again:
    /// another consumer has the key, or the store did not answer.
    Gone,
    /// The body's transaction had ended before it returned (a `COMMIT` of its own, DDL
    /// that commits, a deadlock the server rolled back): some of its writes stand and
    /// some may not, so the key was recorded FAILED rather than released for a retry
    /// that would write them again. The error says what happened.
    Ended(StoreError),
}

/// What [`Completion::complete`] did.
pub(crate) enum Completed {
    /// DONE is recorded and the effects kept.
    Applied,
    /// Another consumer holds the key now: nothing was recorded, and effects that
    /// could be thrown away were.
    LeaseLost,
    /// The store failed. `effects_kept`: whether the body's effects may stand anyway.
    Failed { error: StoreError, effects_kept: bool },
    /// As [`Discarded::Ended`]: the body's transaction ended before DONE, and the key
    /// was recorded FAILED instead.
    Ended(StoreError),
}

/// The body's effects are its own business; DONE is one [`Store::complete`].
struct StoreCompletion;

impl<S: Store + ?Sized> Completion<S> for StoreCompletion {
    async fn claim(
        &mut self,
        store: &S,
        key: &Key,
        spec: &Spec,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Claim, StoreError> {
        store.claim(key, spec.lease, spec.ttl, fingerprint).await
    }

    async fn begin(&mut self, _: &S, _: &Spec) -> Result<(), StoreError> {
        Ok(())
    }

    /// The handler's effects have happened: a store error here would mean a second
    /// run after the lease. The complete is fenced by the token, so it is tried again,
    /// with growing pauses, for up to half the lease (while the claim still holds).
    async fn complete(
        self,
        store: &S,
        key: &Key,
        token: Token,
        spec: &Spec,
        result: Option<&[u8]>,
        meter: &CallMeter,
    ) -> Completed {
        let mut pause = Duration::from_millis(10);
        // Half the lease from the first failure (the clock is read only then).
        let mut deadline = None;
        loop {
            // A retry ends by the deadline too: a store that is down may take its own
            // connection timeout to say so. (The first try takes what it takes.)
            let complete = store.complete(key, token, spec.ttl, result);
            let answer = match deadline {
                Some(deadline) => match within(deadline, complete).await {
                    Some(answer) => answer,
                    None => Err(StoreError::unavailable("recording DONE timed out")),
                },
                None => complete.await,
            };
            match answer {
                Ok(Transition::Applied) => return Completed::Applied,
                Ok(Transition::LeaseLost) => return Completed::LeaseLost,
                Err(error) if error.is_permanent() => {
                    return Completed::Failed { error, effects_kept: true };
                }
                Err(error) => {
                    let now = tokio::time::Instant::now();
                    let deadline = *deadline.get_or_insert(now + spec.lease / 2);
                    if now + pause > deadline {
                        return Completed::Failed { error, effects_kept: true };
                    }
                    meter.store_failed(Operation::Complete);
                    tracing::warn!(key = %key.logged(), %error, "recording DONE failed; trying again");
                    self::pause(pause).await;
                    pause *= 2;
                }
            }
        }
    }

    async fn discard(
        self,
        _: &S,
        _: &Key,
        _: Token,
        _: &Spec,
        _: Option<&Fingerprint>,
    ) -> Discarded {
        Discarded::Held
    }
}

/// [`run`], with `completion` deciding how the result is recorded.
#[allow(clippy::too_many_arguments)]
async fn run_with<S, U, R, T, E, C, H, F>(
    span: &tracing::Span,
    meter: &CallMeter,
    call: Call<R>,
    store: &S,
    mut completion: U,
    classify: C,
    on_terminal: H,
    body: F,
) -> Result<Outcome<T>, Error<E>>
where
    S: Store + ?Sized,
    U: Completion<S>,
    R: ResultCache<T>,
    E: Display,
    C: FnOnce(&E) -> ErrorClass,
    H: TerminalHook,
    F: Future<Output = Result<T, E>>,
{
    let Call { spec, key, fingerprint, cache } = call;
    let key = key.map_err(Error::Key)?;
    let claimed_at = tokio::time::Instant::now();
    // Before the claim answers, attempts are counted by the broker's deliveries.
    let early = || spec.backoff.delay(crate::delivery::delivery_count().unwrap_or(1));
    check_timer().map_err(|reason| Error::Runtime { reason, retry_after: early() })?;
    let hold = store.hold_limit().map_or(spec.lease, |limit| limit.min(spec.lease));
    let hold = hold.max(Spec::MIN_LEASE);
    let first_renewal = claimed_at + renewal_period(hold);
    let answer = completion.claim(store, &key, &spec, fingerprint.as_ref()).await;
    if !matches!(answer, Ok(Claim::Won { .. })) {
        // A won claim's time is taken when the body starts, with the same clock read.
        meter.claimed(claimed_at);
    }
    let (token, attempt, fence) = match answer {
        Ok(Claim::Won { token, attempt, fence }) => {
            span.record("attempt", attempt);
            tracing::debug!(attempt, fence, "claimed; running the handler");
            (token, attempt, fence)
        }
        Ok(Claim::Done) => return Ok(Outcome::Duplicate),
        Ok(Claim::Cached(bytes)) => {
            return match cache.decode(&bytes) {
                None => Ok(Outcome::Duplicate),
                Some(Ok(value)) => Ok(Outcome::Replayed(value)),
                Some(Err(reason)) => Err(Error::Cache { reason }),
            };
        }
        Ok(Claim::Mismatch) => return Err(Error::PayloadMismatch),
        Ok(Claim::InProgress { lease_left }) => {
            let retry_after = lease_left.unwrap_or_else(|| spec.backoff.delay(1));
            return Ok(Outcome::InProgress { retry_after });
        }
        Ok(Claim::Failed { attempts }) => return Err(Error::PreviouslyFailed { attempts }),
        Err(error) => {
            meter.store_failed(Operation::Claim);
            return Err(Error::Store { error, handler_ran: false, retry_after: early() });
        }
    };
    // How long a retry of this attempt waits.
    let later = || spec.backoff.delay(attempt);
    let mut claim = HeldClaim { spec, store, key: &key, token, claimed_at, hold, meter };
    let fingerprint = fingerprint.as_ref();

    if attempt > spec.max_attempts {
        // Every allowed attempt was started and none finished (each crashed, panicked
        // or was cancelled). Stop the loop here instead of running the handler again.
        let attempts = attempt - 1;
        meter.claimed(claimed_at);
        // What the completion holds (a pooled connection) goes back first: the FAILED
        // record may need it.
        match completion.discard(store, &key, claim.token, &spec, fingerprint).await {
            Discarded::Held => {}
            Discarded::Retaken(token) => claim.token = token,
            Discarded::Gone | Discarded::Ended(_) => {
                return Err(Error::LeaseLost { attempt, retry_after: later() });
            }
        }
        if claim.fail("earlier attempts never finished").await.is_err() {
            return Err(Error::LeaseLost { attempt, retry_after: later() });
        }
        let event = claim.event(attempts, true, format!("{attempts} attempt(s) never finished"));
        alert(on_terminal, event, &key).await;
        return Err(Error::Abandoned { attempts });
    }

    // Armed until the result is recorded: a call dropped at any await from here on
    // gives the key back (a no-op once the record is DONE or FAILED).
    let committed = completion.claim_committed();
    let mut abandon = AbandonOnDrop { store, key: &key, token, armed: committed };
    if let Err(error) = completion.begin(store, &spec).await {
        meter.claimed(claimed_at);
        meter.store_failed(Operation::Begin);
        let _ = claim.release().await;
        abandon.disarm();
        return Err(Error::Store { error, handler_ran: false, retry_after: later() });
    }
    let current = Current { key: key.clone(), attempt, token, fence };
    let started = meter.started(claimed_at);
    let run = {
        // The wrappers hold the body through a pinned reference rather than copy it;
        // the body itself is dropped at the end of this block, as soon as it stops
        // (what it holds, such as a lent transaction, goes back before the rest).
        let mut body = std::pin::pin!(body);
        let body = AssertUnwindSafe(body.as_mut()).catch_unwind();
        let body = crate::current::scope(current, body);
        if committed {
            with_renewal(&claim, first_renewal, body).await
        } else {
            // Nothing to renew: the claim is the transaction's row lock.
            Ok(body.await)
        }
    };
    meter.handled(started);
    let finished = match run {
        Ok(finished) => finished,
        Err(Stopped::Lost) => {
            // Another consumer owns the key now: the body was stopped rather than left
            // to run beside it, and nothing of this attempt is recorded.
            completion.discard(store, &key, claim.token, &spec, fingerprint).await;
            abandon.disarm();
            return Err(Error::LeaseLost { attempt, retry_after: later() });
        }
        Err(Stopped::Unconfirmed(error)) => {
            // The body was stopped where it waited, as a crash would stop it: the
            // store could not confirm that the claim still stands.
            completion.discard(store, &key, claim.token, &spec, fingerprint).await;
            let released = claim.release().await;
            abandon.disarm();
            return match released {
                Ok(()) => Err(Error::Store { error, handler_ran: true, retry_after: later() }),
                Err(Lost) => Err(Error::LeaseLost { attempt, retry_after: later() }),
            };
        }
        Err(Stopped::NoTimer) => {
            // The body was stopped at its first await, as a crash would stop it.
            completion.discard(store, &key, claim.token, &spec, fingerprint).await;
            let _ = claim.release().await;
            abandon.disarm();
            return Err(Error::Runtime { reason: NO_TIMER, retry_after: later() });
        }
    };

    let result = match finished {
        Ok(Ok(value)) => {
            // A value that can't be cached is still recorded DONE: its effect happened.
            let encoded = catch_unwind(AssertUnwindSafe(|| cache.encode(&value)))
                .unwrap_or_else(|_| Err("result not cached: serializing it panicked".to_owned()));
            let stored = encoded.as_ref().ok().and_then(Option::as_deref);
            tracing::debug!(state = "done", "recording");
            let completed = completion.complete(store, &key, token, &spec, stored, meter).await;
            if let Completed::Failed { .. } = completed {
                meter.store_failed(Operation::Complete);
            }
            match completed {
                Completed::Applied => match encoded {
                    Ok(_) => Ok(Outcome::Processed(value)),
                    Err(reason) => Ok(Outcome::ProcessedNotCached { value, reason }),
                },
                Completed::LeaseLost => Err(Error::LeaseLost { attempt, retry_after: later() }),
                Completed::Ended(error) => {
                    ended_early(on_terminal, &claim, attempt, error, later()).await
                }
                Completed::Failed { error, effects_kept: true } => {
                    Err(Error::Store { error, handler_ran: true, retry_after: later() })
                }
                Completed::Failed { error, effects_kept: false } => {
                    let _ = claim.release().await;
                    Err(Error::Store { error, handler_ran: false, retry_after: later() })
                }
            }
        }
        Ok(Err(error)) => {
            let discarded = completion.discard(store, &key, claim.token, &spec, fingerprint).await;
            // User code (classify, Display, the hook) runs outside the body's
            // catch_unwind: a panic in it must not leave the claim dangling.
            // A panicking `classify` counts as retryable.
            let class = catch_unwind(AssertUnwindSafe(|| classify(&error)))
                .unwrap_or(ErrorClass::Retryable);
            let retryable = class == ErrorClass::Retryable;
            let duplicate = class == ErrorClass::Duplicate;
            let message = || {
                catch_unwind(AssertUnwindSafe(|| error.to_string()))
                    .unwrap_or_else(|_| "(the error's Display implementation panicked)".to_owned())
            };
            let ended = match discarded {
                Discarded::Held => Ok(()),
                Discarded::Retaken(token) => {
                    (claim.token, abandon.token, abandon.armed) = (token, token, true);
                    Ok(())
                }
                Discarded::Gone => Err(Lost),
                Discarded::Ended(why) => {
                    abandon.disarm();
                    let why = StoreError::Rejected(
                        format!("{why}; the handler then failed: {}", message()).into(),
                    );
                    return ended_early(on_terminal, &claim, attempt, why, later()).await;
                }
            };
            if let Err(Lost) = ended {
                lost(attempt, message(), later())
            } else if duplicate {
                // Not a failure: the effect is there already, so the key is done.
                tracing::debug!(key = %key.logged(), error = %message(), "the handler found its effect already applied");
                match claim.complete().await {
                    Ok(Ok(())) => Ok(Outcome::Duplicate),
                    Ok(Err(error)) => {
                        let _ = claim.release().await;
                        Err(Error::Store { error, handler_ran: true, retry_after: later() })
                    }
                    Err(Lost) => lost(attempt, message(), later()),
                }
            } else if retryable && attempt < spec.max_attempts {
                match claim.release().await {
                    Ok(()) => Err(Error::Retryable { error, attempt, retry_after: later() }),
                    Err(Lost) => lost(attempt, message(), later()),
                }
            } else {
                match claim.fail("the handler failed for good").await {
                    Ok(()) => {
                        alert(on_terminal, claim.event(attempt, retryable, message()), &key).await;
                        Err(Error::Terminal { error, attempt, exhausted: retryable })
                    }
                    Err(Lost) => lost(attempt, message(), later()),
                }
            }
        }
        Err(panic) => {
            let discarded = completion.discard(store, &key, claim.token, &spec, fingerprint).await;
            let message = panic_message(&*panic);
            let exhausted = attempt >= spec.max_attempts;
            let ended = match discarded {
                Discarded::Held => Ok(()),
                Discarded::Retaken(token) => {
                    (claim.token, abandon.token, abandon.armed) = (token, token, true);
                    Ok(())
                }
                Discarded::Gone => Err(Lost),
                Discarded::Ended(why) => {
                    abandon.disarm();
                    let why = StoreError::Rejected(
                        format!("{why}; the handler then panicked: {message}").into(),
                    );
                    return ended_early(on_terminal, &claim, attempt, why, later()).await;
                }
            };
            let ended = if ended.is_err() {
                ended
            } else if exhausted {
                // The last allowed attempt: fail it now, with what happened, rather
                // than have the next delivery find it abandoned.
                claim.fail("the handler panicked on its last attempt").await
            } else {
                claim.release().await
            };
            match ended {
                Ok(()) => {
                    if exhausted {
                        let why = format!("the handler panicked: {message}");
                        alert(on_terminal, claim.event(attempt, true, why), &key).await;
                    }
                    Err(Error::Panicked { message, attempt, exhausted, retry_after: later() })
                }
                Err(Lost) => lost(attempt, format!("the handler panicked: {message}"), later()),
            }
        }
    };
    abandon.disarm();
    result
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
pub async fn run_infallible<S, R, T, F>(
    call: Call<R>,
    store: &S,
    body: F,
) -> Result<Outcome<T>, Error<std::convert::Infallible>>
where
    S: Store + ?Sized,
    R: ResultCache<T>,
    F: Future<Output = T>,
{
    let body = body.map(Ok);
    run(call, store, |e| match *e {}, crate::alert::process_sink, body).await
}

/// The answer for an attempt that ended after another consumer took its key: what the
/// handler did is logged, and the key is left to its owner (no release, no FAILED, no
/// alert).
fn lost<T, E>(attempt: u32, what: String, retry_after: Duration) -> Result<T, Error<E>> {
    tracing::warn!(attempt, error = %what, "the handler failed after its claim was lost; the key is another consumer's");
    Err(Error::LeaseLost { attempt, retry_after })
}

const NO_TIMER: &str = "there is no Tokio runtime with its timer enabled here, and lease \
    renewal needs one: call handlers from within a Tokio runtime built with `enable_time()` \
    or `enable_all()` (as `#[tokio::main]` does)";

thread_local! {
    /// Whether a timer was made on this thread.
    static TIMER_SEEN: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Checks, before the claim, that lease renewal will be able to make its timer:
/// without a Tokio runtime, or on one whose timer is disabled, making it panics, which
/// would otherwise happen half-way through the body. Tokio offers no way to ask, so
/// the check makes a timer and catches the panic, once per thread (asking which
/// runtime is current costs a contended reference count per call). A timer costs a
/// lock of the runtime's timer driver when it is dropped, so the renewal makes its own
/// only once the body has to wait (a body that finishes at its first poll needs none).
/// A thread that ran a runtime with a timer and now runs one without gets past the
/// check: the renewal's timer then fails, the body is stopped at its first await and
/// the claim released; the timers made after a body that never waited (a retried
/// DONE record's pause and deadline, an alert's deadline) go without, through
/// [`within`] and [`pause`], rather than panic half-way through recording.
fn check_timer() -> Result<(), &'static str> {
    if TIMER_SEEN.get() {
        return Ok(());
    }
    catch_unwind(|| drop(tokio::time::sleep(std::time::Duration::ZERO))).map_err(|_| NO_TIMER)?;
    TIMER_SEEN.set(true);
    Ok(())
}

/// `future`, cut off at `deadline` (`None`), or not cut off at all where no timer can
/// be made.
pub(crate) async fn within<F: Future>(
    deadline: tokio::time::Instant,
    future: F,
) -> Option<F::Output> {
    let Ok(timer) = catch_unwind(|| tokio::time::sleep_until(deadline)) else {
        TIMER_SEEN.set(false);
        return Some(future.await);
    };
    tokio::select! {
        biased;
        output = future => Some(output),
        () = timer => None,
    }
}

/// Waits `duration`, or not at all where no timer can be made.
async fn pause(duration: Duration) {
    match catch_unwind(|| tokio::time::sleep(duration)) {
        Ok(timer) => timer.await,
        Err(_) => TIMER_SEEN.set(false),
    }
}

/// The claim is no longer this call's: its lease ran out and another consumer took the
/// key, or the record is gone.
struct Lost;

/// Why the body was stopped before it finished.
enum Stopped {
    /// The claim was [`Lost`].
    Lost,
    /// The renewal could not make its timer.
    NoTimer,
    /// No renewal was confirmed for a hold after the claim's hold ran out.
    Unconfirmed(StoreError),
}

/// A claim this call won, and the transitions that end it.
struct HeldClaim<'a, S: ?Sized> {
    spec: Spec,
    store: &'a S,
    key: &'a Key,
    token: Token,
    /// When the claim was sent: its lease runs at least `spec.lease` from here.
    claimed_at: tokio::time::Instant,
    /// How long the claim surely stands after it or a renewal was sent: the lease,
    /// or the store's [`hold_limit`](Store::hold_limit) if shorter.
    hold: Duration,
    meter: &'a CallMeter,
}

impl<S: Store + ?Sized> HeldClaim<'_, S> {
    /// Releases the claim. On failure the lease runs out instead, which has the same
    /// effect later, so the caller's answer does not change. Returns `Err(Lost)` when
    /// the claim was no longer ours.
    async fn release(&self) -> Result<(), Lost> {
        tracing::debug!(state = "released", "recording");
        match self.store.release(self.key, self.token).await {
            Ok(Transition::Applied) => Ok(()),
            Ok(Transition::LeaseLost) => {
                tracing::warn!(key = %self.key.logged(), "release skipped: the claim was already lost");
                Err(Lost)
            }
            Err(error) => {
                self.meter.store_failed(Operation::Release);
                tracing::warn!(key = %self.key.logged(), %error, "release failed; the lease will run out");
                Ok(())
            }
        }
    }

    /// Marks the claim DONE, with no result: for a handler that found its effect
    /// already applied, and so has no effects of its own to keep. Returns `Err(Lost)`
    /// when the claim was no longer ours, `Ok(Err(_))` when the store failed.
    async fn complete(&self) -> Result<Result<(), StoreError>, Lost> {
        tracing::debug!(state = "done", "recording");
        match self.store.complete(self.key, self.token, self.spec.ttl, None).await {
            Ok(Transition::Applied) => Ok(Ok(())),
            Ok(Transition::LeaseLost) => Err(Lost),
            Err(error) => {
                self.meter.store_failed(Operation::Complete);
                Ok(Err(error))
            }
        }
    }

    /// Marks the claim FAILED. On failure the message is still dead-lettered by the
    /// caller; the record is then released by lease expiry. Returns `Err(Lost)` when
    /// the claim was no longer ours: another consumer owns the key, so there is
    /// nothing to alert about.
    async fn fail(&self, why: &str) -> Result<(), Lost> {
        tracing::debug!(state = "failed", "recording");
        match self.store.fail(self.key, self.token, self.spec.ttl).await {
            Ok(Transition::Applied) => Ok(()),
            Ok(Transition::LeaseLost) => {
                tracing::warn!(key = %self.key.logged(), why, "not marked failed: the claim was already lost");
                Err(Lost)
            }
            Err(error) => {
                self.meter.store_failed(Operation::Fail);
                tracing::warn!(key = %self.key.logged(), why, %error, "could not mark failed");
                Ok(())
            }
        }
    }

    fn event(&self, attempt: u32, exhausted: bool, error: String) -> TerminalEvent {
        TerminalEvent {
            namespace: self.key.namespace().to_owned(),
            logged_key: self.key.logged().to_string(),
            key: self.key.id().escape_ascii().to_string(),
            attempt,
            exhausted,
            error,
        }
    }
}

/// The body's transaction ended before DONE (see [`Discarded::Ended`]) and the key is
/// FAILED: an alert, and a store error that dead-letters the message, saying what
/// happened and that the handler's writes must be checked by hand.
async fn ended_early<S, T, E, H>(
    on_terminal: H,
    claim: &HeldClaim<'_, S>,
    attempt: u32,
    error: StoreError,
    retry_after: Duration,
) -> Result<Outcome<T>, Error<E>>
where
    S: Store + ?Sized,
    H: TerminalHook,
{
    tracing::error!(key = %claim.key.logged(), %error, "the handler's transaction ended before DONE; the key is FAILED");
    alert(on_terminal, claim.event(attempt, false, error.to_string()), claim.key).await;
    Err(Error::Store { error, handler_ran: true, retry_after })
}

/// Sends a terminal alert. The record is already FAILED, so a panicking hook is
/// logged rather than allowed to unwind through the caller.
async fn alert<H>(on_terminal: H, event: TerminalEvent, key: &Key)
where
    H: TerminalHook,
{
    let sent = AssertUnwindSafe(async move { on_terminal.send(event).await }).catch_unwind();
    match within(tokio::time::Instant::now() + crate::alert::HOOK_TIMEOUT, sent).await {
        Some(Ok(())) => {}
        Some(Err(_)) => {
            tracing::error!(key = %key.logged(), "the on_terminal hook panicked; the alert was lost")
        }
        None => tracing::error!(
            key = %key.logged(),
            "the on_terminal hook took longer than {:?} and was dropped; the record is FAILED \
             and the call goes on",
            crate::alert::HOOK_TIMEOUT
        ),
    }
}

/// How many renewals of one claim may wait for their answers at once.
const RENEWALS_IN_FLIGHT: usize = 4;

/// How long after the last applied renewal (or the claim) the next one is due: a
/// third of the lease.
fn renewal_period(lease: Duration) -> Duration {
    lease / 3
}

/// Polls `body` to completion while renewing the claim's lease every third of it.
/// When a renewal finds the claim taken, the body is dropped at its next await, as a
/// crash would stop it, rather than left to run beside the key's new owner.
///
/// The body is polled only while the hold the last applied renewal granted lasts
/// (the lease, or the store's [`hold_limit`](Store::hold_limit) if shorter). Past
/// it, another consumer may have taken the key: the body waits until a renewal is
/// applied, and is stopped when one answers that the key was taken, or when none is
/// confirmed within one more hold (the store unreachable, or answering later than a
/// hold): a consumer cut off from its store does not run beside one that took its
/// key over. A call left unpolled past its hold (its task starved, its process
/// stopped) waits for the renewal that was due in the same way.
/// Counts and logs a renewal that failed or timed out (`why`), and returns `why`.
fn renewal_failed<S: Store + ?Sized>(claim: &HeldClaim<'_, S>, why: String) -> String {
    claim.meter.store_failed(Operation::Renew);
    tracing::warn!(key = %claim.key.logged(), error = %why, "lease renewal failed; trying again");
    why
}

async fn with_renewal<S, F>(
    claim: &HeldClaim<'_, S>,
    first: tokio::time::Instant,
    body: F,
) -> Result<F::Output, Stopped>
where
    S: Store + ?Sized,
    F: Future,
{
    // Renewals are scheduled from the last one that was applied, every third of the
    // hold. A renewal that fails or times out is tried again at once (after a
    // thirtieth of the hold), and no wait for an answer outlasts the hold the last
    // applied renewal granted: one slow renewal must not push the next one past the
    // hold's end. Once the hold has run out, a renewal gets what is left of the one
    // more hold the body waits for; and a renewal that timed out is still listened
    // to: its answer, however late, stops a body whose key another consumer took.
    let hold = claim.hold;
    let period = renewal_period(hold);
    let pause = (hold / 30).max(std::time::Duration::from_millis(1));
    // Until when the claim is known to be this call's. (Shared by the two futures
    // below, which only this task polls; atomic because the call's future is `Send`.)
    let held_until = HeldUntil::new(claim.claimed_at, hold);
    let renew = async {
        let Ok(timer) = catch_unwind(|| tokio::time::sleep_until(first)) else {
            TIMER_SEEN.set(false);
            return Stopped::NoTimer;
        };
        tokio::pin!(timer);
        // Every renewal sent and not answered yet, with when it was sent. One that
        // times out is not dropped: a store slower than its budget (replies held back
        // on the network, a pool connection still draining an earlier reply) still
        // answers, and an answer that the key was taken stops the body however late
        // it comes. At most `RENEWALS_IN_FLIGHT` wait at once (the store's own
        // timeouts end the rest).
        let renewal = |sent| async move {
            let answer =
                claim.store.renew(claim.key, claim.token, claim.spec.lease, claim.spec.ttl).await;
            (sent, answer)
        };
        let mut in_flight = futures_util::stream::FuturesUnordered::new();
        // The newest renewal, while it has neither answered nor timed out: when it was
        // sent, and when it times out.
        let mut current: Option<(tokio::time::Instant, tokio::time::Instant)> = None;
        let mut next = first;
        // Once the hold ran out unconfirmed: until when the body waits for a renewal
        // to be applied, and why the last one was not.
        let mut give_up_at: Option<tokio::time::Instant> = None;
        let mut last_failure = String::from("no renewal was answered");
        let unconfirmed = |why: &str| {
            tracing::warn!(
                key = %claim.key.logged(),
                why,
                "the lease ran out and no renewal was confirmed for as long again: another \
                 consumer may own the key; stopping the handler"
            );
            Stopped::Unconfirmed(StoreError::unavailable(format!(
                "no renewal of the claim was confirmed for {hold:?} after its lease ran out \
                 ({why}); the handler was stopped there rather than run beside a consumer \
                 that may have taken the key over"
            )))
        };
        loop {
            timer.as_mut().reset(current.map_or(next, |(_, due)| due));
            tokio::select! {
                biased;
                Some((sent, answer)) = futures_util::StreamExt::next(&mut in_flight) => {
                    let is_current = current.is_some_and(|(newest, _)| newest == sent);
                    match answer {
                        Ok(Transition::Applied) => {
                            held_until.renewed(sent + hold);
                            if !held_until.lapsed() {
                                give_up_at = None;
                            }
                            if is_current {
                                current = None;
                                next = sent + period;
                            }
                        }
                        Ok(Transition::LeaseLost) => {
                            tracing::warn!(
                                key = %claim.key.logged(),
                                "lease lost while the handler ran: another consumer owns the key; \
                                 stopping the handler"
                            );
                            return Stopped::Lost;
                        }
                        // An older renewal failing was counted when it timed out.
                        Err(error) if is_current => {
                            current = None;
                            let now = tokio::time::Instant::now();
                            last_failure = renewal_failed(claim, StoreError::to_string(&error));
                            if give_up_at.is_some_and(|until| now >= until) {
                                return unconfirmed(&last_failure);
                            }
                            next = now + pause;
                        }
                        Err(_) => {}
                    }
                }
                () = timer.as_mut() => {
                    let now = tokio::time::Instant::now();
                    if current.take().is_some() {
                        last_failure = renewal_failed(claim, "the last renewal timed out".to_owned());
                        if give_up_at.is_some_and(|until| now >= until) {
                            return unconfirmed(&last_failure);
                        }
                        next = now + pause;
                        continue;
                    }
                    let left = held_until.get().saturating_duration_since(now);
                    let budget = if left.is_zero() {
                        let until = *give_up_at.get_or_insert(now + hold);
                        if now >= until {
                            return unconfirmed(&last_failure);
                        }
                        until - now
                    } else {
                        left.min(period).max(pause)
                    };
                    if in_flight.len() < RENEWALS_IN_FLIGHT {
                        in_flight.push(renewal(now));
                        current = Some((now, now + budget));
                    } else {
                        // As many renewals wait as may: the next is sent when this
                        // one's budget ends, unless one of them answers first.
                        next = now + budget;
                    }
                }
            }
        }
    };
    tokio::pin!(body, renew);
    std::future::poll_fn(|cx| {
        // While the hold lasts, the body first (the renewal's timer is made once it
        // waits). Once it has run out, the renewal first, and the body only when one
        // is applied.
        let lapsed = held_until.lapsed();
        if lapsed {
            if let Poll::Ready(stopped) = renew.as_mut().poll(cx) {
                return Poll::Ready(Err(stopped));
            }
            if held_until.lapsed() {
                return Poll::Pending;
            }
        }
        if let Poll::Ready(out) = body.as_mut().poll(cx) {
            return Poll::Ready(Ok(out));
        }
        match lapsed {
            true => Poll::Pending,
            false => renew.as_mut().poll(cx).map(Err),
        }
    })
    .await
}

/// Until when a claim is known to be this call's (as nanoseconds since the claim).
struct HeldUntil {
    claimed_at: tokio::time::Instant,
    nanos: std::sync::atomic::AtomicU64,
}

impl HeldUntil {
    fn new(claimed_at: tokio::time::Instant, hold: Duration) -> HeldUntil {
        let held = HeldUntil { claimed_at, nanos: 0.into() };
        held.set(claimed_at + hold);
        held
    }

    /// Whether the body must wait for a renewal to be applied before it goes on.
    fn lapsed(&self) -> bool {
        tokio::time::Instant::now() >= self.get()
    }

    /// A renewal was applied: the claim is held until `until`, unless a later one
    /// (sent after it, answered before it) holds it longer.
    fn renewed(&self, until: tokio::time::Instant) {
        self.set(until.max(self.get()));
    }

    fn get(&self) -> tokio::time::Instant {
        let nanos = self.nanos.load(Relaxed);
        self.claimed_at + Duration::from_nanos(nanos)
    }

    fn set(&self, until: tokio::time::Instant) {
        let nanos = until.saturating_duration_since(self.claimed_at).as_nanos();
        self.nanos.store(u64::try_from(nanos).unwrap_or(u64::MAX), Relaxed);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A cached float replays as the handler returned it, to the last bit: serde_json
    /// reads it back with correct rounding (`float_roundtrip`), not its faster
    /// approximation, which is off by one unit in the last place for some values.
    #[test]
    fn cached_floats_replay_exactly() {
        let cache = JsonCache::<f64>::new();
        for value in [8.854502369371306e-159, 0.1, 1e-300, 5e-324, f64::MAX, -2.5e22] {
            let bytes = cache.encode(&value).unwrap().unwrap();
            let back = cache.decode(&bytes).unwrap().unwrap();
            assert_eq!(back.to_bits(), value.to_bits(), "{value:e} cached as {bytes:?}");
        }
    }

    /// serde_json writes a NaN or an infinite float as `null`, which an `Option<f64>`
    /// reads back as `None`: such a result is not cached, rather than replayed as
    /// another value.
    #[test]
    fn results_holding_non_finite_floats_are_not_cached() {
        let cache = JsonCache::<Option<f64>>::new();
        assert!(cache.encode(&Some(f64::NAN)).is_err());
        assert!(cache.encode(&Some(f64::INFINITY)).is_err());
        assert_eq!(cache.encode(&Some(1.5)), Ok(Some(b"1.5".to_vec())));
        assert_eq!(cache.encode(&None), Ok(Some(b"null".to_vec())));
        let cache = JsonCache::<Vec<(String, Option<f32>)>>::new();
        assert!(cache.encode(&vec![("a".into(), Some(f32::NEG_INFINITY))]).is_err());
        assert!(cache.encode(&vec![("a".into(), Some(-0.0))]).is_ok());
    }

    /// serde_json writes `Some` of a null (`Some(None)`, `Some(())`, `Some(Null)`) as
    /// `null`, which reads back as `None`: not cached, rather than replayed as `None`.
    #[test]
    fn results_holding_a_some_of_null_are_not_cached() {
        let nested = JsonCache::<Option<Option<u32>>>::new();
        let refused = nested.encode(&Some(None)).unwrap_err();
        assert!(refused.contains("Some"), "{refused}");
        assert_eq!(nested.encode(&Some(Some(9))), Ok(Some(b"9".to_vec())));
        assert_eq!(nested.encode(&None), Ok(Some(b"null".to_vec())));
        let value = JsonCache::<Option<serde_json::Value>>::new();
        assert!(value.encode(&Some(serde_json::Value::Null)).is_err());
        assert!(value.encode(&Some(serde_json::json!({"a": null}))).is_ok());
        let units = JsonCache::<Vec<Option<()>>>::new();
        assert!(units.encode(&vec![None, Some(())]).is_err());
        assert!(units.encode(&vec![None, None]).is_ok());
        let deep = JsonCache::<(u8, Option<Option<Option<u8>>>)>::new();
        assert!(deep.encode(&(1, Some(Some(None)))).is_err());
        assert!(deep.encode(&(1, Some(Some(Some(0))))).is_ok());
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(20_000))]

        #[test]
        fn every_finite_float_replays_exactly(bits in proptest::prelude::any::<u64>()) {
            let value = f64::from_bits(bits);
            proptest::prop_assume!(value.is_finite());
            let cache = JsonCache::<f64>::new();
            let bytes = cache.encode(&value).unwrap().unwrap();
            let back = cache.decode(&bytes).unwrap().unwrap();
            // `-0.0` is written `-0.0` and read back as it.
            proptest::prop_assert_eq!(back.to_bits(), value.to_bits());
        }
    }
}
