//! Make message consumers safe under at-least-once delivery.
//!
//! Brokers redeliver: after a restart, a rebalance or a lost ack, the same message
//! comes again, and a handler that is not idempotent charges twice. `#[idempotent]`
//! makes an `async fn` handler's effect happen once per key, and tells the consumer
//! whether to ack, retry or dead-letter each delivery.
//!
//! A call renders the key from the message, claims it in a [`Store`] (one round
//! trip), runs the body only if the claim was won (renewing the claim's lease while it
//! runs), then records the result: DONE, released for a retry, or FAILED for good with
//! an alert. The key is marked done only *after* the body succeeded, so a consumer
//! that crashes mid-handler never loses the message.
//!
//! # Quickstart
//!
//! ```
//! use idempotent::{Classify, Disposition, DispositionExt, MemoryStore, Outcome, idempotent};
//!
//! struct OrderPlaced { order_id: u64, amount_cents: i64 }
//!
//! #[derive(Debug, thiserror::Error, Classify)]
//! enum PayError {
//!     #[error("database timed out")]
//!     #[idempotent(retryable)]
//!     DbTimeout,
//!     #[error("insufficient funds")]
//!     #[idempotent(terminal)]
//!     InsufficientFunds,
//! }
//!
//! #[idempotent(key = "order:{order_id}", ttl = "24h", store = STORE)]
//! async fn charge(msg: OrderPlaced) -> Result<u64, PayError> {
//!     if msg.amount_cents < 0 { return Err(PayError::InsufficientFunds) }
//!     Ok(msg.order_id) // charge the customer here
//! }
//!
//! static STORE: std::sync::LazyLock<MemoryStore> = std::sync::LazyLock::new(MemoryStore::new);
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let first = charge(OrderPlaced { order_id: 7, amount_cents: 500 }).await;
//! assert_eq!(first.as_ref().unwrap(), &Outcome::Processed(7));
//! let again = charge(OrderPlaced { order_id: 7, amount_cents: 500 }).await;
//! assert_eq!(again.as_ref().unwrap(), &Outcome::Duplicate);
//! assert_eq!(again.disposition(), Disposition::Ack);
//! let refused = charge(OrderPlaced { order_id: 8, amount_cents: -1 }).await;
//! assert_eq!(refused.disposition(), Disposition::DeadLetter);
//! # }
//! ```
//!
//! The repository's `examples/quickstart.rs` (`cargo run --example quickstart`) runs
//! a simulated broker with duplicates, a crash mid-handler, a retry and a terminal
//! error through one handler.
//!
//! The rewritten function returns `Result<Outcome<T>, idempotent::Error<E>>` where the
//! handler returned `Result<T, E>` (or `Result<Outcome<T>, Error<Infallible>>` where it
//! returned a plain `T`). The return type must be spelled `Result<T, E>` or a
//! one-argument alias such as `io::Result<T>`; any other type is a value of an
//! infallible handler, and a `Result` under another name (`type PayResult<T> =
//! Result<T, PayError>`) is refused at compile time rather than have its `Err`
//! recorded as a success. `E` must implement [`Classify`](trait@Classify) (or pass
//! `classify = path`) and `Display` (alerts carry the rendered error).
//! [`DispositionExt::disposition`] on that result says whether to ack, retry or
//! dead-letter the delivery; [`Outcome`] and [`Error`] say what happened.
//!
//! Handlers must be called on a Tokio runtime with its timer enabled (the lease is
//! renewed by a timer); elsewhere the call claims nothing, runs nothing and returns
//! [`Error::Runtime`].
//!
//! # Keys
//!
//! `key = "order:{order_id}"` names what identifies a message. Placeholders read a
//! field path of the message (`{order.id}`, checked at compile time), another
//! argument (`{tenant}`), the receiver (`{self.region}`), or a JSON pointer into the
//! message's [`Payload`] (`{/order/id}`, read at run time). Records are kept per
//! `namespace` (by default the function's name), so `order:7` of two handlers are two
//! keys.
//!
//! Distinct values always render distinct keys, whatever a producer puts in a field.
//! A value is written as it is unless another placeholder follows it; then `%` and
//! the first character of the separator between the two are percent-encoded in it
//! (`%25`, `%3A`). With `key = "{from}:{to}"`, `("a:b", "c")` renders `a%3Ab:c` and
//! `("a", "b:c")` renders `a:b:c`. Plain ids, numbers and UUIDs render unchanged. So
//! that this holds, two placeholders need a separator that does not start with `%`,
//! a digit or `A`–`F`; the macro checks it. `key_fn = path` returns the whole id, used
//! as it is: a function that joins several values must keep them apart itself. See
//! [`KeyBuilder`] for the rule and [`MAX_KEY_LEN`] for the length limit.
//!
//! # Arguments
//!
//! | argument | meaning |
//! | --- | --- |
//! | `key = "order:{order_id}"` | Required unless `key_fn`. `{field}` / `{a.b.c}` read a field path of the message argument (checked at compile time, rendered with `Display`); `{arg}` / `{arg.field}` read another argument, `{self.field}` the receiver (a name that is an argument wins over a message field); `{/order/id}` is an RFC 6901 pointer into the message's JSON [`Payload`] (read once per call; strings as they are, numbers as their exact decimal value so `1`, `1.0` and `1e0` agree and no digit beyond 64 bits is lost, see [`KeyBuilder::pointer`]; missing, `null`, `""`, booleans, objects and arrays are key errors); `{{` and `}}` are literal braces. A placeholder that renders empty is an [`Error::Key`]. |
//! | `key_fn = path` | `fn(&Message) -> impl Display`, replacing the template. |
//! | `ttl = 600` | Dedupe window after completion: seconds, or a string with units (`"500ms"`, `"10m"`, `"24h"`, `"1h30m"`; units `ms s m h d`). Default 24 hours. |
//! | `lease = 30` | How long a claim holds without renewal (renewed every third of it while the body runs). Same units. Default 30 s, or the ttl if shorter. Must be ≤ `ttl`. |
//! | `max_attempts = 5` | Attempts before a retryable error is treated as terminal. Default 5. Attempts that never finished (crash, panic, cancellation) count. |
//! | `backoff = "1s..5m"` | How long a retry waits: `"base..cap"` is exponential (after attempt n, a random time in [d/2, d], d = min(cap, base·2^(n−1))), `"2s"` fixed (jittered the same way). Default `"1s..5m"` ([`Backoff::DEFAULT`]). A retry's result carries it: [`DispositionExt::retry_delay`]; every consumer loop honours it. |
//! | `namespace = "payments"` | Key prefix; default the function's name. Handlers sharing a namespace share records. Required on methods, whose names (`handle`) repeat. No `:`. |
//! | `store = expr` | The [`Store`], or anything that dereferences to one (`Arc<S>`, `&S`, a `LazyLock`); may use the arguments, e.g. `store = self.store`. Default: the process-wide store from [`set_default_store`]; with none set, calls fail with [`StoreError::NotConfigured`]. |
//! | `message = ident` | Which argument is the message. Default: the first argument after `self`. |
//! | `on_terminal = path` | `async fn(TerminalEvent)` called on terminal failures instead of the process-wide [`AlertSink`] (default: a `tracing` error event). |
//! | `classify = path` | `fn(&E) -> ErrorClass`, used instead of `E: Classify`. |
//! | `crate = path` | Where this crate is, for crates that re-export it. |
//! | `validate = true` | Store a SHA-256 [`Fingerprint`] of the message's [`Payload`] with the claim; the same key with another payload is [`Error::PayloadMismatch`] and runs nothing. |
//! | `cache = true` | Store the `Ok` value (serde JSON, at most 64 KiB) and return it to duplicates as [`Outcome::Replayed`]; a value that can't be stored (too large, not serializable, or JSON that would not read back as itself, like a NaN anywhere in it) is recorded DONE and returned as [`Outcome::ProcessedNotCached`], and its duplicates are plain [`Outcome::Duplicate`]s; a stored value that no longer reads back as `T` is [`Error::Cache`] (ack). `cache` alone means `cache = true`. |
//!
//! Mistakes are compile errors pointing at the argument: unknown or repeated
//! arguments, `ttl = 0`, `lease` > `ttl`, a template without placeholders, a field the
//! message does not have.
//!
//! # Choosing a store
//!
//! | store | feature | use it for |
//! | --- | --- | --- |
//! | [`MemoryStore`] | (none) | tests, the quickstart, a single consumer process whose duplicates all reach it |
//! | `RedisStore` | `redis` (`redis-tls` for `rediss://`) | consumers on several machines; standalone Redis or Redis Cluster; a claim is one `SET NX GET` (plus a script when it finds another claim in progress), the other transitions one atomic script each |
//! | `PostgresStore` | `postgres` | records beside the business data: with `transactional`, the handler's writes and DONE commit in one transaction (an exactly-once effect) |
//! | `MysqlStore` | `mysql` | the same on MySQL 8 or MariaDB 10.6+, `transactional` included; a claim is one `INSERT ... ON DUPLICATE KEY UPDATE` |
//! | `ZooKeeperStore` | `zookeeper` | consumers that already run beside a ZooKeeper ensemble (3.5+, TTL nodes on): records are TTL znodes, a claim is tied to the consumer's session as well as its lease, so a dead consumer's keys are taken over after the session timeout; thousands of messages per second, not tens of thousands |
//! | [`NoStore`] | (none) | handlers guarded by the business state itself (a state machine, a unique constraint, a version column; `idempotent::guard` has both for PostgreSQL and MySQL): keeps nothing, every call runs, the attempt is the broker's delivery count |
//! | your own | (none) | implement [`Store`] and run the behaviour suite (`store_suite!`, feature `testing`) |
//!
//! Name the store per handler with `store = expr` (any expression, which may use the
//! arguments: `store = self.store`), or once per process:
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! idempotent::set_default_store(idempotent::MemoryStore::new()).unwrap();
//! # }
//! ```
//!
//! Without either, calls fail with [`StoreError::NotConfigured`]: there is never a
//! silent in-memory fallback.
//!
//! # Wiring a broker
//!
//! A handler's result says what to tell the broker. The loops in `consume` (one
//! feature each) read deliveries, call the handler and settle each by its
//! [`Disposition`]; the handler's future resolves only after the record is written,
//! so nothing is acked before it:
//!
//! | broker | feature | loop |
//! | --- | --- | --- |
//! | Redis Streams | `redis-streams` | `consume::redis_streams::StreamConsumer` |
//! | RabbitMQ (lapin) | `rabbitmq` | `consume::rabbitmq::RabbitConsumer` |
//! | NATS JetStream (async-nats) | `nats` | `consume::nats::NatsConsumer` |
//! | Kafka (rdkafka) | `kafka` | `consume::kafka::KafkaConsumer` |
//! | RocketMQ (rocketmq-client-rust) | `rocketmq` | `consume::rocketmq::RocketMqConsumer` |
//!
//! The messages they hand over implement [`Payload`], so `{/json/pointer}` keys read
//! their bodies. With any other client, settle by hand:
//!
//! ```
//! use idempotent::{Disposition, DispositionExt, Error, Outcome};
//!
//! # enum Broker { Ack, Requeue, DeadLetter }
//! fn settle(result: &Result<Outcome<()>, Error<std::io::Error>>) -> Broker {
//!     match result.disposition() {
//!         Disposition::Ack => Broker::Ack,
//!         Disposition::Retry => Broker::Requeue,
//!         Disposition::DeadLetter => Broker::DeadLetter,
//!     }
//! }
//! ```
//!
//! Each loop's documentation has its example; the repository's
//! `integration/examples/` has a runnable program per broker.
//!
//! # Record life cycle
//!
//! | event | record afterwards | returned | broker should |
//! | --- | --- | --- | --- |
//! | first delivery, success | DONE, kept for `ttl` | `Ok(Processed(v))` | ack |
//! | same key again within ttl | unchanged | `Ok(Duplicate)` | ack |
//! | same key while another consumer runs it | unchanged | `Ok(InProgress { retry_after })` | redeliver after `retry_after` (the other claim's lease left) |
//! | retryable error | released, attempt count kept | `Err(Retryable { retry_after, .. })` | redeliver after `retry_after` (the `backoff`) |
//! | retryable error on attempt `max_attempts` | FAILED, kept for ttl, alert | `Err(Terminal { exhausted: true })` | dead-letter |
//! | terminal error | FAILED, kept for ttl, alert | `Err(Terminal)` | dead-letter |
//! | same key after FAILED, within ttl | unchanged | `Err(PreviouslyFailed)` | dead-letter |
//! | handler panics | released | `Err(Panicked)` | redeliver |
//! | handler panics on attempt `max_attempts` | FAILED, kept for ttl, alert | `Err(Panicked { exhausted: true })` | dead-letter |
//! | caller drops the future mid-way | released (best effort), else lease expiry | — | redeliver |
//! | process dies mid-handler | claim expires after `lease` | — | redelivery is processed |
//! | claim won after `max_attempts` unfinished attempts | FAILED, alert | `Err(Abandoned)` | dead-letter |
//! | store unreachable at claim | unchanged, handler not run | `Err(Store { handler_ran: false })` | redeliver |
//! | a bounded `MemoryStore` is full of unexpired records (new key) | unchanged, handler not run | `Err(Store { error: StoreError::Full, .. })` | redeliver |
//! | called outside a Tokio runtime, or on one without its timer | unchanged, handler not run | `Err(Runtime)` | redeliver (on a correctly built runtime) |
//! | store refuses the record for good (`StoreError::Rejected`: a foreign or unreadable record, a value the database can't hold) | unchanged | `Err(Store { .. })` | dead-letter |
//! | the record was written by a newer version of the library (`StoreError::NewerFormat`) | unchanged, handler not run | `Err(Store { .. })` | redeliver (until a newer consumer takes it) |
//!
//! Every transition after the claim carries the claim's random [`Token`]; a consumer
//! whose lease ran out can never complete, release or fail the claim of the consumer
//! that took over (it gets [`Error::LeaseLost`], sends no alert, and, when a renewal
//! finds the claim taken while the body runs, the body is stopped at its next await
//! as a crash would stop it, rather than left to run beside the new owner's). A call
//! left unpolled for longer than its lease (a starved task, a stopped process) goes
//! on only once the renewal that was due says the claim is still its own.
//!
//! # Seeing what it does
//!
//! Every call runs in a `tracing` span `idempotent` (a child of the caller's) with its
//! namespace, key, attempt, outcome and disposition, the alert inside it; [`trace`]
//! has the details and [`trace::set_key_logging`] hashes keys that hold personal
//! data. Inside a handler body, [`current()`] answers the key, attempt and claim
//! token.
//!
//! # What `#[idempotent]` expands to
//!
//! The quickstart's handler (`examples/quickstart.rs`):
//!
//! ```ignore
//! #[idempotent(key = "order:{order_id}", ttl = "10m", lease = "5s", max_attempts = 3)]
//! async fn charge(msg: OrderPlaced) -> Result<u64, PayError> {
//!     let start = {
//!         let mut starts = STARTS.lock().unwrap();
//!         let n = starts.entry(msg.order_id).or_default();
//!         *n += 1;
//!         *n
//!     };
//!     match (msg.order_id, start) {
//!         (3, 1) => return Err(PayError::DbTimeout), // flaky once, then fine
//!         (4, 1) => tokio::time::sleep(Duration::from_secs(60)).await, // the consumer dies here
//!         (6, _) => return Err(PayError::DbTimeout), // down for good
//!         _ => {}
//!     }
//!     if msg.amount_cents > 10_000 {
//!         return Err(PayError::InsufficientFunds);
//!     }
//!     *CHARGES.lock().unwrap().entry(msg.order_id).or_default() += 1;
//!     Ok(msg.order_id)
//! }
//! ```
//!
//! becomes (the repository's `macro-tests/tests/expand/quickstart.expanded.rs`, which a
//! test keeps equal to what the macro writes and to this page):
//!
//! ```ignore
//! async fn charge(
//!     msg: OrderPlaced,
//! ) -> ::core::result::Result<::idempotent::Outcome<u64>, ::idempotent::Error<PayError>> {
//!     #[allow(clippy::needless_borrow)]
//!     let __idempotent_key = {
//!         #[allow(unused_imports)]
//!         use ::idempotent::__private::{DisplayField as _, UncheckedField as _};
//!         if false {
//!             let (order_id,) = (&msg.order_id,);
//!             ::idempotent::__private::check_display(format_args!("order:{0}", order_id));
//!         }
//!         let mut __idempotent_key = ::idempotent::__private::KeyBuilder::new("charge");
//!         __idempotent_key.text("order:");
//!         (&::idempotent::__private::Shown(&msg.order_id))
//!             .put(&mut __idempotent_key, "order_id");
//!         __idempotent_key.finish()
//!     };
//!     let __idempotent_call = ::idempotent::__private::Call::new(
//!         ::idempotent::__private::Spec::new(
//!             ::core::time::Duration::from_millis(600000u64),
//!             ::core::time::Duration::from_millis(5000u64),
//!             3u32,
//!         ),
//!         __idempotent_key,
//!     );
//!     let __idempotent_store = &::idempotent::__private::DefaultStore;
//!     ::idempotent::__private::run(
//!             __idempotent_call,
//!             __idempotent_store,
//!             ::idempotent::__private::classifier::<PayError>(),
//!             ::idempotent::__private::process_sink,
//!             async {
//!                 #[allow(
//!                     unknown_lints,
//!                     unreachable_code,
//!                     clippy::diverging_sub_expression,
//!                     clippy::let_unit_value,
//!                     clippy::unreachable,
//!                     clippy::empty_loop,
//!                     clippy::needless_return
//!                 )]
//!                 if false {
//!                     let __idempotent_fake_return: Result<u64, PayError> = loop {};
//!                     return __idempotent_fake_return;
//!                 }
//!                 let start = {
//!                     let mut starts = STARTS.lock().unwrap();
//!                     let n = starts.entry(msg.order_id).or_default();
//!                     *n += 1;
//!                     *n
//!                 };
//!                 match (msg.order_id, start) {
//!                     (3, 1) => return Err(PayError::DbTimeout),
//!                     (4, 1) => tokio::time::sleep(Duration::from_secs(60)).await,
//!                     (6, _) => return Err(PayError::DbTimeout),
//!                     _ => {}
//!                 }
//!                 if msg.amount_cents > 10_000 {
//!                     return Err(PayError::InsufficientFunds);
//!                 }
//!                 *CHARGES.lock().unwrap().entry(msg.order_id).or_default() += 1;
//!                 Ok(msg.order_id)
//!             },
//!         )
//!         .await
//! }
//! ```
//!
//! - The key is built by a `KeyBuilder`, one call per piece of the template. The
//!   `if false { .. format_args!("order:{0}", order_id) .. }` block never runs: it hands
//!   the template to `format_args!` so that rustc reports a field without `Display` at
//!   its placeholder inside the string. (Templates with field paths, `{a.b}`, or JSON
//!   pointers skip it, and the key's fields are appended with `key.field(..)`.)
//! - `Call` holds the attribute's settings; the store is the process-wide default here
//!   (`store = ...` names another).
//! - `run` claims the key, runs the body (the `async` block: your code, after a
//!   never-taken `return` typed as the declared return type, which lets rustc infer `?`
//!   conversions and report type errors against your own code), records the result,
//!   and answers the `Outcome` or the `Error`.
//! - With `transactional`, the transaction argument leaves the signature, the body starts
//!   by borrowing it from a `TxSlot`, and the call is `run_transactional`. On an
//!   `#[async_trait]` method the same block sits inside the `Box::pin(async move { .. })`
//!   that `#[async_trait]` wrote.
//!
//! Everything else (claim, lease renewal, recording, alerts) is ordinary code in
//! `idempotent-runtime`. To see any handler's expansion:
//! `cargo install --locked cargo-expand`, then `cargo expand --example quickstart charge`
//! (or `cargo expand path::to::handler` in your crate).
//!
//! # Features and Rust versions
//!
//! The crate without features needs Rust 1.85. The integrations follow the current
//! major of the client you bring (so that you can hand over your own pool, channel or
//! client), and need what that client needs: `postgres` and `mysql` (sqlx 0.9) Rust 1.94, `nats`
//! (async-nats 0.51) 1.89, `rabbitmq` (lapin 4) 1.88; `redis` and `redis-streams`
//! (redis 1.x) work from 1.85, where Cargo's MSRV-aware resolver picks a `redis` 1.x
//! that builds there; `kafka` (rdkafka 0.39, bundled librdkafka) needs a C compiler.
//! Handlers run on Tokio: lease renewal uses Tokio's timer.

