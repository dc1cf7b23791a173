//! The call a handler body runs in: [`current`].

use std::future::Future;

use crate::Key;
use crate::store::Token;

/// The claim a handler body runs under, from [`current`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Current {
    /// The message's idempotency key.
    pub key: Key,
    /// Which attempt this is, from 1. It grows by one with every claim of the key
    /// while its record lasts, and restarts at 1 when the record goes (it expires, is
    /// released by force, or is evicted from a Redis that evicts), while a stalled
    /// handler may still hold a higher one: it is no fencing number (see `fence`).
    pub attempt: u32,
    /// The claim's token: the store accepts renewals and the result only with it, and
    /// a downstream system that reads the record can compare it to tell this claim
    /// from any other.
    pub token: Token,
    /// The claim's fencing number: larger than that of every earlier claim of the
    /// key, whatever came between (a release, an expiry, a takeover after a lapsed
    /// lease, a record deleted by force). Send it with every write the handler makes
    /// downstream, and have the downstream system keep the largest it has seen for
    /// the resource and refuse a write with a smaller one: a handler that stalled
    /// past its lease, whose key another consumer took over, can then no longer
    /// overwrite the newer claim's writes.
    ///
    /// `Some` on `MemoryStore` (a per-store count), `ZooKeeperStore` (the claim
    /// write's zxid) and `PostgresStore` (the claim's transaction id), outside a
    /// transactional handler's own transaction, whose writes commit with the record
    /// and need none. `None` on `RedisStore` and `MysqlStore` (neither has a number
    /// that outlives the record, and an expired or evicted record would start it
    /// over) and on `NoStore`: there, guard the business data itself.
    pub fence: Option<u64>,
}

tokio::task_local! {
    static CURRENT: Current;
}

/// The call whose handler body is running, or `None` outside one.
///
/// It is set for the body's own task: a task the body starts with `tokio::spawn`
/// does not see it (tokio's task-local values do not cross tasks), so read it
/// before spawning and move it in. Nor is it set in `classify`, the `on_terminal`
/// hook or the consumer loop.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use idempotent_runtime::execute::{Call, Spec, run};
/// use idempotent_runtime::{Classify, Key, MemoryStore, alert, current};
///
/// let store = MemoryStore::new();
/// let call = Call::new(Spec::default(), Key::new("orders", "42"));
/// let seen = run(call, &store, std::io::Error::class, alert::process_sink, async {
///     let now = current().expect("inside a handler");
///     Ok::<_, std::io::Error>((now.key.to_string(), now.attempt))
/// })
/// .await
/// .unwrap();
/// assert_eq!(seen.into_value(), Some(("orders:42".to_owned(), 1)));
/// assert!(current().is_none());
/// # }
/// ```
pub fn current() -> Option<Current> {
    CURRENT.try_with(Current::clone).ok()
}

/// Runs `body` with `current` as what [`current`] answers.
pub(crate) async fn scope<F: Future>(current: Current, body: F) -> F::Output {
    CURRENT.scope(current, body).await
}
