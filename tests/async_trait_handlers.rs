//! `#[idempotent]` methods in `#[async_trait]` impls, called through trait objects,
//! under the conditions a consumer meets: futures dropped mid-way (timeouts,
//! `select!`, aborted tasks, a runtime shut down), bodies longer than the lease,
//! hostile keys, every receiver and impl shape, many concurrent deliveries, panics,
//! and the body's own control flow (`return`, `?`, shadowed names).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
use std::task::{Context, Waker};
use std::time::Duration;

use idempotent::admin::State;
use idempotent::{
    Admin as _, Classify, Error, Key, KeyError, MAX_KEY_LEN, MemoryStore, Outcome, Store,
    async_trait, idempotent,
};

// ---------------------------------------------------------------------------------
// Messages, errors and bookkeeping
// ---------------------------------------------------------------------------------

/// What a handler body does with a message.
#[derive(Debug, Clone)]
enum Act {
    Succeed,
    Sleep(Duration),
    Panic,
    Retry,
    Decline,
    /// Parses the text with `?` (a `From` conversion into the handler's error).
    Parse(String),
    /// Returns `Ok` early, before the end of the body.
    EarlyOk,
}

#[derive(Debug, Clone)]
struct Order {
    order_id: u64,
    tag: String,
    act: Act,
}

fn order(order_id: u64, act: Act) -> Order {
    Order { order_id, tag: "t".into(), act }
}

#[derive(Debug, thiserror::Error, Classify)]
enum PayError {
    #[error("database timed out")]
    #[idempotent(retryable)]
    Timeout,
    #[error("declined")]
    #[idempotent(terminal)]
    Declined,
    #[error("bad amount: {0}")]
    #[idempotent(terminal)]
    BadAmount(#[from] std::num::ParseIntError),
}

/// How often a body started, finished, and ran beside itself.
#[derive(Default)]
struct Counters {
    runs: AtomicU32,
    finished: AtomicU32,
    active: AtomicU32,
    max_active: AtomicU32,
}

/// Held by a running body: counts it as active until dropped (also when the body is
/// dropped or unwinds).
struct Running<'a>(&'a Counters);

impl Counters {
    fn enter(&self) -> Running<'_> {
        self.runs.fetch_add(1, SeqCst);
        let now = self.active.fetch_add(1, SeqCst) + 1;
        self.max_active.fetch_max(now, SeqCst);
        Running(self)
    }
    fn runs(&self) -> u32 {
        self.runs.load(SeqCst)
    }
    fn finished(&self) -> u32 {
        self.finished.load(SeqCst)
    }
    fn max_active(&self) -> u32 {
        self.max_active.load(SeqCst)
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, SeqCst);
    }
}

/// The record of `key`: its state and how many claims it had, or `None`.
async fn record(store: &MemoryStore, key: &Key) -> Option<(State, u32)> {
    store.inspect(key).await.unwrap().map(|r| (r.state, r.attempts))
}

// ---------------------------------------------------------------------------------
// The handler under test
// ---------------------------------------------------------------------------------

#[async_trait]
trait Handler: Send + Sync {
    async fn handle(&self, msg: &Order) -> Result<Outcome<u64>, Error<PayError>>;
    async fn short_lease(&self, msg: &Order) -> Result<Outcome<u64>, Error<PayError>>;
}

struct Worker {
    store: Arc<MemoryStore>,
    tenant: String,
    counters: Counters,
}

fn worker() -> Arc<Worker> {
    worker_for("acme")
}

fn worker_for(tenant: &str) -> Arc<Worker> {
    Arc::new(Worker {
        store: Arc::new(MemoryStore::new()),
        tenant: tenant.into(),
        counters: Counters::default(),
    })
}

/// The key `handle` renders for `order_id` and `tag` (for tags without `/` or `%`).
fn handle_key(order_id: u64, tag: &str) -> Key {
    Key::new("at.handle", format!("acme/{order_id}/{tag}")).unwrap()
}

#[async_trait]
impl Handler for Worker {
    #[idempotent(
        key = "{self.tenant}/{order_id}/{tag}",
        ttl = 600,
        lease = 2,
        max_attempts = 3,
        store = self.store,
        namespace = "at.handle"
    )]
    async fn handle(&self, msg: &Order) -> Result<u64, PayError> {
        let _running = self.counters.enter();
        match &msg.act {
            Act::Succeed => {}
            Act::Sleep(d) => tokio::time::sleep(*d).await,
            Act::Panic => panic!("handler exploded on order {}", msg.order_id),
            Act::Retry => return Err(PayError::Timeout),
            Act::Decline => return Err(PayError::Declined),
            Act::EarlyOk => return Ok(0),
            Act::Parse(text) => {
                let n: u64 = text.parse()?;
                self.counters.finished.fetch_add(1, SeqCst);
                return Ok(n);
            }
        }
        self.counters.finished.fetch_add(1, SeqCst);
        Ok(msg.order_id)
    }

    #[idempotent(key = "{order_id}", ttl = 600, lease = "300ms", store = self.store, namespace = "at.short")]
    async fn short_lease(&self, msg: &Order) -> Result<u64, PayError> {
        let _running = self.counters.enter();
        if let Act::Sleep(d) = &msg.act {
            tokio::time::sleep(*d).await;
        }
        self.counters.finished.fetch_add(1, SeqCst);
        Ok(msg.order_id)
    }
}

// ---------------------------------------------------------------------------------
// 1. Futures dropped mid-way
// ---------------------------------------------------------------------------------

/// A consumer's timeout drops the call mid-body: the key is given back at once (not
/// after the lease), and the redelivery runs the body as the second attempt.
#[tokio::test(start_paused = true)]
async fn a_call_dropped_by_a_timeout_mid_body_gives_the_key_back() {
    let w = worker();
    let h: Arc<dyn Handler> = w.clone();
    let slow = order(1, Act::Sleep(Duration::from_secs(10)));
    let cut = tokio::time::timeout(Duration::from_millis(500), h.handle(&slow)).await;
    assert!(cut.is_err(), "the timeout fired");
    assert_eq!((w.counters.runs(), w.counters.finished()), (1, 0));
    assert_eq!(record(&w.store, &handle_key(1, "t")).await, Some((State::Released, 1)));

    // Redelivered well within the 2 s lease.
    let again = h.handle(&order(1, Act::Succeed)).await.unwrap();
    assert_eq!(again, Outcome::Processed(1));
    assert_eq!((w.counters.runs(), w.counters.finished()), (2, 1));
    assert_eq!(record(&w.store, &handle_key(1, "t")).await, Some((State::Done, 2)));
    assert_eq!(h.handle(&order(1, Act::Succeed)).await.unwrap(), Outcome::Duplicate);
}

