//! Every shape of function `#[idempotent]` accepts, exercised end to end on a
//! `MemoryStore`.

use std::future::Future as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use idempotent::{Classify, Error, MemoryStore, Outcome, idempotent};

#[derive(Debug, Clone)]
struct Customer {
    id: u64,
}

#[derive(Debug, Clone)]
struct OrderPlaced {
    order_id: u64,
    customer: Customer,
    amount_cents: i64,
}

fn order(order_id: u64) -> OrderPlaced {
    OrderPlaced { order_id, customer: Customer { id: 9 }, amount_cents: 100 }
}

#[derive(Debug, thiserror::Error, Classify)]
enum PayError {
    #[error("database timed out")]
    #[idempotent(retryable)]
    DbTimeout,
    #[error("insufficient funds")]
    #[idempotent(terminal)]
    InsufficientFunds,
}

static RUNS: AtomicU32 = AtomicU32::new(0);
static FREE_STORE: std::sync::LazyLock<MemoryStore> = std::sync::LazyLock::new(MemoryStore::new);

#[idempotent(key = "order:{order_id}:{customer.id}", ttl = 600, store = FREE_STORE)]
async fn free_function(msg: OrderPlaced) -> Result<i64, PayError> {
    RUNS.fetch_add(1, Ordering::SeqCst);
    if msg.amount_cents < 0 {
        return Err(PayError::InsufficientFunds);
    }
    Ok(msg.amount_cents)
}

#[tokio::test]
async fn free_function_runs_once_per_key() {
    assert_eq!(free_function(order(1)).await.unwrap(), Outcome::Processed(100));
    assert_eq!(free_function(order(1)).await.unwrap(), Outcome::Duplicate);
    assert_eq!(free_function(order(2)).await.unwrap(), Outcome::Processed(100));
    assert_eq!(RUNS.load(Ordering::SeqCst), 2);
    let bad = OrderPlaced { amount_cents: -1, ..order(3) };
    let err = free_function(bad).await.unwrap_err();
    assert!(matches!(err, Error::Terminal { error: PayError::InsufficientFunds, .. }));
}

struct Consumer {
    store: Arc<MemoryStore>,
    tenant: String,
    runs: AtomicU32,
}

impl Consumer {
    #[idempotent(key = "{self.tenant}/{order_id}", store = self.store, namespace = "orders")]
    async fn handle(&self, msg: &OrderPlaced) -> Result<u64, PayError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        Ok(msg.order_id)
    }

    /// Several arguments; the message is not the first one.
    #[idempotent(key = "{attempt_hint}-{order_id}", message = msg, store = &*self.store, namespace = "hinted")]
    async fn with_args(&self, attempt_hint: u8, msg: OrderPlaced) -> Result<(), PayError> {
        let _ = (attempt_hint, msg);
        self.runs.fetch_add(1, Ordering::SeqCst);
        Err(PayError::DbTimeout)
    }
}

#[tokio::test]
async fn methods_read_self_and_other_arguments() {
    let c = Consumer { store: Arc::new(MemoryStore::new()), tenant: "acme".into(), runs: 0.into() };
    assert_eq!(c.handle(&order(5)).await.unwrap(), Outcome::Processed(5));
    assert_eq!(c.handle(&order(5)).await.unwrap(), Outcome::Duplicate);
    let key = idempotent::Key::new("orders", "acme/5").unwrap();
    let claim = idempotent::Store::claim(&*c.store, &key, LEASE, LEASE, None).await.unwrap();
    assert_eq!(claim, idempotent::Claim::Done, "the key is rendered as the template says");

    let err = c.with_args(3, order(6)).await.unwrap_err();
    assert!(matches!(err, Error::Retryable { attempt: 1, .. }));
    let err = c.with_args(3, order(6)).await.unwrap_err();
    assert!(matches!(err, Error::Retryable { attempt: 2, .. }), "{err:?}");
    assert_eq!(c.runs.load(Ordering::SeqCst), 3);
}

const LEASE: std::time::Duration = std::time::Duration::from_secs(30);

trait Handler {
    async fn handle(&self, msg: OrderPlaced) -> Result<Outcome<u64>, Error<PayError>>;
}

struct TraitConsumer(MemoryStore);

