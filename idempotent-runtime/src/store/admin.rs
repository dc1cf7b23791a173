//! Inspecting and repairing records without knowing how a store keeps them: the
//! [`Admin`] trait, for operators' tools (the `idempotent` command line) and users'
//! own code.
//!
//! Implemented by [`MemoryStore`](crate::MemoryStore), `RedisStore` (feature `redis`,
//! standalone and Cluster), `PostgresStore` (feature `postgres`), `MysqlStore`
//! (feature `mysql`) and `ZooKeeperStore` (feature `zookeeper`). An expired record
//! counts as absent everywhere: `inspect` answers `None`, `list` and `stats` skip it.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::{Key, StoreError};

/// Where a record is in its life cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum State {
    /// Claimed: a handler runs under a lease, or ran and its lease lapsed (then the
    /// next claim takes the key over).
    InProgress,
    /// Given up by its handler (a retryable error, a panic, a dropped future): the
    /// next delivery claims it.
    Released,
    /// Processed: duplicates are acknowledged until the record expires.
    Done,
    /// Failed for good (a terminal error, or the last attempt): duplicates are
    /// dead-lettered until the record expires.
    Failed,
}

impl State {
    /// Every state, in life-cycle order.
    pub const ALL: [State; 4] = [State::InProgress, State::Released, State::Done, State::Failed];

    /// `in_progress`, `released`, `done` or `failed`.
    pub fn label(self) -> &'static str {
        match self {
            State::InProgress => "in_progress",
            State::Released => "released",
            State::Done => "done",
            State::Failed => "failed",
        }
    }

    /// The letter the Redis and SQL stores keep the state as.
    #[cfg_attr(
        not(any(feature = "redis", feature = "postgres", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fn letter(self) -> u8 {
        match self {
            State::InProgress => b'P',
            State::Released => b'R',
            State::Done => b'D',
            State::Failed => b'F',
        }
    }

    /// The state a stored letter stands for (the ZooKeeper store's too).
    #[cfg_attr(
        not(any(
            feature = "redis",
            feature = "postgres",
            feature = "mysql",
            feature = "zookeeper"
        )),
        allow(dead_code)
    )]
    pub(crate) fn from_letter(letter: u8) -> Option<State> {
        match letter {
            b'P' => Some(State::InProgress),
            b'R' => Some(State::Released),
            b'D' => Some(State::Done),
            b'F' => Some(State::Failed),
            _ => None,
        }
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// A text that names no [`State`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown state `{0}`: expected in_progress, released, done or failed")]
pub struct UnknownState(pub String);

/// Reads a [`State::label`] (or `in-progress`), in any case.
///
/// ```
/// use idempotent_runtime::store::admin::State;
///
/// assert_eq!("in-progress".parse::<State>().unwrap(), State::InProgress);
/// assert_eq!("DONE".parse::<State>().unwrap(), State::Done);
/// assert!("finished".parse::<State>().is_err());
/// ```
impl FromStr for State {
    type Err = UnknownState;

    fn from_str(text: &str) -> Result<State, UnknownState> {
        match text.to_ascii_lowercase().as_str() {
            "in_progress" | "in-progress" => Ok(State::InProgress),
            "released" => Ok(State::Released),
            "done" => Ok(State::Done),
            "failed" => Ok(State::Failed),
            _ => Err(UnknownState(text.to_owned())),
        }
    }
}

impl serde::Serialize for State {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.label())
    }
}

/// One record, as an operator sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// The key as the store keeps it: `namespace:id` as [`Key::stored`] gives it, so an
    /// id kept under its hash shows as `sha256:` and 64 hex digits. (The in-memory store
    /// keeps ids whole: there it is [`Key::as_bytes`].)
    pub key: Vec<u8>,
    /// The namespace: the key up to its first `:`.
    pub namespace: String,
    /// The id: the key after its first `:`.
    pub id: Vec<u8>,
    /// The record's state.
    pub state: State,
    /// How many claims the key has had (released and lapsed ones included).
    pub attempts: u32,
    /// For a record in progress whose lease is live: how long the lease has left.
    /// `None` for a lapsed lease (the next claim takes the key over) and other states.
    pub lease_left: Option<Duration>,
    /// How long until the record expires; `None` if it never does.
    pub ttl_left: Option<Duration>,
    /// The payload fingerprint (`validate = ...`), as 64 lower-case hex digits.
    pub fingerprint: Option<String>,
    /// How many bytes of handler result are cached (`cache = true`); `None` if none.
    pub result_len: Option<usize>,
}