/// The losing branch of a `select!` is dropped the same way.
#[tokio::test(start_paused = true)]
async fn a_call_dropped_by_select_gives_the_key_back() {
    let w = worker();
    let h: Arc<dyn Handler> = w.clone();
    let slow = order(2, Act::Sleep(Duration::from_secs(10)));
    tokio::select! {
        _ = h.handle(&slow) => panic!("the handler should still be sleeping"),
        () = tokio::time::sleep(Duration::from_millis(300)) => {}
    }
    assert_eq!(record(&w.store, &handle_key(2, "t")).await, Some((State::Released, 1)));
    assert_eq!(h.handle(&order(2, Act::Succeed)).await.unwrap(), Outcome::Processed(2));
    assert_eq!(w.counters.max_active(), 1);
}

/// A future created and dropped without a poll claims nothing and runs nothing.
#[tokio::test(start_paused = true)]
async fn a_call_dropped_before_its_first_poll_claims_nothing() {
    let w = worker();
    let h: Arc<dyn Handler> = w.clone();
    let msg = order(3, Act::Succeed);
    drop(h.handle(&msg));
    assert_eq!(w.counters.runs(), 0);
    assert_eq!(record(&w.store, &handle_key(3, "t")).await, None);
    assert_eq!(h.handle(&msg).await.unwrap(), Outcome::Processed(3));
    assert_eq!(record(&w.store, &handle_key(3, "t")).await, Some((State::Done, 1)));
}

/// A task aborted mid-body on a multi-thread runtime gives the key back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_task_gives_the_key_back() {
    let w = worker();
    let h: Arc<dyn Handler> = w.clone();
    let task = tokio::spawn({
        let h = h.clone();
        async move { h.handle(&order(4, Act::Sleep(Duration::from_secs(60)))).await }
    });
    while w.counters.runs() == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    assert_eq!(record(&w.store, &handle_key(4, "t")).await, Some((State::Released, 1)));
    assert_eq!(h.handle(&order(4, Act::Succeed)).await.unwrap(), Outcome::Processed(4));
    assert_eq!(w.counters.max_active(), 1);
}

/// A consumer shutting down (its runtime dropped with the call in flight) gives the
/// key back: the next process runs the message at once, not after the lease.
#[test]
fn a_runtime_shut_down_mid_body_gives_the_key_back() {
    let w = worker();
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    rt.spawn({
        let h: Arc<dyn Handler> = w.clone();
        async move { h.handle(&order(5, Act::Sleep(Duration::from_secs(60)))).await }
    });
    while w.counters.runs() == 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(rt);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        assert_eq!(record(&w.store, &handle_key(5, "t")).await, Some((State::Released, 1)));
        let h: Arc<dyn Handler> = w.clone();
        assert_eq!(h.handle(&order(5, Act::Succeed)).await.unwrap(), Outcome::Processed(5));
    });
}

/// Dropping calls mid-body attempt after attempt: each drop is counted (attempts that
/// never finished count), and once `max_attempts` (3) were started the next delivery
/// is `Abandoned`, not run a fourth time.
#[tokio::test(start_paused = true)]
async fn calls_dropped_on_every_attempt_end_in_abandoned() {
    let w = worker();
    let h: Arc<dyn Handler> = w.clone();
    let slow = order(6, Act::Sleep(Duration::from_secs(10)));
    for attempt in 1..=3 {
        let cut = tokio::time::timeout(Duration::from_millis(100), h.handle(&slow)).await;
        assert!(cut.is_err());
        assert_eq!(record(&w.store, &handle_key(6, "t")).await, Some((State::Released, attempt)));
    }
    let err = h.handle(&order(6, Act::Succeed)).await.unwrap_err();
    assert!(matches!(err, Error::Abandoned { attempts: 3 }), "{err:?}");
    assert_eq!(w.counters.runs(), 3);
    assert_eq!(record(&w.store, &handle_key(6, "t")).await.map(|r| r.0), Some(State::Failed));
}

/// A call whose future is left unpolled past its lease (a starved task, a stopped
/// process) loses its claim to a redelivery, which runs the message. When it is
/// polled again its body must be stopped, as a lost renewal stops it, rather than run
/// on to its end beside (and after) the new owner's run.
#[tokio::test(start_paused = true)]
async fn a_call_left_unpolled_past_its_lease_is_stopped_when_polled_again() {
    let w = worker();
    let h: Arc<dyn Handler> = w.clone();
    let slow = order(7, Act::Sleep(Duration::from_secs(3)));
    let mut first = h.handle(&slow);
    let mut cx = Context::from_waker(Waker::noop());
    assert!(first.as_mut().poll(&mut cx).is_pending(), "claimed, and sleeping in the body");
    assert_eq!(w.counters.runs(), 1);

    // Not polled for 5 s: the 2 s lease lapses, and a redelivery takes the key over.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(h.handle(&order(7, Act::Succeed)).await.unwrap(), Outcome::Processed(7));
    assert_eq!((w.counters.runs(), w.counters.finished()), (2, 1));

    let late = first.await;
    assert!(matches!(late, Err(Error::LeaseLost { .. })), "{late:?}");
    assert_eq!(
        w.counters.finished(),
        1,
        "the first call's body ran on to its end after another consumer had run the message"
    );
}

/// The same in real time: on a current-thread runtime, a neighbouring task blocks the
/// thread for 1.5 s while a handler with a 300 ms lease waits in its body. Another
/// consumer takes the lapsed key over and runs the message; when the thread is free
/// again, the first body must be stopped rather than finish a second run.
#[test]
fn a_call_starved_by_a_blocking_neighbour_is_stopped_when_it_resumes() {
    let w = worker();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let late = rt.block_on(async {
        let h: Arc<dyn Handler> = w.clone();
        let first = tokio::spawn({
            let h = h.clone();
            async move { h.short_lease(&order(8, Act::Sleep(Duration::from_millis(200)))).await }
        });
        while w.counters.runs() == 0 {
            tokio::task::yield_now().await;
        }
        let other = std::thread::spawn({
            let h: Arc<dyn Handler> = w.clone();
            move || {
                std::thread::sleep(Duration::from_millis(700));
                let rt =
                    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                rt.block_on(h.short_lease(&order(8, Act::Succeed)))
            }
        });
        // The neighbour: synchronous work on the runtime's only thread.
        tokio::spawn(async { std::thread::sleep(Duration::from_millis(1500)) }).await.unwrap();
        assert_eq!(other.join().unwrap().unwrap(), Outcome::Processed(8), "taken over");
        first.await.unwrap()
    });
    assert!(matches!(late, Err(Error::LeaseLost { .. })), "{late:?}");
    assert_eq!(w.counters.finished(), 1, "the starved body ran on to its end after the takeover");
}

