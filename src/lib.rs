//! Make message consumers safe under at-least-once delivery.
//!
//! Brokers redeliver. `#[idempotent]` turns an `async fn` handler into one whose
//! effect happens once per key: it renders the key from the message, claims it in a
//! [`Store`] (one round trip), runs the body only if the claim was won (renewing the
//! claim's lease while it runs), then records the result: DONE, released for a retry,
//! or FAILED for good with an alert.
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
//! # }
//! ```
//!
//! The rewritten function returns `Result<Outcome<T>, idempotent::Error<E>>` where the
//! handler returned `Result<T, E>` (or `Result<Outcome<T>, Error<Infallible>>` where it
//! returned a plain `T`). The return type must be spelled `Result<T, E>` or a
//! one-argument alias such as `io::Result<T>`; any other type is a value of an
//! infallible handler. `E` must implement [`Classify`](trait@Classify) (or pass
//! `classify = path`) and `Display` (alerts carry the rendered error). [`DispositionExt::disposition`] on that result says whether
//! to ack, retry or dead-letter the delivery.
//!
//! # Arguments
//!
//! | argument | meaning |
//! | --- | --- |
//! | `key = "order:{order_id}"` | Required unless `key_fn`. `{field}` / `{a.b.c}` read a field path of the message argument (checked at compile time, rendered with `Display`); `{arg}` / `{arg.field}` read another argument, `{self.field}` the receiver (a name that is an argument wins over a message field); `{/order/id}` is an RFC 6901 pointer into the message's JSON [`Payload`] (parsed once per call; strings as they are, numbers canonically so `1` and `1.0` agree; missing, `null`, `""`, booleans, objects and arrays are key errors); `{{` and `}}` are literal braces. A placeholder that renders empty is an [`Error::Key`]. |
//! | `key_fn = path` | `fn(&Message) -> impl Display`, replacing the template. |
//! | `ttl = 600` | Dedupe window after completion: seconds, or a string with units (`"500ms"`, `"10m"`, `"24h"`, `"1h30m"`; units `ms s m h d`). Default 24 hours. |
//! | `lease = 30` | How long a claim holds without renewal (renewed every third of it while the body runs). Same units. Default 30 s, or the ttl if shorter. Must be ≤ `ttl`. |
//! | `max_attempts = 5` | Attempts before a retryable error is treated as terminal. Default 5. Attempts that never finished (crash, panic, cancellation) count. |
//! | `namespace = "payments"` | Key prefix; default the function's name. Handlers sharing a namespace share records, so give methods with common names (`handle`) their own. No `:`. |
//! | `store = expr` | The [`Store`], or anything that dereferences to one (`Arc<S>`, `&S`, a `LazyLock`); may use the arguments, e.g. `store = self.store`. Default: the process-wide store from [`set_default_store`]; with none set, calls fail with [`StoreError::NotConfigured`]. |
//! | `message = ident` | Which argument is the message. Default: the first argument after `self`. |
//! | `on_terminal = path` | `async fn(TerminalEvent)` called on terminal failures instead of the process-wide [`AlertSink`] (default: a `tracing` error event). |
//! | `classify = path` | `fn(&E) -> ErrorClass`, used instead of `E: Classify`. |
//! | `crate = path` | Where this crate is, for crates that re-export it. |
//! | `validate = true` | Store a SHA-256 [`Fingerprint`] of the message's [`Payload`] with the claim; the same key with another payload is [`Error::PayloadMismatch`] and runs nothing. |
//! | `cache = true` | Store the `Ok` value (serde JSON, at most 64 KiB) and return it to duplicates as [`Outcome::Replayed`]; a value that can't be stored is [`Error::Cache`] (the message is still recorded DONE). `cache` alone means `cache = true`. |
//!
//! Mistakes are compile errors pointing at the argument: unknown or repeated
//! arguments, `ttl = 0`, `lease` > `ttl`, a template without placeholders, a field the
//! message does not have.
//!
//! # Record life cycle
//!
//! | event | record afterwards | returned | broker should |
//! | --- | --- | --- | --- |
//! | first delivery, success | DONE, kept for `ttl` | `Ok(Processed(v))` | ack |
//! | same key again within ttl | unchanged | `Ok(Duplicate)` | ack |
//! | same key while another consumer runs it | unchanged | `Ok(InProgress)` | redeliver later |
//! | retryable error | released, attempt count kept | `Err(Retryable)` | redeliver |
//! | retryable error on attempt `max_attempts` | FAILED, kept for ttl, alert | `Err(Terminal { exhausted: true })` | dead-letter |
//! | terminal error | FAILED, kept for ttl, alert | `Err(Terminal)` | dead-letter |
//! | same key after FAILED, within ttl | unchanged | `Err(PreviouslyFailed)` | dead-letter |
//! | handler panics | released | `Err(Panicked)` | redeliver |
//! | caller drops the future mid-way | released (best effort), else lease expiry | — | redeliver |
//! | process dies mid-handler | claim expires after `lease` | — | redelivery is processed |
//! | claim won after `max_attempts` unfinished attempts | FAILED, alert | `Err(Abandoned)` | dead-letter |
//! | store unreachable at claim | unchanged, handler not run | `Err(Store { handler_ran: false })` | redeliver |
//!
//! Every transition after the claim carries the claim's random [`Token`]; a consumer
//! whose lease ran out can never complete, release or fail the claim of the consumer
//! that took over (it gets [`Error::LeaseLost`]).
//!
//! # What the macro expands to
//!
//! ```ignore
//! #[idempotent(key = "order:{order_id}", ttl = 600)]
//! async fn process(msg: OrderPlaced) -> Result<Receipt, PayError> { body }
//! ```
//!
//! becomes, give or take hygiene:
//!
//! ```ignore
//! async fn process(msg: OrderPlaced)
//!     -> Result<idempotent::Outcome<Receipt>, idempotent::Error<PayError>>
//! {
//!     let mut key = idempotent::__private::KeyBuilder::new("process");
//!     key.text("order:");
//!     key.field("order_id", &msg.order_id);
//!     let key = key.finish();
//!     let store = &idempotent::__private::DefaultStore;
//!     idempotent::__private::run(
//!         Spec::new(Duration::from_millis(600_000), Duration::from_millis(30_000), 5),
//!         store,
//!         key,
//!         <PayError as idempotent::Classify>::class,
//!         idempotent::__private::process_sink,
//!         async { body },
//!     )
//!     .await
//! }
//! ```
//!
//! `cargo expand --example quickstart` shows the real thing.
//!
//! # Runtime
//!
//! Handlers run on Tokio: lease renewal uses Tokio's timer.