impl Record {
    /// Splits a stored key into namespace and id (at its first `:`; all namespace and
    /// no id if it has none).
    pub(crate) fn split(key: &[u8]) -> (String, Vec<u8>) {
        match key.iter().position(|&b| b == b':') {
            Some(at) => (String::from_utf8_lossy(&key[..at]).into_owned(), key[at + 1..].to_vec()),
            None => (String::from_utf8_lossy(key).into_owned(), Vec::new()),
        }
    }

    /// Whether the record passes `filter`.
    pub fn matches(&self, filter: &Filter) -> bool {
        filter.namespace.as_ref().is_none_or(|ns| *ns == self.namespace)
            && filter.state.is_none_or(|state| state == self.state)
    }
}

/// Serialized with the key and id as text (bytes outside printable ASCII escaped as
/// `\xNN`) and durations as whole milliseconds (`lease_left_ms`, `ttl_left_ms`).
impl serde::Serialize for Record {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let millis =
            |d: Option<Duration>| d.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let mut s = serializer.serialize_struct("Record", 9)?;
        s.serialize_field("key", &self.key.escape_ascii().to_string())?;
        s.serialize_field("namespace", &self.namespace)?;
        s.serialize_field("id", &self.id.escape_ascii().to_string())?;
        s.serialize_field("state", &self.state)?;
        s.serialize_field("attempts", &self.attempts)?;
        s.serialize_field("lease_left_ms", &millis(self.lease_left))?;
        s.serialize_field("ttl_left_ms", &millis(self.ttl_left))?;
        s.serialize_field("fingerprint", &self.fingerprint)?;
        s.serialize_field("result_len", &self.result_len)?;
        s.end()
    }
}

/// Which records [`Admin::list`] and [`Admin::stats`] look at; the default is all.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    /// Only records of this namespace.
    pub namespace: Option<String>,
    /// Only records in this state.
    pub state: Option<State>,
}

impl Filter {
    /// Whether no record can pass: namespaces hold no `:`, so a namespace filter that
    /// does would, as a key range, select ids of another namespace.
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) fn matches_nothing(&self) -> bool {
        self.namespace.as_deref().is_some_and(|namespace| namespace.contains(':'))
    }
}

/// One page of [`Admin::list`].
#[derive(Debug, Clone, PartialEq)]
pub struct Page {
    /// At most the `limit` asked for; possibly fewer (even none) before the end, when
    /// the store looked at many records that did not pass the filter.
    pub records: Vec<Record>,
    /// Where the next page starts, to pass back to `list` as it is; `None` at the end.
    pub next: Option<String>,
}

/// The answer to [`Admin::release_key`] and [`Admin::release_record`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Released {
    /// The record was deleted: the next delivery claims the key afresh, at attempt 1.
    Released,
    /// There is no record (or it has expired): the key is processable already.
    NotFound,
    /// The record was left as it is, for the reason given (`force` overrides it).
    Refused(String),
}

/// Inspects and repairs records.
///
/// Every operation reads the store's own clock (the server's, for Redis, PostgreSQL
/// and MySQL; the ensemble leader's, for ZooKeeper), so the answers do not depend on
/// the caller's.
///
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use std::time::Duration;
/// use idempotent_runtime::store::admin::{Admin, Filter, Released, State};
/// use idempotent_runtime::{Claim, Key, MemoryStore, Store};
///
/// let store = MemoryStore::new();
/// let key = Key::new("orders", "42").unwrap();
/// let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(600));
/// let Claim::Won { token, .. } = store.claim(&key, lease, ttl, None).await.unwrap() else { panic!() };
/// let _ = store.fail(&key, token, ttl).await.unwrap();
///
/// let record = store.inspect(&key).await.unwrap().unwrap();
/// assert_eq!((record.state, record.attempts), (State::Failed, 1));
/// let page = store.list(&Filter::default(), None, 100).await.unwrap();
/// assert_eq!(page.records[0].key, record.key);
/// assert_eq!(page.next, None);
///
/// // A failed key is processable again once released.
/// assert_eq!(store.release_key(&key, false).await.unwrap(), Released::Released);
/// assert!(matches!(store.claim(&key, lease, ttl, None).await.unwrap(), Claim::Won { attempt: 1, .. }));
/// # }
/// ```
#[async_trait]
pub trait Admin: Send + Sync {
    /// The record of `key`, or `None` if there is none (or it has expired).
    async fn inspect(&self, key: &Key) -> Result<Option<Record>, StoreError>;

