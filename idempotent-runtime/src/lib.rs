//! The runtime behind the [`idempotent`](https://docs.rs/idempotent) crate.
//!
//! Users depend on `idempotent`, which re-exports everything here. This crate holds
//! every piece of logic the `#[idempotent]` attribute relies on, as ordinary Rust:
//!
//! * [`Store`]: the record life cycle (claim, complete, release, fail, renew), each
//!   transition conditional on the claim's [`Token`]; [`MemoryStore`] implements it
//!   in process.
//! * [`execute::run`]: claim, run the handler with lease renewal, record the result.
//! * [`Outcome`], [`Error`], [`Disposition`]: what a call returns and what the
//!   consumer should tell its broker.
//! * [`Classify`] / [`ErrorClass`]: which handler errors are worth a retry.
//! * [`alert`]: where terminal failures are reported.

#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]
// Nothing a store or broker answers, a message carries or a user configures may panic
// in here: it must come back as an error. The few panics left guard the library's
// own invariants, and each is allowed where it is, with the reason.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

pub mod alert;
mod backoff;
mod classify;
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
pub mod consume;
mod current;
pub mod delivery;
mod error;
pub mod execute;
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "postgres", feature = "mysql"))))]
pub mod guard;
mod json_number;
mod key;
#[doc(hidden)]
pub mod key_check;
mod lossy_json;
pub mod metrics;
mod outcome;
mod payload;
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
pub mod publish;
#[doc(hidden)]
pub mod result_alias;
pub mod store;
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
#[allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test suite: a panic is how a case fails"
)]
pub mod testing;
pub mod trace;
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "postgres", feature = "mysql"))))]
pub mod transactional;

pub use alert::{AlertSink, TerminalEvent, set_alert_sink};
pub use backoff::Backoff;
#[doc(hidden)]
pub use classify::classifier;
pub use classify::{Classify, ErrorClass};
pub use current::{Current, current};
pub use error::{Capacity, Error, KeyError, StoreError};
pub use key::{Key, KeyBuilder, MAX_KEY_LEN, MAX_STORED_ID_LEN};
pub use outcome::{Disposition, DispositionExt, Outcome};
pub use payload::{Document, Fingerprint, Payload, PayloadRef, Unusable};
pub use store::admin::{self, Admin};
pub use store::memory::MemoryStore;
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub use store::mysql::{self as mysql_store, MysqlStore};
pub use store::none::NoStore;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use store::postgres::{self as postgres_store, PostgresStore};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use store::redis::{self as redis_store, RedisStore};
#[cfg(feature = "zookeeper")]
#[cfg_attr(docsrs, doc(cfg(feature = "zookeeper")))]
pub use store::zookeeper::{self as zookeeper_store, ZooKeeperStore};
pub use store::{
    AlreadySet, AsStore, Claim, DefaultStore, Store, Token, Transition, claim_retention,
    default_store, set_default_store,
};

/// Re-exported so that hand-written [`Store`] implementations can use
/// `#[idempotent::async_trait]` without adding the dependency themselves.
pub use async_trait::async_trait;

/// The JSON crate payloads and cached results go through.
pub use serde_json;

/// Decoders of stored records and cached results, reachable for the fuzz targets
/// under `fuzz/` (feature `fuzzing`). Not part of the API: it changes without notice.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod __fuzz {
    #[cfg(feature = "mysql")]
    pub use crate::store::mysql::fuzzing as mysql;
    #[cfg(feature = "postgres")]
    pub use crate::store::postgres::fuzzing as postgres;
    #[cfg(feature = "redis")]
    pub use crate::store::redis::fuzzing as redis;
    #[cfg(feature = "zookeeper")]
    pub use crate::store::zookeeper::fuzzing as zookeeper;

    use crate::admin::State;
    use crate::execute::JsonCache;

    /// The letter the Redis and SQL stores keep `state` as.
    pub fn letter(state: State) -> u8 {
        state.letter()
    }

    /// The state a stored letter stands for.
    pub fn from_letter(letter: u8) -> Option<State> {
        State::from_letter(letter)
    }

    /// Bytes as the listing cursors write them (lower-case hex).
    pub fn hex(bytes: &[u8]) -> String {
        crate::store::admin::hex(bytes)
    }

    /// [`hex`] read back.
    pub fn unhex(text: &str) -> Result<Vec<u8>, crate::StoreError> {
        crate::store::admin::unhex(text)
    }

    /// The cache `cache = true` keeps a handler's `T` results in.
    pub fn json_cache<T>() -> JsonCache<T>
    where
        T: serde::Serialize + serde::de::DeserializeOwned,
    {
        JsonCache::new()
    }
}
