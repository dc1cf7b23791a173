//! `MemoryStore`: records in this process's memory.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;
use tokio::time::Instant;

use crate::{Claim, Fingerprint, Key, Store, StoreError, Token, Transition, claim_retention};

const SHARDS: usize = 64;
/// A shard drops its expired records after this many writes...
const SWEEP_EVERY_WRITES: u32 = 1024;
/// ...or on the first write this long after its last sweep.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// Records kept in this process: the embedded default, for tests, single-instance
/// consumers, and the quickstart. Records are lost when the process exits and are not
/// shared between processes; use a server-backed store when several consumer
/// processes share a stream.
///
/// Sharded locks (64 shards, each held only for a hash-map operation, never across an
/// `.await`) keep it correct and fast under concurrency. Expired records are dropped
/// as the store is used: each shard sweeps itself every 1024 writes or once a second,
/// and [`purge_expired`](MemoryStore::purge_expired) sweeps everything at once.
///
/// Times are Tokio's clock (`tokio::time::Instant`), so a test with paused time
/// (`#[tokio::test(start_paused = true)]`) moves leases and expiries along with it.
/// Each Tokio runtime has its own clock, and a paused one stands still: a store shared
/// between runtimes (a `static` used by several `#[tokio::test]`s) compares instants
/// from different clocks. Give each runtime its own store when any of them pauses
/// time.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use std::time::Duration;
/// use idempotent_runtime::{Claim, Key, MemoryStore, Store};
///
/// let store = MemoryStore::new();
/// let key = Key::new("orders", "42").unwrap();
/// let lease = Duration::from_secs(30);
/// let ttl = Duration::from_secs(600);
/// let Claim::Won { token, .. } = store.claim(&key, lease, ttl, None).await.unwrap() else { panic!() };
/// let _ = store.complete(&key, token, ttl, None).await.unwrap();
/// assert_eq!(store.claim(&key, lease, ttl, None).await.unwrap(), Claim::Done);
/// # }
/// ```
pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
}

struct Shard {
    records: HashMap<Box<[u8]>, Record>,
    writes: u32,
    swept_at: Instant,
}

struct Record {
    state: State,
    attempts: u32,
    expires_at: Instant,
    fingerprint: Option<Fingerprint>,
}

enum State {
    InProgress {
        token: Token,
        lease_until: Instant,
    },
    Released,
    /// With the handler's result, when it is cached.
    Done(Option<Box<[u8]>>),
    Failed,
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new()
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore").field("records", &self.len()).finish()
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> MemoryStore {
        let now = Instant::now();
        MemoryStore {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(Shard { records: HashMap::new(), writes: 0, swept_at: now }))
                .collect(),
            hasher: RandomState::new(),
        }
    }

    /// How many records are held, expired ones not yet swept included.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().records.len()).sum()
    }

    /// Whether no records are held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every expired record now.
    pub fn purge_expired(&self) {
        let now = Instant::now();
        for shard in self.shards.iter() {
            shard.lock().sweep(now);
        }
    }

    /// Runs `f` on the live record for `key` (expired records read as absent), with
    /// the shard locked; counts a write and sweeps the shard when it is due.
    fn with_record<R>(&self, key: &Key, f: impl FnOnce(&mut Shard, Instant) -> R) -> R {
        let bytes = key.as_bytes();
        let index = (self.hasher.hash_one(bytes) as usize) % SHARDS;
        let now = Instant::now();
        let mut shard = self.shards[index].lock();
        shard.writes += 1;
        if shard.writes >= SWEEP_EVERY_WRITES || now.duration_since(shard.swept_at) >= SWEEP_EVERY {
            shard.sweep(now);
        }
        f(&mut shard, now)
    }

    fn transition(
        &self,
        key: &Key,
        token: Token,
        apply: impl FnOnce(&mut Record, Instant),
    ) -> Transition {
        self.with_record(key, |shard, now| match shard.records.get_mut(key.as_bytes()) {
            Some(record) if record.expires_at > now && record.holds(token) => {
                apply(record, now);
                Transition::Applied
            }
            _ => Transition::LeaseLost,
        })
    }
}

impl Shard {
    fn sweep(&mut self, now: Instant) {
        self.records.retain(|_, r| r.expires_at > now);
        self.writes = 0;
        self.swept_at = now;
    }
}

impl Record {
    fn holds(&self, token: Token) -> bool {
        matches!(self.state, State::InProgress { token: t, .. } if t == token)
    }
}

/// `now + d`, with `d` capped at `Spec::MAX_DURATION` so that no duration a caller
/// passes can overflow the clock.
fn later(now: Instant, d: Duration) -> Instant {
    now + d.min(crate::execute::Spec::MAX_DURATION)
}