    /// Up to `limit` records passing `filter`, starting at `cursor` (`None` for the
    /// first page, then each page's [`next`](Page::next)). A page never reads more than
    /// a bounded part of the store. Records written or deleted while the pages are
    /// read may or may not be seen; every record present throughout is seen once
    /// (Redis Cluster: as long as no slot moves between masters meanwhile). Records
    /// this version cannot read (another program's, or a later version's:
    /// [`format`](mod@super::format)) are left out of listings and counts;
    /// [`inspect`](Admin::inspect) names them.
    async fn list(
        &self,
        filter: &Filter,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<Page, StoreError>;

    /// Makes `key` processable again by deleting its record (attempts start again from
    /// 1). FAILED, RELEASED, and IN PROGRESS records whose lease has lapsed are
    /// released; DONE records (the message would run again) and IN PROGRESS ones with
    /// a live lease (another consumer runs it now) are [`Released::Refused`] unless
    /// `force`. The check and the delete are one atomic step.
    async fn release_key(&self, key: &Key, force: bool) -> Result<Released, StoreError> {
        self.release_record(&self.record_key(key), None, force).await
    }

    /// [`release_key`](Admin::release_key) for the record [`list`](Admin::list) showed
    /// under `record_key` ([`Record::key`]): a key whose id is stored hashed can be
    /// released from a listing, where only the hash is known. With `expected`, the
    /// record is released only if it is still in that state (checked in the same
    /// atomic step): a record listed as FAILED, or as a stuck claim, may have been
    /// taken over and finished since, and `force` must not then delete a DONE record
    /// nobody asked about. A record in another state is [`Released::Refused`].
    async fn release_record(
        &self,
        record_key: &[u8],
        expected: Option<State>,
        force: bool,
    ) -> Result<Released, StoreError>;

    /// The [`Record::key`] the record of `key` is listed under: the key as this store
    /// keeps it (ids too long, or starting with `sha256:`, as their hash).
    fn record_key(&self, key: &Key) -> Vec<u8>;

    /// Deletes expired records now and answers how many. Stores that expire records
    /// by themselves (Redis, ZooKeeper) answer 0.
    async fn purge(&self) -> Result<u64, StoreError>;

    /// How many live records pass `filter`, by namespace and state, sorted.
    async fn stats(&self, filter: &Filter) -> Result<Vec<(String, State, u64)>, StoreError>;
}

macro_rules! forward_admin {
    ($($ptr:ty),*) => {$(
        #[async_trait]
        impl<A: Admin + ?Sized> Admin for $ptr {
            async fn inspect(&self, key: &Key) -> Result<Option<Record>, StoreError> {
                (**self).inspect(key).await
            }
            async fn list(&self, filter: &Filter, cursor: Option<&str>, limit: usize) -> Result<Page, StoreError> {
                (**self).list(filter, cursor, limit).await
            }
            async fn release_record(&self, record_key: &[u8], expected: Option<State>, force: bool) -> Result<Released, StoreError> {
                (**self).release_record(record_key, expected, force).await
            }
            fn record_key(&self, key: &Key) -> Vec<u8> {
                (**self).record_key(key)
            }
            async fn purge(&self) -> Result<u64, StoreError> {
                (**self).purge().await
            }
            async fn stats(&self, filter: &Filter) -> Result<Vec<(String, State, u64)>, StoreError> {
                (**self).stats(filter).await
            }
        }
    )*};
}

forward_admin!(&A, Arc<A>, Box<A>);

/// [`Admin::stats`] for stores that count by walking every page of a listing
/// (Redis, ZooKeeper: they have no query that groups).
#[cfg_attr(not(any(feature = "redis", feature = "zookeeper")), allow(dead_code))]
pub(crate) async fn stats_by_listing<A: Admin + ?Sized>(
    store: &A,
    filter: &Filter,
) -> Result<Vec<(String, State, u64)>, StoreError> {
    let mut counts = std::collections::BTreeMap::<(String, State), u64>::new();
    let mut cursor: Option<String> = None;
    loop {
        let page = store.list(filter, cursor.as_deref(), 1000).await?;
        for (namespace, state, n) in tally(&page.records) {
            *counts.entry((namespace, state)).or_default() += n;
        }
        match page.next {
            Some(next) => cursor = Some(next),
            None => break,
        }
    }
    Ok(counts.into_iter().map(|((namespace, state), n)| (namespace, state, n)).collect())
}

/// The refusal for a record that is no longer in the state it was listed in.
pub(crate) fn changed(now: Option<State>, expected: State) -> Released {
    let now = now.map_or("unreadable", State::label);
    Released::Refused(format!(
        "the record is {now} now, not {}: it changed since it was listed; left as it is",
        expected.label()
    ))
}

/// The refusal for a record whose state needs `force`, or `None` if it may go.
pub(crate) fn refusal(state: State, lease_left: Option<Duration>) -> Option<String> {
    match (state, lease_left) {
        (State::Done, _) => Some("DONE: pass force to reprocess it".to_owned()),
        (State::InProgress, Some(left)) => Some(format!(
            "in progress with {} s of lease left: another consumer holds it; pass force",
            left.as_secs_f64().ceil()
        )),
        _ => None,
    }
}

/// Counts records by namespace and state, sorted.
pub(crate) fn tally<'a>(
    records: impl IntoIterator<Item = &'a Record>,
) -> Vec<(String, State, u64)> {
    let mut counts = std::collections::BTreeMap::<(String, State), u64>::new();
    for record in records {
        *counts.entry((record.namespace.clone(), record.state)).or_default() += 1;
    }
    counts.into_iter().map(|((ns, state), n)| (ns, state, n)).collect()
}