#![warn(missing_docs)]

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
    AlertSink, AlreadySet, Claim, Classify, DefaultStore, Disposition, DispositionExt, Document,
    Error, ErrorClass, Fingerprint, Key, KeyBuilder, KeyError, MAX_KEY_LEN, MemoryStore, Outcome,
    Payload, PayloadRef, Store, StoreError, TerminalEvent, Token, Transition, Unusable, alert,
    async_trait, claim_retention, default_store, set_alert_sink, set_default_store,
};

#[cfg(feature = "testing")]
pub use idempotent_runtime::{store_suite, testing};

/// Re-exported for `Payload` messages and `cache = true` values.
pub use idempotent_runtime::serde_json;

#[cfg(feature = "redis")]
pub use idempotent_runtime::{RedisStore, redis_store};

#[cfg(feature = "postgres")]
pub use idempotent_runtime::{PostgresStore, postgres_store};

#[cfg(any(
    feature = "redis-streams",
    feature = "rabbitmq",
    feature = "nats",
    feature = "kafka"
))]
pub use idempotent_runtime::consume;

/// What the `#[idempotent]` expansion calls. Not a public API: it changes without
/// notice, which is why the macro crate is pinned to this exact version.
#[doc(hidden)]
pub mod __private {
    pub use idempotent_runtime::alert::process_sink;
    pub use idempotent_runtime::execute::{Call, HandlerResult, Spec, run, run_infallible};
    #[cfg(feature = "postgres")]
    pub use idempotent_runtime::transactional::{TransactionalStore, TxSlot, run_transactional};
    pub use idempotent_runtime::{AsStore, DefaultStore, Document, Fingerprint, KeyBuilder};
}
