//! Where idempotency records live: the [`Store`] trait and its implementations.
//!
//! * [`admin`]: [`Admin`](admin::Admin), to inspect, list, release and count records.
//! * [`format`](mod@format): how records of another version of this library are treated.
//! * [`memory`]: [`MemoryStore`](memory::MemoryStore), in process.
//! * [`none`]: [`NoStore`](none::NoStore), no records, for handlers guarded by
//!   business state.
//! * `redis` (feature `redis`): `RedisStore`, standalone and Cluster.
//! * `postgres` (feature `postgres`): `PostgresStore`.
//! * `mysql` (feature `mysql`): `MysqlStore`, for MySQL 8 and MariaDB 10.6+.
//!
//! The SQL stores share their table handling, purge schedule and error
//! classification (`sql`).

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;

use crate::{Fingerprint, Key, StoreError};

pub mod admin;
pub mod format;
pub mod memory;
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub mod mysql;
pub mod none;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) mod sql;
#[cfg(feature = "zookeeper")]
#[cfg_attr(docsrs, doc(cfg(feature = "zookeeper")))]
pub mod zookeeper;

/// Identifies one claim on a key. Every transition after the claim carries it, and a
/// store applies the transition only while the record still holds the same token, so
/// a consumer whose lease ran out can never complete, release or fail the claim of
/// the consumer that took over. Random, 128 bits; usable as a fencing token.
///
/// ```
/// use idempotent_runtime::Token;
///
/// let token = Token::from_u128(0xfeed);
/// assert_eq!(token.to_string(), "0000000000000000000000000000feed");
/// assert_ne!(Token::random(), Token::random());
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Token(u128);

impl Token {
    /// A fresh random token.
    pub fn random() -> Token {
        Token(rand::random())
    }

    /// A token from its numeric value (for stores that read one back).
    pub const fn from_u128(value: u128) -> Token {
        Token(value)
    }

    /// The numeric value.
    pub const fn as_u128(self) -> u128 {
        self.0
    }
}

/// 32 lowercase hex digits.
impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Token({self})")
    }
}

/// The answer to [`Store::claim`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Claim {
    /// The caller now owns the key until its lease runs out and must finish with
    /// `complete`, `release` or `fail`. `attempt` counts from 1 and includes earlier
    /// claims that were released or whose lease expired.
    Won {
        /// Proof of ownership for the transitions that follow.
        token: Token,
        /// Which attempt this is, from 1.
        attempt: u32,
        /// A fencing number: larger than that of every earlier claim of the key that
        /// won, whatever came between (a release, an expiry, a takeover, a record
        /// deleted by force or evicted), so a downstream system that keeps the
        /// largest it saw can refuse a write of a claim that was taken over. `None`
        /// where the store can't make one (see each store's docs).
        fence: Option<u64>,
    },
    /// The key is DONE and within its dedupe window.
    Done,
    /// The key is DONE and within its dedupe window, with the handler's result as
    /// stored by [`Store::complete`].
    Cached(Vec<u8>),
    /// The key's record holds a different payload fingerprint than the claim's: the
    /// same key was used for another message. Nothing changed.
    Mismatch,
    /// Another claim on the key is live.
    InProgress {
        /// How long that claim's lease has left, by the store's clock; `None` when
        /// the store can't tell (a claim held inside another transaction).
        lease_left: Option<Duration>,
    },
    /// The key is FAILED and within its dedupe window.
    Failed {
        /// How many attempts the key had.
        attempts: u32,
    },
}

/// Whether a token-checked transition was applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a transition may have been refused because the lease was lost"]
pub enum Transition {
    /// The record held the caller's token and was changed.
    Applied,
    /// The record no longer holds the caller's token (the lease expired and another
    /// claim took the key, or the record expired): nothing was changed.
    LeaseLost,
}