/// Bytes as lower-case hex, for cursors.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// [`hex`] read back; a cursor that isn't is a [`StoreError::Protocol`].
pub(crate) fn unhex(text: &str) -> Result<Vec<u8>, StoreError> {
    let bad = || StoreError::Protocol(format!("`{text}` is not a cursor `list` gave"));
    if text.len() % 2 != 0 {
        return Err(bad());
    }
    (0..text.len())
        .step_by(2)
        .map(|i| text.get(i..i + 2).and_then(|b| u8::from_str_radix(b, 16).ok()).ok_or_else(bad))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_read_back_from_their_labels() {
        for state in State::ALL {
            assert_eq!(state.label().parse::<State>(), Ok(state));
            assert_eq!(State::from_letter(state.letter()), Some(state));
        }
        assert_eq!("in-progress".parse::<State>(), Ok(State::InProgress));
        assert!("".parse::<State>().is_err());
    }

    #[test]
    fn cursors_read_back() {
        let bytes = b"ns:\x00\xffid".to_vec();
        assert_eq!(unhex(&hex(&bytes)).unwrap(), bytes);
        assert!(unhex("abc").is_err());
        assert!(unhex("zz").is_err());
        assert!(unhex("é0").is_err());
    }

    #[test]
    fn done_and_live_claims_need_force() {
        assert!(refusal(State::Done, None).unwrap().starts_with("DONE"));
        let live = refusal(State::InProgress, Some(Duration::from_millis(11_200))).unwrap();
        assert!(live.contains("12 s of lease left"), "{live}");
        assert_eq!(refusal(State::InProgress, None), None);
        assert_eq!(refusal(State::Failed, None), None);
        assert_eq!(refusal(State::Released, None), None);
    }

    #[test]
    fn keys_split_at_the_first_colon() {
        assert_eq!(Record::split(b"ns:a:b"), ("ns".to_owned(), b"a:b".to_vec()));
        assert_eq!(Record::split(b"ns"), ("ns".to_owned(), Vec::new()));
    }
}