// ---------------------------------------------------------------------------------
// 2. Bodies longer than the lease
// ---------------------------------------------------------------------------------

/// A body sleeping 10 s under a 2 s lease keeps its claim renewed: every duplicate
/// meanwhile is answered `InProgress`, and the body runs once.
#[tokio::test(start_paused = true)]
async fn a_body_five_leases_long_keeps_its_claim() {
    let w = worker();
    let h: Arc<dyn Handler> = w.clone();
    let first = tokio::spawn({
        let h = h.clone();
        async move { h.handle(&order(10, Act::Sleep(Duration::from_secs(10)))).await }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    for second in 1..=9 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let dup = h.handle(&order(10, Act::Succeed)).await.unwrap();
        assert!(
            matches!(dup, Outcome::InProgress { retry_after } if retry_after <= Duration::from_secs(2)),
            "{second} s in: {dup:?}"
        );
    }
    assert_eq!(first.await.unwrap().unwrap(), Outcome::Processed(10));
    assert_eq!(h.handle(&order(10, Act::Succeed)).await.unwrap(), Outcome::Duplicate);
    assert_eq!((w.counters.runs(), w.counters.max_active()), (1, 1));
    assert_eq!(record(&w.store, &handle_key(10, "t")).await, Some((State::Done, 1)));
}

/// The same in real time on a multi-thread runtime: a 300 ms lease, a 1.5 s body and
/// a duplicate every 50 ms from other tasks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_lease_is_renewed_in_real_time() {
    let w = worker();
    let h: Arc<dyn Handler> = w.clone();
    let first = tokio::spawn({
        let h = h.clone();
        async move { h.short_lease(&order(11, Act::Sleep(Duration::from_millis(1500)))).await }
    });
    while w.counters.runs() == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let mut dups = Vec::new();
    for _ in 0..25 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let h = h.clone();
        dups.push(tokio::spawn(async move { h.short_lease(&order(11, Act::Succeed)).await }));
    }
    for dup in dups {
        let dup = dup.await.unwrap().unwrap();
        assert!(matches!(dup, Outcome::InProgress { .. } | Outcome::Duplicate), "{dup:?}");
    }
    assert_eq!(first.await.unwrap().unwrap(), Outcome::Processed(11));
    assert_eq!((w.counters.runs(), w.counters.max_active()), (1, 1));
}

// ---------------------------------------------------------------------------------
// 3. Hostile keys
// ---------------------------------------------------------------------------------

/// A 1 MB receiver field is a key error: no panic, no claim, no run.
#[tokio::test]
async fn a_megabyte_self_field_is_a_key_error() {
    let w = worker_for(&"x".repeat(1 << 20));
    let h: Arc<dyn Handler> = w.clone();
    let err = h.handle(&order(20, Act::Succeed)).await.unwrap_err();
    assert!(matches!(err, Error::Key(KeyError::TooLong { max: MAX_KEY_LEN, .. })), "{err:?}");
    assert_eq!(err.disposition(), idempotent::Disposition::DeadLetter);
    assert_eq!(w.counters.runs(), 0);
}

/// A 1 MB message field likewise.
#[tokio::test]
async fn a_megabyte_message_field_is_a_key_error() {
    let w = worker();
    let h: Arc<dyn Handler> = w.clone();
    let big = Order { tag: "y".repeat(1 << 20), ..order(21, Act::Succeed) };
    let err = h.handle(&big).await.unwrap_err();
    assert!(matches!(err, Error::Key(KeyError::TooLong { .. })), "{err:?}");
    assert_eq!(w.counters.runs(), 0);
}

/// The limit is exact: a key of `MAX_KEY_LEN` bytes is used, one byte more is refused.
#[tokio::test]
async fn the_key_length_limit_is_exact() {
    let w = worker();
    let h: Arc<dyn Handler> = w.clone();
    // "at.handle:" + "acme/22/" + tag
    let fixed = "at.handle:acme/22/".len();
    let fits = Order { tag: "z".repeat(MAX_KEY_LEN - fixed), ..order(22, Act::Succeed) };
    assert_eq!(h.handle(&fits).await.unwrap(), Outcome::Processed(22));
    let over = Order { tag: "z".repeat(MAX_KEY_LEN - fixed + 1), ..order(22, Act::Succeed) };
    let err = h.handle(&over).await.unwrap_err();
    assert!(
        matches!(err, Error::Key(KeyError::TooLong { len, .. }) if len == MAX_KEY_LEN + 1),
        "{err:?}"
    );
    assert_eq!(w.counters.runs(), 1);
}

/// NUL bytes, control characters, separators and `%` are kept apart: each value is
/// its own key, and each is deduplicated.
#[tokio::test]
async fn nul_bytes_separators_and_escapes_render_distinct_keys() {
    let w = worker();
    let h: Arc<dyn Handler> = w.clone();
    let tags = [
        "a",
        "a\0",
        "a\0b",
        "ab",
        "\0",
        "a/b",
        "a%2Fb",
        "a%b",
        "\u{202e}a",
        "a\r\n",
        "é",
        "e\u{301}",
    ];
    for tag in tags {
        let msg = Order { tag: tag.into(), ..order(23, Act::Succeed) };
        assert_eq!(h.handle(&msg).await.unwrap(), Outcome::Processed(23), "{tag:?}");
    }
    for tag in tags {
        let msg = Order { tag: tag.into(), ..order(23, Act::Succeed) };
        assert_eq!(h.handle(&msg).await.unwrap(), Outcome::Duplicate, "{tag:?}");
    }
    assert_eq!(w.counters.runs() as usize, tags.len());
}

/// A label whose `Display` fails, or panics.
#[derive(Debug, Clone)]
enum Label {
    Plain(String),
    Broken,
    Exploding,
}

impl fmt::Display for Label {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Label::Plain(s) => f.write_str(s),
            Label::Broken => {
                f.write_str("part")?;
                Err(fmt::Error)
            }
            Label::Exploding => panic!("Display exploded"),
        }
    }
}

struct Labelled {
    label: Label,
}

#[async_trait]
trait LabelHandler: Send + Sync {
    async fn handle(&self, msg: &Labelled) -> Result<Outcome<()>, Error<PayError>>;
}