/// Where idempotency records live.
///
/// A record moves through this life cycle (every store implements the same one):
///
/// * absent, expired, released, or in progress with an expired lease → [`claim`]
///   makes it IN PROGRESS under a fresh token, for `lease`, and counts an attempt;
/// * IN PROGRESS → [`complete`] makes it DONE for `ttl`; [`fail`] makes it FAILED for
///   `ttl`; [`release`] makes it claimable again, keeping the attempt count;
///   [`renew`] extends the lease;
/// * DONE / FAILED → [`claim`] answers [`Claim::Done`] / [`Claim::Failed`] until
///   `ttl` passes.
///
/// Each transition after the claim applies only while the record holds the claim's
/// token, and each must be atomic: two consumers claiming at once must not both win.
/// A record is kept [`claim_retention`] from its last claim, so the attempt count
/// survives a consumer that died mid-handler.
///
/// The trait is object safe: `Arc<dyn Store>` is a `Store`. Implement it with
/// [`macro@async_trait`](crate::async_trait), and check an implementation with the
/// behaviour suite in `idempotent::testing` (feature `testing`).
///
/// [`claim`]: Store::claim
/// [`complete`]: Store::complete
/// [`fail`]: Store::fail
/// [`release`]: Store::release
/// [`renew`]: Store::renew
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an idempotency store",
    note = "`store = ...` takes a value that implements `idempotent::Store` (such as `MemoryStore`) or dereferences to one (`Arc<S>`, `&S`, `LazyLock<S>`)"
)]
#[async_trait]
pub trait Store: Send + Sync {
    /// Claims `key` for `lease`; the record is retained for
    /// [`claim_retention`]`(lease, ttl)`. With a `fingerprint`, a record that holds a
    /// different one answers [`Claim::Mismatch`]; a record without one takes it.
    async fn claim(
        &self,
        key: &Key,
        lease: Duration,
        ttl: Duration,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Claim, StoreError>;

    /// Marks the claim DONE, kept for `ttl`, with the handler's `result` if given
    /// (later claims then answer [`Claim::Cached`]).
    async fn complete(
        &self,
        key: &Key,
        token: Token,
        ttl: Duration,
        result: Option<&[u8]>,
    ) -> Result<Transition, StoreError>;

    /// Gives the claim up so the next delivery can claim it; the attempt count stays.
    async fn release(&self, key: &Key, token: Token) -> Result<Transition, StoreError>;

    /// Marks the claim FAILED, kept for `ttl`.
    async fn fail(&self, key: &Key, token: Token, ttl: Duration) -> Result<Transition, StoreError>;

    /// Extends the claim's lease to `lease` from now, and keeps the record at least
    /// [`claim_retention`]`(lease, ttl)` from now, so a handler that has run longer
    /// than the first claim's retention still leaves its attempt count behind if it
    /// crashes.
    async fn renew(
        &self,
        key: &Key,
        token: Token,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Transition, StoreError>;

    /// Best-effort release of a claim whose handler future was dropped mid-way. Called
    /// from `Drop`, so it must not block: release at once when that is cheap, start the
    /// release in the background, or do nothing and let the lease run out (the
    /// default).
    fn abandon(&self, key: &Key, token: Token) {
        let _ = (key, token);
    }

    /// How long, at most, a claim is sure to stand after the claim or a renewal was
    /// sent, when that can be less than its lease: the run loop then renews every
    /// third of this and stops polling the body when it runs out unconfirmed, as it
    /// does at the lease's end. `None` (the default): a claim stands for its lease.
    /// [`ZooKeeperStore`](crate::zookeeper_store::ZooKeeperStore) answers its
    /// session timeout, since a claim's ephemeral child goes with its session.
    fn hold_limit(&self) -> Option<Duration> {
        None
    }
}

/// How long a store keeps a record after a claim: the dedupe window, plus one lease
/// past the claim's own lease, so the attempt count outlives a consumer that died
/// holding the claim (even when `lease == ttl`). Every store uses this rule.
pub fn claim_retention(lease: Duration, ttl: Duration) -> Duration {
    ttl.max(lease).saturating_add(lease)
}

/// `Store::abandon` for server-backed stores: starts the release on the current Tokio
/// runtime and returns at once; without a runtime, the lease runs out instead.
#[cfg(any(feature = "redis", feature = "postgres", feature = "mysql", feature = "zookeeper"))]
pub(crate) fn release_in_background<S: Store + Clone + 'static>(
    store: &S,
    key: &Key,
    token: Token,
) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        let (store, key) = (store.clone(), key.clone());
        runtime.spawn(async move {
            if let Err(error) = store.release(&key, token).await {
                tracing::warn!(key = %key.logged(), %error, "release of an abandoned claim failed; the lease will run out");
            }
        });
    }
}