#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

/// Makes an `async fn` message handler idempotent; see the [crate documentation](crate)
/// for the arguments.
pub use idempotent_macros::idempotent;

/// Derives [`Classify`](trait@Classify) from `#[idempotent(retryable)]`,
/// `#[idempotent(terminal)]` and `#[idempotent(transparent)]` marks.
///
/// A mark on the enum is the default for unmarked variants; `transparent` on a variant
/// (or struct) with one field asks that field's own `Classify`. A variant without a
/// class is a compile error.
///
/// ```
/// use idempotent::{Classify, ErrorClass};
///
/// #[derive(Debug, Classify)]
/// #[idempotent(terminal)]
/// enum ShipError {
///     #[idempotent(retryable)]
///     CarrierDown,
///     #[idempotent(transparent)]
///     Io(std::io::Error),
///     AddressInvalid,
/// }
///
/// assert_eq!(ShipError::CarrierDown.class(), ErrorClass::Retryable);
/// assert_eq!(ShipError::AddressInvalid.class(), ErrorClass::Terminal);
/// let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
/// assert_eq!(ShipError::Io(refused).class(), ErrorClass::Retryable);
/// ```
pub use idempotent_macros::Classify;

pub use idempotent_runtime::{
    Admin, AlertSink, AlreadySet, Backoff, Capacity, Claim, Classify, Current, DefaultStore,
    Disposition, DispositionExt, Document, Error, ErrorClass, Fingerprint, Key, KeyBuilder,
    KeyError, MAX_KEY_LEN, MAX_STORED_ID_LEN, MemoryStore, NoStore, Outcome, Payload, PayloadRef,
    Store, StoreError, TerminalEvent, Token, Transition, Unusable, alert, async_trait,
    claim_retention, current, default_store, set_alert_sink, set_default_store,
};