#[async_trait]
impl LabelHandler for Worker {
    #[idempotent(key = "{self.tenant}:{label}", store = self.store, namespace = "at.label")]
    async fn handle(&self, msg: &Labelled) -> Result<(), PayError> {
        let _ = &msg.label;
        let _running = self.counters.enter();
        Ok(())
    }
}

/// A failing `Display` and an empty value are key errors that run nothing; a
/// panicking `Display` claims nothing and leaves the key free for the next delivery.
#[tokio::test]
async fn unprintable_and_empty_key_parts_run_nothing() {
    let w = worker();
    let h: Arc<dyn LabelHandler> = w.clone();
    let err = h.handle(&Labelled { label: Label::Broken }).await.unwrap_err();
    assert!(matches!(err, Error::Key(KeyError::Unprintable { placeholder: "label" })), "{err:?}");
    let err = h.handle(&Labelled { label: Label::Plain(String::new()) }).await.unwrap_err();
    assert!(matches!(err, Error::Key(KeyError::EmptyPlaceholder { placeholder: "label" })));

    let exploding = tokio::spawn({
        let h = h.clone();
        async move { h.handle(&Labelled { label: Label::Exploding }).await }
    });
    assert!(exploding.await.unwrap_err().is_panic());
    assert_eq!(w.counters.runs(), 0);
    assert_eq!(w.store.list(&Default::default(), None, 10).await.unwrap().records.len(), 0);
    let fine = h.handle(&Labelled { label: Label::Plain("ok".into()) }).await.unwrap();
    assert_eq!(fine, Outcome::Processed(()));
}

// ---------------------------------------------------------------------------------
// 4. Receivers, stores and impl shapes
// ---------------------------------------------------------------------------------

static SHARED: std::sync::LazyLock<MemoryStore> = std::sync::LazyLock::new(MemoryStore::new);

struct Owned {
    tenant: String,
    store: Arc<MemoryStore>,
    counters: Counters,
    seen: u32,
}

fn owned(tenant: &str) -> Owned {
    Owned {
        tenant: tenant.into(),
        store: Arc::new(MemoryStore::new()),
        counters: Counters::default(),
        seen: 0,
    }
}

#[async_trait]
trait ArcReceiver: Send + Sync {
    async fn handle(self: Arc<Self>, msg: Order) -> Result<Outcome<u64>, Error<PayError>>;
}

#[async_trait]
impl ArcReceiver for Owned {
    /// `self: Arc<Self>`, the message by value; the key and the store read the
    /// receiver, which `#[async_trait]` moves into the body.
    #[idempotent(key = "{self.tenant}/{order_id}", store = self.store, namespace = "at.arc")]
    async fn handle(self: Arc<Self>, msg: Order) -> Result<u64, PayError> {
        let _running = self.counters.enter();
        tokio::task::yield_now().await;
        Ok(msg.order_id)
    }
}

#[tokio::test]
async fn arc_self_receivers() {
    let o = Arc::new(owned("arc"));
    let h: Arc<dyn ArcReceiver> = o.clone();
    assert_eq!(h.clone().handle(order(30, Act::Succeed)).await.unwrap(), Outcome::Processed(30));
    assert_eq!(h.clone().handle(order(30, Act::Succeed)).await.unwrap(), Outcome::Duplicate);
    assert_eq!(o.counters.runs(), 1);
    let key = Key::new("at.arc", "arc/30").unwrap();
    assert_eq!(record(&o.store, &key).await, Some((State::Done, 1)));
}

#[async_trait]
trait MutReceiver: Send {
    async fn handle(&mut self, msg: &Order) -> Result<Outcome<u64>, Error<PayError>>;
}

#[async_trait]
impl MutReceiver for Owned {
    /// `&mut self`: the store borrowed from one field, the body writing another.
    #[idempotent(key = "{self.tenant}/{order_id}", store = self.store, namespace = "at.mut")]
    async fn handle(&mut self, msg: &Order) -> Result<u64, PayError> {
        self.seen += 1;
        tokio::task::yield_now().await;
        Ok(msg.order_id + u64::from(self.seen))
    }
}

#[tokio::test]
async fn mut_self_receivers() {
    let mut o = owned("mut");
    let h: &mut dyn MutReceiver = &mut o;
    assert_eq!(h.handle(&order(31, Act::Succeed)).await.unwrap(), Outcome::Processed(32));
    assert_eq!(h.handle(&order(31, Act::Succeed)).await.unwrap(), Outcome::Duplicate);
    assert_eq!(o.seen, 1);
    let key = Key::new("at.mut", "mut/31").unwrap();
    assert_eq!(record(&o.store, &key).await, Some((State::Done, 1)));
}

#[async_trait]
trait StoreArgument: Send + Sync {
    async fn handle(
        &self,
        msg: Order,
        store: Arc<MemoryStore>,
    ) -> Result<Outcome<u64>, Error<PayError>>;
}

#[async_trait]
impl StoreArgument for Owned {
    /// The store passed by value beside the message, both moved into the body.
    #[idempotent(key = "{self.tenant}/{order_id}", message = msg, store = store, namespace = "at.store_arg")]
    async fn handle(&self, msg: Order, store: Arc<MemoryStore>) -> Result<u64, PayError> {
        let _running = self.counters.enter();
        tokio::task::yield_now().await;
        Ok(msg.order_id + u64::from(Arc::strong_count(&store) > 0))
    }
}

#[tokio::test]
async fn stores_passed_by_value() {
    let o = Arc::new(owned("arg"));
    let h: Arc<dyn StoreArgument> = o.clone();
    let store = Arc::new(MemoryStore::new());
    assert_eq!(
        h.handle(order(35, Act::Succeed), store.clone()).await.unwrap(),
        Outcome::Processed(36)
    );
    assert_eq!(h.handle(order(35, Act::Succeed), store.clone()).await.unwrap(), Outcome::Duplicate);
    assert_eq!(o.counters.runs(), 1);
    let key = Key::new("at.store_arg", "arg/35").unwrap();
    assert_eq!(record(&store, &key).await, Some((State::Done, 1)));
}

/// A store behind `Arc<dyn Store>`.
struct DynStored {
    store: Arc<dyn Store>,
    counters: Counters,
}

#[async_trait]
impl Handler for DynStored {
    #[idempotent(key = "{order_id}", store = self.store, namespace = "at.dyn_store")]
    async fn handle(&self, msg: &Order) -> Result<u64, PayError> {
        let _running = self.counters.enter();
        if let Act::Retry = msg.act {
            return Err(PayError::Timeout);
        }
        Ok(msg.order_id)
    }