macro_rules! forward_store {
    ($($ptr:ty),*) => {$(
        #[async_trait]
        impl<S: Store + ?Sized> Store for $ptr {
            async fn claim(&self, key: &Key, lease: Duration, ttl: Duration, fingerprint: Option<&Fingerprint>) -> Result<Claim, StoreError> {
                (**self).claim(key, lease, ttl, fingerprint).await
            }
            async fn complete(&self, key: &Key, token: Token, ttl: Duration, result: Option<&[u8]>) -> Result<Transition, StoreError> {
                (**self).complete(key, token, ttl, result).await
            }
            async fn release(&self, key: &Key, token: Token) -> Result<Transition, StoreError> {
                (**self).release(key, token).await
            }
            async fn fail(&self, key: &Key, token: Token, ttl: Duration) -> Result<Transition, StoreError> {
                (**self).fail(key, token, ttl).await
            }
            async fn renew(&self, key: &Key, token: Token, lease: Duration, ttl: Duration) -> Result<Transition, StoreError> {
                (**self).renew(key, token, lease, ttl).await
            }
            fn abandon(&self, key: &Key, token: Token) {
                (**self).abandon(key, token)
            }
            fn hold_limit(&self) -> Option<Duration> {
                (**self).hold_limit()
            }
        }
    )*};
}

forward_store!(&S, Arc<S>, Box<S>);

static DEFAULT_STORE: OnceLock<Arc<dyn Store>> = OnceLock::new();

/// [`set_default_store`] was already called.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the process-wide default store is already set")]
pub struct AlreadySet;

/// Sets the store that handlers without `store = ...` use. Once per process: the
/// store a handler uses must not change under it.
///
/// ```
/// idempotent_runtime::set_default_store(idempotent_runtime::MemoryStore::new()).unwrap();
/// ```
pub fn set_default_store(store: impl Store + 'static) -> Result<(), AlreadySet> {
    DEFAULT_STORE.set(Arc::new(store)).map_err(|_| AlreadySet)
}

/// The process-wide default store, if one was set.
pub fn default_store() -> Option<&'static Arc<dyn Store>> {
    DEFAULT_STORE.get()
}

/// The process-wide default store as a [`Store`]: every operation fails with
/// [`StoreError::NotConfigured`] until [`set_default_store`] is called. Never falls
/// back to an in-memory store behind the user's back.
#[derive(Debug, Clone, Copy, Default)]
pub struct DefaultStore;

impl DefaultStore {
    fn get(&self) -> Result<&'static Arc<dyn Store>, StoreError> {
        default_store().ok_or(StoreError::NotConfigured)
    }
}

#[async_trait]
impl Store for DefaultStore {
    async fn claim(
        &self,
        key: &Key,
        lease: Duration,
        ttl: Duration,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Claim, StoreError> {
        self.get()?.claim(key, lease, ttl, fingerprint).await
    }
    async fn complete(
        &self,
        key: &Key,
        token: Token,
        ttl: Duration,
        result: Option<&[u8]>,
    ) -> Result<Transition, StoreError> {
        self.get()?.complete(key, token, ttl, result).await
    }
    async fn release(&self, key: &Key, token: Token) -> Result<Transition, StoreError> {
        self.get()?.release(key, token).await
    }
    async fn fail(&self, key: &Key, token: Token, ttl: Duration) -> Result<Transition, StoreError> {
        self.get()?.fail(key, token, ttl).await
    }
    async fn renew(
        &self,
        key: &Key,
        token: Token,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Transition, StoreError> {
        self.get()?.renew(key, token, lease, ttl).await
    }
    fn abandon(&self, key: &Key, token: Token) {
        if let Ok(store) = self.get() {
            store.abandon(key, token)
        }
    }
    fn hold_limit(&self) -> Option<Duration> {
        self.get().ok()?.hold_limit()
    }
}

/// Lets the expansion of `store = expr` accept a store or anything that dereferences
/// to one (`Arc<S>`, `&S`, `LazyLock<S>`, ...): method-call syntax auto-dereferences
/// `expr` until it finds a `Store`.
#[doc(hidden)]
pub trait AsStore {
    fn __idempotent_as_store(&self) -> &Self;
}

impl<S: Store + ?Sized> AsStore for S {
    fn __idempotent_as_store(&self) -> &Self {
        self
    }
}