impl Handler for TraitConsumer {
    #[idempotent(key = "{order_id}", store = self.0, namespace = "tuple_receiver")]
    async fn handle(&self, msg: OrderPlaced) -> Result<u64, PayError> {
        Ok(msg.order_id * 2)
    }
}

#[tokio::test]
async fn trait_impl_methods() {
    let c = TraitConsumer(MemoryStore::new());
    assert_eq!(c.handle(order(4)).await.unwrap(), Outcome::Processed(8));
    assert_eq!(c.handle(order(4)).await.unwrap(), Outcome::Duplicate);
}

/// Dispatch through a trait object: `dyn` needs `#[async_trait]`, which rewrites the
/// method before `#[idempotent]` sees it.
#[idempotent::async_trait]
trait DynHandler: Send + Sync {
    async fn handle(&self, msg: &OrderPlaced) -> Result<Outcome<u64>, Error<PayError>>;
    async fn fire(&self, id: u64, msg: OrderPlaced) -> Result<Outcome<()>, Error<PayError>>;
}

struct Billing {
    store: Arc<MemoryStore>,
    tenant: String,
    runs: AtomicU32,
}

#[idempotent::async_trait]
impl DynHandler for Billing {
    #[idempotent(key = "{self.tenant}/{order_id}", store = self.store, namespace = "dyn.handle")]
    async fn handle(&self, msg: &OrderPlaced) -> Result<u64, PayError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        if msg.amount_cents < 0 {
            return Err(PayError::DbTimeout);
        }
        Ok(msg.order_id + u64::from(self.tenant.len() as u8))
    }

    /// The message is not the first argument, and the result is `()`.
    #[idempotent(key = "{id}", message = msg, store = &*self.store, namespace = "dyn.fire")]
    async fn fire(&self, id: u64, msg: OrderPlaced) -> Result<(), PayError> {
        let _ = (id, msg);
        self.runs.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

#[tokio::test]
async fn async_trait_methods_behind_a_trait_object() {
    let billing = Arc::new(Billing {
        store: Arc::new(MemoryStore::new()),
        tenant: "acme".into(),
        runs: 0.into(),
    });
    let handler: Arc<dyn DynHandler> = billing.clone();
    assert_eq!(handler.handle(&order(7)).await.unwrap(), Outcome::Processed(11));
    assert_eq!(handler.handle(&order(7)).await.unwrap(), Outcome::Duplicate);
    let key = idempotent::Key::new("dyn.handle", "acme/7").unwrap();
    let claim = idempotent::Store::claim(&*billing.store, &key, LEASE, LEASE, None).await.unwrap();
    assert_eq!(claim, idempotent::Claim::Done, "the key reads `self` and the message");

    // A retryable error releases the key: the next delivery runs again.
    let failing = OrderPlaced { amount_cents: -1, ..order(8) };
    let err = handler.handle(&failing).await.unwrap_err();
    assert!(matches!(err, Error::Retryable { attempt: 1, .. }), "{err:?}");
    let err = handler.handle(&failing).await.unwrap_err();
    assert!(matches!(err, Error::Retryable { attempt: 2, .. }), "{err:?}");

    // The futures are `Send`: the trait object's method can be spawned.
    let spawned = tokio::spawn({
        let handler = handler.clone();
        async move { handler.fire(1, order(9)).await }
    });
    assert_eq!(spawned.await.unwrap().unwrap(), Outcome::Processed(()));
    assert_eq!(handler.fire(1, order(10)).await.unwrap(), Outcome::Duplicate);
    assert_eq!(billing.runs.load(Ordering::SeqCst), 4);
}

#[idempotent(key = "item:{id}", store = store)]
async fn generic<T, S>(id: T, store: &S) -> String
where
    T: std::fmt::Display + Send,
    S: idempotent::Store,
{
    format!("handled {id}")
}

#[tokio::test]
async fn generic_functions_and_infallible_handlers() {
    let store = MemoryStore::new();
    let first: Result<Outcome<String>, Error<std::convert::Infallible>> = generic(7, &store).await;
    assert_eq!(first.unwrap(), Outcome::Processed("handled 7".into()));
    assert_eq!(generic("7", &store).await.unwrap(), Outcome::Duplicate);
}

#[idempotent(key = "{0}", store = store)]
async fn io_alias(msg: (u32,), store: Arc<dyn idempotent::Store>) -> std::io::Result<u32> {
    if msg.0 == 0 {
        return Err(std::io::Error::from(std::io::ErrorKind::InvalidData));
    }
    let parsed: u32 = "12".parse().map_err(|_| std::io::Error::other("no"))?;
    Ok(parsed + msg.0)
}

#[tokio::test]
async fn one_argument_result_aliases_and_dyn_stores() {
    let store: Arc<dyn idempotent::Store> = Arc::new(MemoryStore::new());
    assert_eq!(io_alias((1,), store.clone()).await.unwrap(), Outcome::Processed(13));
    let err = io_alias((0,), store.clone()).await.unwrap_err();
    assert!(err.is_terminal(), "InvalidData is terminal: {err}");
}

#[idempotent(key = "{order_id}")]
async fn default_store_unset(msg: OrderPlaced) -> u64 {
    msg.order_id
}

#[tokio::test]
async fn no_default_store_is_an_error_not_a_silent_fallback() {
    let err = default_store_unset(order(1)).await.unwrap_err();
    assert!(matches!(
        err,
        Error::Store { error: idempotent::StoreError::NotConfigured, handler_ran: false, .. }
    ));
}

#[idempotent(key = "{name}", store = FREE_STORE, namespace = "empty_keys")]
async fn by_name(name: String) {}

#[tokio::test]
async fn an_empty_placeholder_is_a_key_error_and_runs_nothing() {
    let err = by_name(String::new()).await.unwrap_err();
    assert!(matches!(
        err,
        Error::Key(idempotent::KeyError::EmptyPlaceholder { placeholder: "name" })
    ));
    assert_eq!(err.disposition(), idempotent::Disposition::DeadLetter);
}

static RACE_STORE: std::sync::LazyLock<MemoryStore> = std::sync::LazyLock::new(MemoryStore::new);
static RACE_RUNS: AtomicU32 = AtomicU32::new(0);

#[idempotent(key = "race:{order_id}", store = RACE_STORE)]
async fn race(msg: OrderPlaced) -> Result<(), PayError> {
    RACE_RUNS.fetch_add(1, Ordering::SeqCst);
    tokio::task::yield_now().await;
    let _ = msg;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_deliveries_of_one_message_run_it_once() {
    let tasks: Vec<_> = (0..1_000).map(|_| tokio::spawn(race(order(77)))).collect();
    let mut processed = 0;
    for task in tasks {
        match task.await.unwrap().unwrap() {
            Outcome::Processed(()) => processed += 1,
            Outcome::InProgress { .. } | Outcome::Duplicate => {}
            Outcome::Replayed(()) | Outcome::ProcessedNotCached { .. } => {
                panic!("nothing is cached")
            }
        }
    }
    assert_eq!((processed, RACE_RUNS.load(Ordering::SeqCst)), (1, 1));
}

static TIMELESS_RUNS: AtomicU32 = AtomicU32::new(0);
static TIMELESS_STORE: std::sync::LazyLock<MemoryStore> =
    std::sync::LazyLock::new(MemoryStore::new);

#[idempotent(key = "order:{order_id}", store = TIMELESS_STORE)]
async fn timeless(msg: OrderPlaced) -> Result<u64, PayError> {
    TIMELESS_RUNS.fetch_add(1, Ordering::SeqCst);
    tokio::task::yield_now().await;
    Ok(msg.order_id)
}

/// Lease renewal needs Tokio's timer. Without one the call claims nothing, runs
/// nothing and says why, instead of panicking half-way through the body.
#[test]
fn a_runtime_without_timers_or_without_tokio_is_refused_before_the_claim() {
    let no_timer = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let err = no_timer.block_on(timeless(order(1))).unwrap_err();
    assert!(matches!(err, Error::Runtime { .. }), "{err:?}");
    assert!(err.to_string().contains("enable_time"), "{err}");
    assert_eq!(err.disposition(), idempotent::Disposition::Retry);

    // Outside any Tokio runtime (a bare executor polling the future).
    let mut call = std::pin::pin!(timeless(order(1)));
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let std::task::Poll::Ready(Err(err)) = call.as_mut().poll(&mut cx) else {
        panic!("expected an error at once")
    };
    assert!(err.to_string().contains("Tokio runtime"), "{err}");

    assert_eq!(TIMELESS_RUNS.load(Ordering::SeqCst), 0, "the body never started");
    let timers = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    assert!(timers.block_on(timeless(order(1))).unwrap().is_processed(), "nothing was claimed");
}

/// The check is made once per thread: a thread that ran a runtime with a timer and
/// then runs one without gets past it, and the body is stopped at its first await
/// (where the renewal makes its timer), the claim given back.
static LATER_RUNS: AtomicU32 = AtomicU32::new(0);

#[idempotent(key = "order:{order_id}", store = TIMELESS_STORE)]
async fn timeless_later(msg: OrderPlaced) -> Result<u64, PayError> {
    LATER_RUNS.fetch_add(1, Ordering::SeqCst);
    tokio::task::yield_now().await;
    Ok(msg.order_id)
}

#[test]
fn a_runtime_without_timers_met_after_one_with_them_stops_the_body_and_releases() {
    std::thread::spawn(|| {
        let timers = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        assert!(timers.block_on(timeless_later(order(2))).unwrap().is_processed());
        let runs = LATER_RUNS.load(Ordering::SeqCst);

        let no_timer = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let err = no_timer.block_on(timeless_later(order(3))).unwrap_err();
        assert!(err.to_string().contains("enable_time"), "{err}");
        assert_eq!(LATER_RUNS.load(Ordering::SeqCst), runs + 1, "stopped at its first await");
        // Released: the next delivery runs it again, as its second attempt.
        let err = no_timer.block_on(timeless_later(order(3))).unwrap_err();
        assert!(matches!(err, Error::Runtime { .. }), "{err:?}");
        assert!(timers.block_on(timeless_later(order(3))).unwrap().is_processed(), "released");
    })
    .join()
    .unwrap();
}

/// What a state-machine guard answers when the order is paid already.
#[derive(Debug, thiserror::Error, Classify)]
enum GuardError {
    #[error("order {0} is paid already")]
    #[idempotent(duplicate)]
    AlreadyPaid(u64),
    #[error("order {0} was cancelled")]
    #[idempotent(terminal)]
    Cancelled(u64),
}

static GUARD_RUNS: AtomicU32 = AtomicU32::new(0);

#[idempotent(key = "order:{order_id}", store = store)]
async fn pay_guarded(msg: OrderPlaced, store: &MemoryStore, paid: bool) -> Result<u64, GuardError> {
    GUARD_RUNS.fetch_add(1, Ordering::SeqCst);
    if paid { Err(GuardError::AlreadyPaid(msg.order_id)) } else { Ok(msg.order_id) }
}

/// An error marked `#[idempotent(duplicate)]` is an answer, not a failure: the call
/// is `Ok(Duplicate)` (ack), the key DONE, and the handler does not run again.
#[tokio::test]
async fn an_effect_found_already_applied_is_a_duplicate_and_done() {
    assert_eq!(GuardError::AlreadyPaid(1).class(), idempotent::ErrorClass::Duplicate);
    assert_eq!(GuardError::Cancelled(1).class(), idempotent::ErrorClass::Terminal);
    let store = MemoryStore::new();
    let out = pay_guarded(order(7), &store, true).await;
    assert_eq!(idempotent::DispositionExt::disposition(&out), idempotent::Disposition::Ack);
    assert_eq!(out.unwrap(), Outcome::Duplicate);
    assert_eq!(pay_guarded(order(7), &store, false).await.unwrap(), Outcome::Duplicate);
    assert_eq!(GUARD_RUNS.load(Ordering::SeqCst), 1, "DONE: not run again");
}

/// Orders and their states, the guard of a handler that keeps no records.
#[derive(Default)]
struct Ledger {
    paid: std::sync::Mutex<std::collections::HashSet<u64>>,
    charges: AtomicU32,
}

#[idempotent(key = "order:{order_id}", store = idempotent::NoStore)]
async fn pay_by_state(msg: OrderPlaced, ledger: &Ledger) -> Result<(), GuardError> {
    if msg.amount_cents < 0 {
        return Err(GuardError::Cancelled(msg.order_id));
    }
    // The guard: only an unpaid order is paid, checked and changed in one step.
    if !ledger.paid.lock().unwrap().insert(msg.order_id) {
        return Err(GuardError::AlreadyPaid(msg.order_id));
    }
    ledger.charges.fetch_add(1, Ordering::SeqCst);
    Ok(())
}

/// `NoStore` keeps nothing: every delivery runs, the business guard turns the
/// duplicates away (acked as duplicates), and a terminal error still dead-letters
/// with an alert-worthy `Terminal`, on attempt 1 every time.
#[tokio::test]
async fn a_handler_on_no_store_runs_every_delivery_and_its_guard_decides() {
    use idempotent::{Disposition, DispositionExt};
    let ledger = Ledger::default();
    assert!(pay_by_state(order(1), &ledger).await.unwrap().is_processed());
    for _ in 0..3 {
        let again = pay_by_state(order(1), &ledger).await;
        assert_eq!(again.disposition(), Disposition::Ack);
        assert_eq!(again.unwrap(), Outcome::Duplicate);
    }
    assert_eq!(ledger.charges.load(Ordering::SeqCst), 1);
    let cancelled = OrderPlaced { amount_cents: -1, ..order(2) };
    for _ in 0..2 {
        let err = pay_by_state(cancelled.clone(), &ledger).await.unwrap_err();
        assert!(matches!(err, Error::Terminal { attempt: 1, .. }), "{err:?}");
        assert_eq!(err.disposition(), Disposition::DeadLetter);
    }
}

#[idempotent(key = "order:{order_id}", store = store, backoff = "200ms..1s")]
async fn backing_off(msg: OrderPlaced, store: &MemoryStore) -> Result<(), PayError> {
    let _ = msg;
    Err(PayError::DbTimeout)
}

#[idempotent(key = "order:{order_id}", store = store, backoff = "300ms", max_attempts = 9)]
async fn fixed_backoff(msg: OrderPlaced, store: &MemoryStore) -> Result<(), PayError> {
    let _ = msg;
    Err(PayError::DbTimeout)
}

#[idempotent(key = "order:{order_id}", store = store)]
async fn default_backoff(msg: OrderPlaced, store: &MemoryStore) -> Result<(), PayError> {
    let _ = msg;
    Err(PayError::DbTimeout)
}

/// Each retryable failure says how long to wait: a random time in the upper half of
/// `min(cap, base·2^(attempt−1))`, by the handler's `backoff` (exponential, fixed, or
/// the default 1 s..5 min); the result says the same through `DispositionExt`.
#[tokio::test]
async fn a_retry_waits_by_the_handlers_backoff() {
    use idempotent::DispositionExt as _;
    use std::time::Duration;
    let store = MemoryStore::new();
    let ms = Duration::from_millis;
    let within = |result: &Result<Outcome<()>, Error<PayError>>, ceiling: Duration| {
        let delay = result.retry_delay().expect("a retry has a delay");
        assert!(delay >= ceiling / 2 && delay <= ceiling, "{delay:?} not within {ceiling:?}");
        assert!(
            matches!(result, Err(Error::Retryable { retry_after, .. }) if *retry_after == delay)
        );
    };
    // Exponential, capped at 1 s from the fourth attempt on; the fifth is terminal.
    for ceiling in [200, 400, 800, 1000] {
        within(&backing_off(order(1), &store).await, ms(ceiling));
    }
    let last = backing_off(order(1), &store).await;
    assert!(matches!(last, Err(Error::Terminal { exhausted: true, .. })), "{last:?}");
    assert_eq!(last.retry_delay(), None, "a dead letter waits for nothing");
    for _ in 0..8 {
        within(&fixed_backoff(order(2), &store).await, ms(300));
    }
    for ceiling in [1000, 2000, 4000, 8000] {
        within(&default_backoff(order(3), &store).await, ms(ceiling));
    }
}

/// A key held by another consumer's claim: `InProgress`, to be retried about when
/// that claim's lease runs out.
#[tokio::test]
async fn in_progress_waits_for_the_other_claims_lease() {
    use idempotent::{DispositionExt as _, Key, Store as _};
    use std::time::Duration;
    let store = MemoryStore::new();
    let key = Key::new("backing_off", "order:4").unwrap();
    let lease = Duration::from_secs(20);
    let held = store.claim(&key, lease, Duration::from_secs(60), None).await.unwrap();
    assert!(matches!(held, idempotent::Claim::Won { .. }));
    let busy = backing_off(order(4), &store).await;
    let delay = busy.retry_delay().expect("InProgress is retried");
    assert!(delay <= lease && delay > lease - Duration::from_secs(5), "{delay:?}");
    assert!(matches!(busy, Ok(Outcome::InProgress { retry_after }) if retry_after == delay));
}