    #[idempotent(key = "{order_id}", store = &*self.store, namespace = "at.dyn_store_ref")]
    async fn short_lease(&self, msg: &Order) -> Result<u64, PayError> {
        Ok(msg.order_id)
    }
}

#[tokio::test]
async fn dyn_store_fields() {
    let d =
        Arc::new(DynStored { store: Arc::new(MemoryStore::new()), counters: Counters::default() });
    let h: Arc<dyn Handler> = d.clone();
    assert!(matches!(
        h.handle(&order(32, Act::Retry)).await,
        Err(Error::Retryable { attempt: 1, .. })
    ));
    assert_eq!(h.handle(&order(32, Act::Succeed)).await.unwrap(), Outcome::Processed(32));
    assert_eq!(h.handle(&order(32, Act::Succeed)).await.unwrap(), Outcome::Duplicate);
    assert_eq!(h.short_lease(&order(32, Act::Succeed)).await.unwrap(), Outcome::Processed(32));
    assert_eq!(d.counters.runs(), 2);
}

/// A generic impl over the store type.
struct Generic<S> {
    store: S,
    counters: Counters,
}

#[async_trait]
impl<S: Store + 'static> Handler for Generic<S> {
    #[idempotent(key = "{order_id}/{tag}", lease = 2, store = self.store, namespace = "at.generic")]
    async fn handle(&self, msg: &Order) -> Result<u64, PayError> {
        let _running = self.counters.enter();
        if let Act::Sleep(d) = &msg.act {
            tokio::time::sleep(*d).await;
        }
        Ok(msg.order_id)
    }

    #[idempotent(key = "{order_id}", store = self.store, namespace = "at.generic_short")]
    async fn short_lease(&self, msg: &Order) -> Result<u64, PayError> {
        Ok(msg.order_id)
    }
}

#[tokio::test(start_paused = true)]
async fn generic_impls() {
    let g = Arc::new(Generic { store: MemoryStore::new(), counters: Counters::default() });
    let h: Arc<dyn Handler> = g.clone();
    let cut = tokio::time::timeout(
        Duration::from_millis(100),
        h.handle(&order(33, Act::Sleep(Duration::from_secs(5)))),
    )
    .await;
    assert!(cut.is_err());
    assert_eq!(h.handle(&order(33, Act::Succeed)).await.unwrap(), Outcome::Processed(33));
    assert_eq!(h.handle(&order(33, Act::Succeed)).await.unwrap(), Outcome::Duplicate);
    assert_eq!(g.counters.runs(), 2);
}

/// Explicit lifetimes, a message by value bound `mut`, another argument in the key.
#[async_trait]
trait Shapes: Send + Sync {
    async fn borrowed<'a>(
        &'a self,
        msg: &'a Order,
        region: &'a str,
    ) -> Result<Outcome<String>, Error<PayError>>;
    async fn by_value(&self, msg: Order) -> Result<Outcome<u64>, Error<PayError>>;
}

#[async_trait]
impl Shapes for Worker {
    #[idempotent(key = "{region}:{order_id}", store = self.store, namespace = "at.borrowed")]
    async fn borrowed<'a>(&'a self, msg: &'a Order, region: &'a str) -> Result<String, PayError> {
        let _running = self.counters.enter();
        Ok(format!("{region}/{}", msg.order_id))
    }

    /// The body changes the message it owns; the key was rendered before.
    #[idempotent(key = "{order_id}", store = self.store, namespace = "at.by_value")]
    async fn by_value(&self, mut msg: Order) -> Result<u64, PayError> {
        let _running = self.counters.enter();
        msg.order_id += 100;
        Ok(msg.order_id)
    }
}

#[tokio::test]
async fn lifetimes_and_messages_by_value() {
    let w = worker();
    let h: Arc<dyn Shapes> = w.clone();
    let msg = order(34, Act::Succeed);
    assert_eq!(h.borrowed(&msg, "eu").await.unwrap(), Outcome::Processed("eu/34".into()));
    assert_eq!(h.borrowed(&msg, "eu").await.unwrap(), Outcome::Duplicate);
    assert_eq!(h.borrowed(&msg, "us").await.unwrap(), Outcome::Processed("us/34".into()));
    assert_eq!(h.by_value(order(34, Act::Succeed)).await.unwrap(), Outcome::Processed(134));
    assert_eq!(h.by_value(order(34, Act::Succeed)).await.unwrap(), Outcome::Duplicate);
    let key = Key::new("at.by_value", "34").unwrap();
    assert_eq!(record(&w.store, &key).await, Some((State::Done, 1)));
}

/// Generic methods and `impl Trait` arguments (callable statically; such traits are
/// not object safe).
#[async_trait]
trait GenericMethods: Send + Sync {
    async fn labelled<M: fmt::Display + Send + Sync>(
        &self,
        msg: &M,
    ) -> Result<Outcome<String>, Error<PayError>>;
    async fn shown(
        &self,
        msg: impl fmt::Display + Send + 'async_trait,
    ) -> Result<Outcome<()>, Error<PayError>>;
}

#[async_trait]
impl GenericMethods for Worker {
    #[idempotent(key = "{msg}", store = self.store, namespace = "at.generic_method")]
    async fn labelled<M: fmt::Display + Send + Sync>(&self, msg: &M) -> Result<String, PayError> {
        Ok(msg.to_string())
    }

    #[idempotent(key = "{msg}", store = self.store, namespace = "at.impl_arg")]
    async fn shown(&self, msg: impl fmt::Display + Send + 'async_trait) -> Result<(), PayError> {
        let _ = msg.to_string();
        let _running = self.counters.enter();
        Ok(())
    }
}

#[tokio::test]
async fn generic_methods_and_impl_arguments() {
    let w = worker();
    assert_eq!(w.labelled(&7u8).await.unwrap(), Outcome::Processed("7".into()));
    assert_eq!(w.labelled(&"7").await.unwrap(), Outcome::Duplicate);
    assert_eq!(w.shown(3.5f64).await.unwrap(), Outcome::Processed(()));
    assert_eq!(w.shown("3.5").await.unwrap(), Outcome::Duplicate);
    assert_eq!(w.counters.runs(), 1);
}

/// `#[async_trait(?Send)]`: a body holding an `Rc` across an await.
#[async_trait(?Send)]
trait LocalHandler {
    async fn handle(&self, msg: &Order) -> Result<Outcome<usize>, Error<PayError>>;
}