pub use idempotent_runtime::{admin, delivery, metrics, trace};

#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub use idempotent_runtime::{store_suite, testing};

/// Re-exported for `Payload` messages and `cache = true` values.
pub use idempotent_runtime::serde_json;

#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use idempotent_runtime::{RedisStore, redis_store};

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use idempotent_runtime::{PostgresStore, postgres_store};

#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub use idempotent_runtime::{MysqlStore, mysql_store};

#[cfg(feature = "zookeeper")]
#[cfg_attr(docsrs, doc(cfg(feature = "zookeeper")))]
pub use idempotent_runtime::{ZooKeeperStore, zookeeper_store};

#[cfg(any(feature = "postgres", feature = "mysql"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "postgres", feature = "mysql"))))]
pub use idempotent_runtime::guard;

#[cfg(any(
    feature = "redis-streams",
    feature = "rabbitmq",
    feature = "nats",
    feature = "kafka",
    feature = "rocketmq"
))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(
        feature = "redis-streams",
        feature = "rabbitmq",
        feature = "nats",
        feature = "kafka",
        feature = "rocketmq"
    )))
)]
pub use idempotent_runtime::{consume, publish};

/// What the `#[idempotent]` expansion calls. Not a public API: it changes without
/// notice, which is why the macro crate is pinned to this exact version.
#[doc(hidden)]
pub mod __private {
    pub use idempotent_runtime::alert::{
        CheckedHook, Hook, UncheckedHook, process_sink, require_hook,
    };
    pub use idempotent_runtime::execute::{Call, HandlerResult, Spec, run, run_infallible};
    pub use idempotent_runtime::key_check::{
        DisplayField, KeyFn, Shown, UncheckedField, check_display,
    };
    pub use idempotent_runtime::result_alias::{AnyValue, ResultValue, ValueType, require_value};
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub use idempotent_runtime::transactional::check::{
        CheckedTxStore, TxStore, UncheckedTxStore, require_transactional,
    };
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub use idempotent_runtime::transactional::{TxSlot, run_transactional};
    pub use idempotent_runtime::{
        AsStore, Backoff, DefaultStore, Document, Fingerprint, KeyBuilder, classifier,
    };
}