#[async_trait]
impl Store for MemoryStore {
    async fn claim(
        &self,
        key: &Key,
        lease: Duration,
        ttl: Duration,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Claim, StoreError> {
        Ok(self.with_record(key, |shard, now| {
            let token = Token::random();
            let retain_until = later(now, claim_retention(lease, ttl));
            let in_progress = State::InProgress { token, lease_until: later(now, lease) };
            let Some(record) = shard.records.get_mut(key.as_bytes()).filter(|r| r.expires_at > now)
            else {
                let record = Record {
                    state: in_progress,
                    attempts: 1,
                    expires_at: retain_until,
                    fingerprint: fingerprint.copied(),
                };
                shard.records.insert(key.as_bytes().into(), record);
                return Claim::Won { token, attempt: 1 };
            };
            if let (Some(held), Some(given)) = (&record.fingerprint, fingerprint) {
                if held != given {
                    return Claim::Mismatch;
                }
            }
            match &record.state {
                State::Done(None) => Claim::Done,
                State::Done(Some(result)) => Claim::Cached(result.to_vec()),
                State::Failed => Claim::Failed { attempts: record.attempts },
                State::InProgress { lease_until, .. } if *lease_until > now => Claim::InProgress,
                State::InProgress { .. } | State::Released => {
                    record.attempts += 1;
                    record.state = in_progress;
                    record.expires_at = record.expires_at.max(retain_until);
                    record.fingerprint = record.fingerprint.or(fingerprint.copied());
                    Claim::Won { token, attempt: record.attempts }
                }
            }
        }))
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        ttl: Duration,
        result: Option<&[u8]>,
    ) -> Result<Transition, StoreError> {
        Ok(self.transition(key, token, |record, now| {
            record.state = State::Done(result.map(Box::from));
            record.expires_at = later(now, ttl);
        }))
    }

    async fn release(&self, key: &Key, token: Token) -> Result<Transition, StoreError> {
        Ok(self.transition(key, token, |record, _| record.state = State::Released))
    }

    async fn fail(&self, key: &Key, token: Token, ttl: Duration) -> Result<Transition, StoreError> {
        Ok(self.transition(key, token, |record, now| {
            record.state = State::Failed;
            record.expires_at = later(now, ttl);
        }))
    }

    async fn renew(
        &self,
        key: &Key,
        token: Token,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Transition, StoreError> {
        Ok(self.transition(key, token, |record, now| {
            let lease_until = later(now, lease);
            record.state = State::InProgress { token, lease_until };
            record.expires_at = record.expires_at.max(later(now, claim_retention(lease, ttl)));
        }))
    }

    /// Releases at once: the store is in memory, so this does not block.
    fn abandon(&self, key: &Key, token: Token) {
        let _ = self.transition(key, token, |record, _| record.state = State::Released);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(30);
    const TTL: Duration = Duration::from_secs(600);

    fn won(claim: Claim) -> (Token, u32) {
        match claim {
            Claim::Won { token, attempt } => (token, attempt),
            other => panic!("expected a won claim, got {other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn expired_lease_is_taken_over_and_the_old_token_is_fenced_off() {
        let store = MemoryStore::new();
        let key = Key::new("ns", "k").unwrap();
        let (old, _) = won(store.claim(&key, LEASE, TTL, None).await.unwrap());
        tokio::time::advance(LEASE + Duration::from_millis(1)).await;
        let (new, attempt) = won(store.claim(&key, LEASE, TTL, None).await.unwrap());
        assert_eq!(attempt, 2);
        assert_eq!(store.complete(&key, old, TTL, None).await.unwrap(), Transition::LeaseLost);
        assert_eq!(store.complete(&key, new, TTL, None).await.unwrap(), Transition::Applied);
    }

    #[tokio::test(start_paused = true)]
    async fn expired_records_are_swept() {
        let store = MemoryStore::new();
        let short = Duration::from_millis(100);
        for i in 0..10_000 {
            let key = Key::new("ns", i.to_string()).unwrap();
            let (token, _) = won(store.claim(&key, short, short, None).await.unwrap());
            let _ = store.complete(&key, token, short, None).await.unwrap();
        }
        assert_eq!(store.len(), 10_000);
        tokio::time::advance(Duration::from_secs(2)).await;
        // Writes sweep the shards they touch once a second has passed.
        for i in 0..1_000 {
            let key = Key::new("other", i.to_string()).unwrap();
            let _ = store.claim(&key, short, short, None).await.unwrap();
        }
        assert!(store.len() < 2_000, "expired records kept: {}", store.len());
        tokio::time::advance(Duration::from_secs(2)).await;
        store.purge_expired();
        assert!(store.is_empty());
    }
}