struct Local {
    store: MemoryStore,
    counters: Counters,
}

#[async_trait(?Send)]
impl LocalHandler for Local {
    #[idempotent(key = "{order_id}", lease = 2, store = self.store, namespace = "at.local")]
    async fn handle(&self, msg: &Order) -> Result<usize, PayError> {
        let _running = self.counters.enter();
        let shared = std::rc::Rc::new(msg.order_id);
        if let Act::Sleep(d) = &msg.act {
            tokio::time::sleep(*d).await;
        }
        Ok(std::rc::Rc::strong_count(&shared) + *shared as usize)
    }
}

#[tokio::test(start_paused = true)]
async fn not_send_handlers() {
    let l = std::rc::Rc::new(Local { store: MemoryStore::new(), counters: Counters::default() });
    let h: std::rc::Rc<dyn LocalHandler> = l.clone();
    let local = tokio::task::LocalSet::new();
    local
        .run_until(async {
            let first = tokio::task::spawn_local({
                let h = h.clone();
                async move { h.handle(&order(35, Act::Sleep(Duration::from_secs(7)))).await }
            });
            tokio::time::sleep(Duration::from_secs(5)).await;
            let dup = h.handle(&order(35, Act::Succeed)).await.unwrap();
            assert!(matches!(dup, Outcome::InProgress { .. }), "renewed: {dup:?}");
            assert_eq!(first.await.unwrap().unwrap(), Outcome::Processed(36));
        })
        .await;
    assert_eq!(l.counters.runs(), 1);
}

// ---------------------------------------------------------------------------------
// 5. Concurrency
// ---------------------------------------------------------------------------------

/// Fifty concurrent deliveries of one message through `Arc<dyn Handler>`: the body
/// runs once, never beside itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_concurrent_deliveries_run_the_body_once() {
    for round in 0..20u64 {
        let w = worker();
        let h: Arc<dyn Handler> = w.clone();
        let gate = Arc::new(tokio::sync::Barrier::new(50));
        let tasks: Vec<_> = (0..50)
            .map(|_| {
                let (h, gate) = (h.clone(), gate.clone());
                tokio::spawn(async move {
                    gate.wait().await;
                    h.handle(&order(40 + round, Act::Sleep(Duration::from_millis(5)))).await
                })
            })
            .collect();
        let mut processed = 0;
        for task in tasks {
            match task.await.unwrap().unwrap() {
                Outcome::Processed(_) => processed += 1,
                Outcome::InProgress { .. } | Outcome::Duplicate => {}
                other => panic!("{other:?}"),
            }
        }
        assert_eq!((processed, w.counters.runs(), w.counters.max_active()), (1, 1, 1));
    }
}

/// Fifty concurrent deliveries that each fail with a retryable error: no two bodies
/// overlap, and every attempt is accounted for.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_retryable_failures_never_overlap() {
    let w = worker();
    let h: Arc<dyn Handler> = w.clone();
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let h = h.clone();
            tokio::spawn(async move { h.handle(&order(90, Act::Retry)).await })
        })
        .collect();
    let mut retryable = 0;
    let mut terminal = 0;
    for task in tasks {
        match task.await.unwrap() {
            Err(Error::Retryable { .. }) => retryable += 1,
            Err(Error::Terminal { exhausted: true, .. }) => terminal += 1,
            Ok(Outcome::InProgress { .. }) | Err(Error::PreviouslyFailed { .. }) => {}
            other => panic!("{other:?}"),
        }
    }
    assert!(retryable <= 2 && terminal <= 1, "{retryable} retryable, {terminal} terminal");
    assert_eq!(w.counters.runs(), retryable + terminal);
    assert_eq!(w.counters.max_active(), 1);
}

// ---------------------------------------------------------------------------------
// 6. Panics
// ---------------------------------------------------------------------------------

/// A panicking body is an error, the key is released, and the next delivery runs it.
#[tokio::test]
async fn a_panicking_body_releases_the_key() {
    let w = worker();
    let h: Arc<dyn Handler> = w.clone();
    let err = h.handle(&order(50, Act::Panic)).await.unwrap_err();
    match &err {
        Error::Panicked { message, attempt: 1, exhausted: false, .. } => {
            assert!(message.contains("handler exploded on order 50"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(err.disposition(), idempotent::Disposition::Retry);
    assert_eq!(w.counters.max_active(), 1);
    assert_eq!(w.counters.active.load(SeqCst), 0, "the body's locals were dropped");
    assert_eq!(record(&w.store, &handle_key(50, "t")).await, Some((State::Released, 1)));
    assert_eq!(h.handle(&order(50, Act::Succeed)).await.unwrap(), Outcome::Processed(50));
    assert_eq!(record(&w.store, &handle_key(50, "t")).await, Some((State::Done, 2)));
}

/// Panicking on every attempt: the last one (`max_attempts = 3`) is FAILED for good.
#[tokio::test]
async fn a_body_panicking_on_every_attempt_is_failed_on_the_last() {
    let w = worker();
    let h: Arc<dyn Handler> = w.clone();
    for attempt in 1..=2 {
        let err = h.handle(&order(51, Act::Panic)).await.unwrap_err();
        assert!(
            matches!(err, Error::Panicked { attempt: a, exhausted: false, .. } if a == attempt)
        );
    }
    let err = h.handle(&order(51, Act::Panic)).await.unwrap_err();
    assert!(matches!(err, Error::Panicked { attempt: 3, exhausted: true, .. }), "{err:?}");
    assert_eq!(err.disposition(), idempotent::Disposition::DeadLetter);
    let err = h.handle(&order(51, Act::Succeed)).await.unwrap_err();
    assert!(matches!(err, Error::PreviouslyFailed { attempts: 3 }), "{err:?}");
    assert_eq!(w.counters.runs(), 3);
}

/// A panic through a spawned trait-object call on a multi-thread runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_a_spawned_call_is_an_error_not_a_task_panic() {
    let w = worker();
    let h: Arc<dyn Handler> = w.clone();
    let task = tokio::spawn({
        let h = h.clone();
        async move { h.handle(&order(52, Act::Panic)).await }
    });
    let result = task.await.expect("the panic is caught inside the call");
    assert!(matches!(result, Err(Error::Panicked { .. })), "{result:?}");
    assert_eq!(h.handle(&order(52, Act::Succeed)).await.unwrap(), Outcome::Processed(52));
}

// ---------------------------------------------------------------------------------
// 7. The body's control flow, names and the key's sources
// ---------------------------------------------------------------------------------

/// `return Err` (retryable and terminal), `return Ok` early, and `?` through `From`.
#[tokio::test]
async fn returns_and_question_marks_in_the_body() {
    let w = worker();
    let h: Arc<dyn Handler> = w.clone();

    let err = h.handle(&order(60, Act::Retry)).await.unwrap_err();
    assert!(matches!(err, Error::Retryable { error: PayError::Timeout, attempt: 1, .. }));
    assert_eq!(record(&w.store, &handle_key(60, "t")).await, Some((State::Released, 1)));

    let err = h.handle(&order(61, Act::Decline)).await.unwrap_err();
    assert!(matches!(err, Error::Terminal { error: PayError::Declined, exhausted: false, .. }));
    assert_eq!(record(&w.store, &handle_key(61, "t")).await, Some((State::Failed, 1)));

    assert_eq!(h.handle(&order(62, Act::EarlyOk)).await.unwrap(), Outcome::Processed(0));
    assert_eq!(record(&w.store, &handle_key(62, "t")).await, Some((State::Done, 1)));
    assert_eq!(h.handle(&order(62, Act::Succeed)).await.unwrap(), Outcome::Duplicate);

    let err = h.handle(&order(63, Act::Parse("x".into()))).await.unwrap_err();
    assert!(matches!(err, Error::Terminal { error: PayError::BadAmount(_), .. }), "{err:?}");
    assert_eq!(record(&w.store, &handle_key(63, "t")).await, Some((State::Failed, 1)));
    assert_eq!(
        h.handle(&order(64, Act::Parse("42".into()))).await.unwrap(),
        Outcome::Processed(42)
    );

    // A retryable error exhausts on the third attempt (`max_attempts = 3`).
    let err = h.handle(&order(60, Act::Retry)).await.unwrap_err();
    assert!(matches!(err, Error::Retryable { attempt: 2, .. }));
    let err = h.handle(&order(60, Act::Retry)).await.unwrap_err();
    assert!(matches!(err, Error::Terminal { attempt: 3, exhausted: true, .. }), "{err:?}");
    // Nothing marked DONE that did not succeed.
    assert_eq!(record(&w.store, &handle_key(60, "t")).await, Some((State::Failed, 3)));
}

#[async_trait]
trait Names: Send + Sync {
    async fn shadowed(&self, order_id: u64, msg: &Order) -> Result<Outcome<u64>, Error<PayError>>;
    async fn self_underscore(
        &self,
        self_: &str,
        msg: &Order,
    ) -> Result<Outcome<String>, Error<PayError>>;
    async fn current_call(&self, msg: &Order) -> Result<Outcome<(String, u32)>, Error<PayError>>;
    async fn ignored(&self, _: u64, msg: Order) -> Result<Outcome<u64>, Error<PayError>>;
}

#[async_trait]
impl Names for Worker {
    /// `order_id` is both an argument and a message field: the argument wins. The
    /// body shadows both names; the key was rendered before.
    #[idempotent(key = "{order_id}", message = msg, store = self.store, namespace = "at.shadow")]
    async fn shadowed(&self, order_id: u64, msg: &Order) -> Result<u64, PayError> {
        let _running = self.counters.enter();
        let order_id = order_id * 1000;
        let msg = Order { order_id: 5, ..msg.clone() };
        Ok(order_id + msg.order_id)
    }

    /// An argument named `self_` next to `{self.field}`.
    #[idempotent(key = "{self.tenant}:{self_}:{order_id}", message = msg, store = self.store, namespace = "at.self_")]
    async fn self_underscore(&self, self_: &str, msg: &Order) -> Result<String, PayError> {
        Ok(format!("{}/{self_}/{}", self.tenant, msg.order_id))
    }

    /// What the body sees of its call.
    #[idempotent(key = "{order_id}", lease = 2, store = self.store, namespace = "at.current")]
    async fn current_call(&self, msg: &Order) -> Result<(String, u32), PayError> {
        if let Act::Sleep(d) = &msg.act {
            tokio::time::sleep(*d).await;
        }
        let now = idempotent::current().expect("inside the handler");
        Ok((now.key.to_string(), now.attempt))
    }

    /// A wildcard argument before the message.
    #[idempotent(key = "{order_id}", message = msg, store = self.store, namespace = "at.ignored")]
    async fn ignored(&self, _: u64, msg: Order) -> Result<u64, PayError> {
        Ok(msg.order_id)
    }
}

#[tokio::test(start_paused = true)]
async fn names_arguments_and_the_current_call() {
    let w = worker();
    let h: Arc<dyn Names> = w.clone();
    assert_eq!(h.shadowed(7, &order(70, Act::Succeed)).await.unwrap(), Outcome::Processed(7005));
    assert_eq!(h.shadowed(7, &order(71, Act::Succeed)).await.unwrap(), Outcome::Duplicate);
    let key = Key::new("at.shadow", "7").unwrap();
    assert_eq!(record(&w.store, &key).await, Some((State::Done, 1)), "keyed by the argument");

    let out = h.self_underscore("s", &order(72, Act::Succeed)).await.unwrap();
    assert_eq!(out, Outcome::Processed("acme/s/72".into()));
    let key = Key::new("at.self_", "acme:s:72").unwrap();
    assert_eq!(record(&w.store, &key).await, Some((State::Done, 1)));

    let cut = tokio::time::timeout(
        Duration::from_millis(10),
        h.current_call(&order(73, Act::Sleep(Duration::from_secs(1)))),
    )
    .await;
    assert!(cut.is_err());
    let seen = h.current_call(&order(73, Act::Succeed)).await.unwrap();
    assert_eq!(seen, Outcome::Processed(("at.current:73".into(), 2)));

    assert_eq!(h.ignored(1, order(74, Act::Succeed)).await.unwrap(), Outcome::Processed(74));
    assert_eq!(h.ignored(2, order(74, Act::Succeed)).await.unwrap(), Outcome::Duplicate);
}

/// With `#[tracing::instrument]` beside `#[idempotent]`, in either order.
#[async_trait]
trait Traced: Send + Sync {
    async fn inner(&self, msg: &Order) -> Result<Outcome<u64>, Error<PayError>>;
    async fn outer(&self, msg: &Order) -> Result<Outcome<u64>, Error<PayError>>;
}

#[async_trait]
impl Traced for Worker {
    #[idempotent(key = "{order_id}", store = self.store, namespace = "at.traced_inner")]
    #[tracing::instrument(skip_all)]
    async fn inner(&self, msg: &Order) -> Result<u64, PayError> {
        let _running = self.counters.enter();
        Ok(msg.order_id)
    }

    #[tracing::instrument(skip_all)]
    #[idempotent(key = "{order_id}", store = self.store, namespace = "at.traced_outer")]
    async fn outer(&self, msg: &Order) -> Result<u64, PayError> {
        let _running = self.counters.enter();
        Ok(msg.order_id)
    }
}

#[tokio::test]
async fn instrumented_methods() {
    let w = worker();
    let h: Arc<dyn Traced> = w.clone();
    assert_eq!(h.inner(&order(80, Act::Succeed)).await.unwrap(), Outcome::Processed(80));
    assert_eq!(h.inner(&order(80, Act::Succeed)).await.unwrap(), Outcome::Duplicate);
    assert_eq!(h.outer(&order(80, Act::Succeed)).await.unwrap(), Outcome::Processed(80));
    assert_eq!(h.outer(&order(80, Act::Succeed)).await.unwrap(), Outcome::Duplicate);
    assert_eq!(w.counters.runs(), 2);
}

/// An `#[idempotent]` default method in an `#[async_trait]` trait: every implementor
/// shares it.
#[async_trait]
trait Defaulted: Send + Sync {
    fn tenant(&self) -> &str;

    #[idempotent(key = "{order_id}", store = SHARED, namespace = "at.defaulted")]
    async fn handle(&self, msg: &Order) -> Result<u64, PayError> {
        Ok(msg.order_id + self.tenant().len() as u64)
    }
}

impl Defaulted for Owned {
    fn tenant(&self) -> &str {
        &self.tenant
    }
}

#[tokio::test]
async fn default_methods_in_the_trait() {
    let h: Arc<dyn Defaulted> = Arc::new(owned("four"));
    assert_eq!(h.handle(&order(81, Act::Succeed)).await.unwrap(), Outcome::Processed(85));
    assert_eq!(h.handle(&order(81, Act::Succeed)).await.unwrap(), Outcome::Duplicate);
}

/// JSON pointers, `validate`, `cache`, `key_fn`, `classify`, `on_terminal`, an
/// `io::Result` and a `&mut` message, through `#[async_trait]`.
#[async_trait]
trait Options: Send + Sync {
    async fn by_pointer(&self, msg: Vec<u8>) -> Result<Outcome<u64>, Error<PayError>>;
    async fn by_key_fn(&self, msg: &mut Order) -> Result<Outcome<u64>, Error<std::io::Error>>;
    async fn hooked(&self, msg: &Order) -> Result<Outcome<()>, Error<PayError>>;
}

static HOOKED: AtomicU32 = AtomicU32::new(0);

async fn count_alert(event: idempotent::TerminalEvent) {
    assert_eq!(event.namespace, "at.hooked");
    HOOKED.fetch_add(1, SeqCst);
}

fn always_terminal(_: &PayError) -> idempotent::ErrorClass {
    idempotent::ErrorClass::Terminal
}

impl Worker {
    fn order_key(msg: &Order) -> String {
        format!("k{}", msg.order_id)
    }
}

#[async_trait]
impl Options for Worker {
    #[idempotent(
        key = "{/order/id}",
        validate = true,
        cache = true,
        store = self.store,
        namespace = "at.pointer"
    )]
    async fn by_pointer(&self, msg: Vec<u8>) -> Result<u64, PayError> {
        let _running = self.counters.enter();
        tokio::task::yield_now().await;
        Ok(msg.len() as u64)
    }

    #[idempotent(key_fn = Self::order_key, store = self.store, namespace = "at.key_fn")]
    async fn by_key_fn(&self, msg: &mut Order) -> std::io::Result<u64> {
        msg.order_id += 1;
        if msg.tag == "bad" {
            return Err(std::io::Error::from(std::io::ErrorKind::InvalidData));
        }
        Ok(msg.order_id)
    }

    #[idempotent(
        key = "{order_id}",
        classify = always_terminal,
        on_terminal = count_alert,
        store = self.store,
        namespace = "at.hooked"
    )]
    async fn hooked(&self, msg: &Order) -> Result<(), PayError> {
        let _ = msg;
        Err(PayError::Timeout)
    }
}

#[tokio::test]
async fn pointers_validate_cache_key_fn_and_hooks() {
    let w = worker();
    let h: Arc<dyn Options> = w.clone();
    let body = br#"{"order": {"id": 7}, "n": 1}"#.to_vec();
    let len = body.len() as u64;
    assert_eq!(h.by_pointer(body.clone()).await.unwrap(), Outcome::Processed(len));
    assert_eq!(h.by_pointer(body).await.unwrap(), Outcome::Replayed(len));
    let other = br#"{"order": {"id": 7}, "n": 2}"#.to_vec();
    assert!(matches!(h.by_pointer(other).await, Err(Error::PayloadMismatch)));
    let err = h.by_pointer(b"\xff not json".to_vec()).await.unwrap_err();
    assert!(matches!(err, Error::Key(KeyError::NotJson { .. })), "{err:?}");
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000)).into_bytes();
    let err = h.by_pointer(deep).await.unwrap_err();
    assert!(matches!(err, Error::Key(_)), "{err:?}");
    let huge = format!(r#"{{"order": {{"id": "{}"}}}}"#, "9".repeat(1 << 20)).into_bytes();
    let err = h.by_pointer(huge).await.unwrap_err();
    assert!(matches!(err, Error::Key(KeyError::TooLong { .. })), "{err:?}");
    assert_eq!(w.counters.runs(), 1);

    let mut msg = order(90, Act::Succeed);
    assert_eq!(h.by_key_fn(&mut msg).await.unwrap(), Outcome::Processed(91));
    assert_eq!(msg.order_id, 91, "the body changed the borrowed message");
    let mut again = order(90, Act::Succeed);
    assert_eq!(h.by_key_fn(&mut again).await.unwrap(), Outcome::Duplicate);
    assert_eq!(again.order_id, 90);
    let mut bad = Order { tag: "bad".into(), ..order(92, Act::Succeed) };
    let err = h.by_key_fn(&mut bad).await.unwrap_err();
    assert!(err.is_terminal(), "InvalidData is terminal: {err:?}");
    let key = Key::new("at.key_fn", "k92").unwrap();
    assert_eq!(record(&w.store, &key).await, Some((State::Failed, 1)));

    let err = h.hooked(&order(93, Act::Succeed)).await.unwrap_err();
    assert!(matches!(err, Error::Terminal { attempt: 1, exhausted: false, .. }), "{err:?}");
    assert_eq!(HOOKED.load(SeqCst), 1);
}
