//! `MemoryStore`: records in this process's memory.

use std::collections::BTreeMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{self, AtomicUsize};
use std::time::Duration;

use async_trait::async_trait;
use hashbrown::HashTable;
use parking_lot::Mutex;
use tokio::time::Instant;

use super::admin;
use crate::{
    Capacity, Claim, Fingerprint, Key, Store, StoreError, Token, Transition, claim_retention,
};

const SHARDS: usize = 64;
/// How many due expiry entries a write handles (each write adds at most one, so the
/// queue keeps up; a backlog of records expiring together drains over the next
/// writes instead of stalling one of them).
const EXPIRE_PER_WRITE: usize = 8;
/// Expiry entries are grouped by time in slots of 2^27 ns (134 ms): a
/// record is looked at in the first write after its slot has passed.
const SLOT_SHIFT: u32 = 27;
/// No queue entry is further ahead than 2^42 ns (73 minutes): a record whose expiry
/// moves earlier leaves its old entry behind, and this bounds how long such stale
/// entries stay. A record held longer is looked at once per period (at 86 million
/// records, about 20,000 looks a second).
const MAX_AHEAD: Tick = 1 << 42;

/// Records kept in this process: the embedded default, for tests, single-instance
/// consumers, and the quickstart. Records are lost when the process exits and are not
/// shared between processes; use a server-backed store when several consumer
/// processes share a stream.
///
/// Sharded locks (64 shards, each held only for a hash-map operation, never across an
/// `.await`) keep it correct and fast under concurrency. Each shard keeps its records
/// in expiry order too (in slots of 134 ms), so expired records are dropped as the
/// store is used at a cost proportional to the records that expire, never to the
/// records held: every write handles up to 8 that are due, and
/// [`purge_expired`](MemoryStore::purge_expired) drops all that have expired at once.
///
/// # Memory
///
/// A record of a 27-byte key takes about 190 bytes (measured with 10 million records:
/// `cargo bench -p idempotent-integration --bench memory_scale`); keys of up to 30
/// bytes are kept inside the record, longer ones in an allocation of their own.
/// Records stay for their ttl (24 h by default), so a consumer doing 1,000 messages a
/// second holds 86 million records, about 16 GB. Bound it with [`with_capacity`](MemoryStore::with_capacity)
/// (records) or [`with_memory_limit`](MemoryStore::with_memory_limit) (bytes): a full
/// store refuses claims of new keys with [`StoreError::Full`] (the delivery is
/// retried later) rather than evict a record whose key is in progress, or done within
/// its dedupe window, which would let a duplicate run again.
///
/// # Time
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
    /// Keyed with random keys per store: a hostile producer can't aim keys at one
    /// bucket.
    hasher: RandomState,
    /// Times are kept as nanoseconds since this instant.
    base: Instant,
    /// How much is held at most, if bounded.
    capacity: Option<Capacity>,
    /// What is held, in `capacity`'s unit (records or bytes), counted only when it is
    /// set.
    held: AtomicUsize,
}

/// Nanoseconds since the store's `base`.
type Tick = u64;

#[derive(Default)]
struct Shard {
    /// Each record with its key and the key's hash, which is computed once per
    /// operation and serves both to pick the shard and to find the record.
    records: HashTable<Entry>,
    /// When to look at records again, by time slot, as their hashes: at the latest in
    /// the slot of their expiry. A record's live entry is the one in its `queued`
    /// slot; entries in other slots are stale and skipped.
    queue: BTreeMap<u64, Vec<u64>>,
    /// An emptied slot's buffer, kept for the next slot: slots fill and empty as time
    /// passes, and reusing the buffer spares the allocator a large free and
    /// allocation per second.
    spare: Vec<u64>,
    /// How many claims of this shard's keys won: a claim's fence is this count,
    /// times [`SHARDS`], plus the shard's index, so it grows with every claim of a
    /// key (a key stays in its shard) and no two claims share one.
    won: u64,
}

struct Entry {
    hash: u64,
    key: KeyCopy,
    record: Record,
}

/// Longest key a record keeps inline.
const INLINE_KEY: usize = 30;

/// A record's copy of its key: inline up to [`INLINE_KEY`] bytes, which covers most
/// keys (`orders:order:12345678901234` is 27), so such a record costs no allocation
/// of its own and a lookup or expiry touches no second cache line; longer keys on the
/// heap. 32 bytes either way.
enum KeyCopy {
    Inline { len: u8, bytes: [u8; INLINE_KEY] },
    Heap(Box<[u8]>),
}

impl KeyCopy {
    fn new(key: &[u8]) -> KeyCopy {
        if key.len() > INLINE_KEY {
            return KeyCopy::Heap(key.into());
        }
        let mut bytes = [0; INLINE_KEY];
        bytes[..key.len()].copy_from_slice(key);
        KeyCopy::Inline { len: key.len() as u8, bytes }
    }

    fn as_bytes(&self) -> &[u8] {
        match self {
            KeyCopy::Inline { len, bytes } => &bytes[..*len as usize],
            KeyCopy::Heap(bytes) => bytes,
        }
    }
}

/// The time slot of `at`.
fn slot(at: Tick) -> u64 {
    at >> SLOT_SHIFT
}

/// See [`MemoryStore::RECORD_BYTES`].
const RECORD_BYTES: usize = MemoryStore::RECORD_BYTES;

/// What a record counts against `bound`: one record, or its bytes.
fn cost(bound: Option<Capacity>, key: usize, fingerprint: bool, result: usize) -> usize {
    match bound {
        Some(Capacity::Bytes(_)) => {
            let key = if key > INLINE_KEY { key } else { 0 };
            let fingerprint = if fingerprint { std::mem::size_of::<Fingerprint>() } else { 0 };
            RECORD_BYTES.saturating_add(key).saturating_add(fingerprint).saturating_add(result)
        }
        Some(Capacity::Records(_)) | None => 1,
    }
}

impl Entry {
    fn cost(&self, bound: Option<Capacity>) -> usize {
        let record = &self.record;
        let result = match &record.state {
            State::Done(Some(result)) => result.len(),
            _ => 0,
        };
        cost(bound, self.key.as_bytes().len(), record.fingerprint.is_some(), result)
    }
}

struct Record {
    state: State,
    attempts: u32,
    expires_at: Tick,
    /// The slot of this record's live entry in the shard's queue: never after the
    /// slot of `expires_at`.
    queued: u64,
    fingerprint: Option<Box<Fingerprint>>,
}

enum State {
    InProgress {
        /// The token's two halves (a `u128` would align the record to 16 bytes).
        token: [u64; 2],
        lease_until: Tick,
    },
    Released,
    /// With the handler's result, when it is cached.
    Done(Option<Box<[u8]>>),
    Failed,
}

fn halves(token: Token) -> [u64; 2] {
    let value = token.as_u128();
    [(value >> 64) as u64, value as u64]
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new()
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("records", &self.len())
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl MemoryStore {
    /// What a record is counted as by [`with_memory_limit`](MemoryStore::with_memory_limit),
    /// besides its long key, fingerprint and cached result: its entry, its share of
    /// the table's spare room, and its expiry queue entry (a record of a 27-byte key
    /// was measured at about 190 bytes).
    pub const RECORD_BYTES: usize = 200;

    /// An empty store without a bound on the records it holds.
    pub fn new() -> MemoryStore {
        MemoryStore {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            hasher: RandomState::new(),
            base: Instant::now(),
            capacity: None,
            held: AtomicUsize::new(0),
        }
    }

    /// An empty store that holds at most `records` records. When it is full, a claim
    /// of a key it does not hold first drops the records that have expired (all but
    /// those that expired in the last 134 ms), then, if none had, fails with
    /// [`StoreError::Full`]: the delivery is retried later, and no record in progress
    /// or within its dedupe window is ever evicted. Keys it holds (duplicates,
    /// retries, takeovers) are answered as usual. Besides its records, the store
    /// keeps 8 bytes of expiry queue per record, plus 8 per record whose expiry moved
    /// earlier (a ttl shorter than the lease) for up to 73 minutes.
    pub fn with_capacity(records: usize) -> MemoryStore {
        MemoryStore { capacity: Some(Capacity::Records(records)), ..MemoryStore::new() }
    }

    /// An empty store whose records take at most `bytes`, each counted as
    /// [`RECORD_BYTES`](MemoryStore::RECORD_BYTES) plus its key beyond the 30 bytes a record keeps inline, its
    /// payload fingerprint and its cached result: a bound that holds whatever the
    /// keys and results are (with [`with_capacity`](MemoryStore::with_capacity), a
    /// producer sending 64 KiB ids, or handlers caching large results, make each
    /// record cost that much more). Full, it refuses claims of new keys as
    /// `with_capacity` does. A result is counted when it is recorded, and never
    /// refused (refusing it would lose the DONE), so the store may go over its bound
    /// by the results of the calls in flight when it fills.
    pub fn with_memory_limit(bytes: usize) -> MemoryStore {
        MemoryStore { capacity: Some(Capacity::Bytes(bytes)), ..MemoryStore::new() }
    }

    /// How many records are held, expired ones not yet dropped included.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().records.len()).sum()
    }

    /// Whether no records are held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every expired record now, in time proportional to their number (plus the
    /// records queued in the current 134 ms slot).
    pub fn purge_expired(&self) {
        self.purge_counted();
    }

    /// [`purge_expired`](MemoryStore::purge_expired), answering how many records it
    /// dropped.
    fn purge_counted(&self) -> usize {
        let now = self.now();
        let mut total = 0;
        for shard in self.shards.iter() {
            let mut shard = shard.lock();
            let dropped = shard.expire(now, usize::MAX, self.capacity)
                + shard.expire_current(now, self.capacity);
            self.forget(dropped.cost);
            total += dropped.records;
        }
        total
    }

    /// Drops the expired records of every slot that has passed (not those of the
    /// current slot, which `purge_expired` rescans).
    fn drop_due(&self) {
        let now = self.now();
        for shard in self.shards.iter() {
            let dropped = shard.lock().expire(now, usize::MAX, self.capacity);
            self.forget(dropped.cost);
        }
    }

    fn now(&self) -> Tick {
        Instant::now().saturating_duration_since(self.base).as_nanos() as Tick
    }

    /// Records that `dropped` units (records or bytes, as counted by [`cost`]) left
    /// the store.
    fn forget(&self, dropped: usize) {
        if self.capacity.is_some() && dropped > 0 {
            self.held.fetch_sub(dropped, atomic::Ordering::Relaxed);
        }
    }

    /// A record's cost grew (or, negative, shrank) in place: always counted, never
    /// refused.
    fn regrow(&self, before: usize, after: usize) {
        if after > before {
            self.held.fetch_add(after - before, atomic::Ordering::Relaxed);
        } else {
            self.forget(before - after);
        }
    }

    /// Runs `f` on `key`'s shard, locked, after dropping a few expired records; `f`
    /// gets the key's hash.
    fn with_shard<R>(&self, key: &Key, f: impl FnOnce(&mut Shard, u64, Tick) -> R) -> R {
        let hash = self.hasher.hash_one(key.as_bytes());
        // Bits the table uses neither for its bucket index (the low ones) nor for its
        // control bytes (the top seven).
        let index = (hash >> 32) as usize % SHARDS;
        let now = self.now();
        let mut shard = self.shards[index].lock();
        let dropped = shard.expire(now, EXPIRE_PER_WRITE, self.capacity);
        self.forget(dropped.cost);
        f(&mut shard, hash, now)
    }

    fn transition(
        &self,
        key: &Key,
        token: Token,
        apply: impl FnOnce(&mut Record, Tick),
    ) -> Transition {
        let token = halves(token);
        self.with_shard(key, |shard, hash, now| {
            let Some(entry) = shard.find(hash, key) else { return Transition::LeaseLost };
            let record = &mut entry.record;
            if record.expires_at <= now || !record.holds(token) {
                return Transition::LeaseLost;
            }
            apply(record, now);
            if let Some(earlier) = record.requeue() {
                shard.enqueue(earlier, hash);
            }
            Transition::Applied
        })
    }

    /// Room for a new record costing `cost`: always without a bound; else counts it
    /// in.
    fn admit(&self, cost: usize) -> bool {
        let limit = match self.capacity {
            None => return true,
            Some(Capacity::Records(n) | Capacity::Bytes(n)) => n,
        };
        self.held
            .fetch_update(atomic::Ordering::Relaxed, atomic::Ordering::Relaxed, |held| {
                held.checked_add(cost).filter(|&after| after <= limit)
            })
            .is_ok()
    }

    /// One claim attempt; `None` when the key is new and the store is full.
    fn try_claim(
        &self,
        key: &Key,
        lease: Duration,
        ttl: Duration,
        fingerprint: Option<&Fingerprint>,
    ) -> Option<Claim> {
        self.with_shard(key, |shard, hash, now| {
            let token = Token::random();
            let retain_until = later(now, claim_retention(lease, ttl));
            let lease_until = later(now, lease);
            let in_progress = || State::InProgress { token: halves(token), lease_until };
            let fresh = |queued| Record {
                state: in_progress(),
                attempts: 1,
                expires_at: retain_until,
                queued,
                fingerprint: fingerprint.map(|f| Box::new(*f)),
            };
            let bound = self.capacity;
            let Some(entry) = shard.find(hash, key) else {
                if !self.admit(cost(bound, key.as_bytes().len(), fingerprint.is_some(), 0)) {
                    return None;
                }
                // Looked at again when the lease ends or, if sooner, when a completion
                // made now would expire: by then the record has usually moved on, and
                // it is queued again at its expiry. Both are before any expiry the
                // record can have, and a record has one entry in the queue at a time.
                let check = slot(lease_until.min(later(now, ttl)).min(now + MAX_AHEAD));
                let record = fresh(check);
                let entry = Entry { hash, key: KeyCopy::new(key.as_bytes()), record };
                shard.records.insert_unique(hash, entry, |e| e.hash);
                shard.enqueue(check, hash);
                return Some(Claim::Won { token, attempt: 1, fence: Some(shard.fence(hash)) });
            };
            if entry.record.expires_at <= now {
                // Expired, not yet dropped: a first claim again, in the same slot.
                let before = entry.cost(bound);
                entry.record = fresh(entry.record.queued);
                self.regrow(before, entry.cost(bound));
                if let Some(earlier) = entry.record.requeue() {
                    shard.enqueue(earlier, hash);
                }
                return Some(Claim::Won { token, attempt: 1, fence: Some(shard.fence(hash)) });
            }
            let record = &mut entry.record;
            if let (Some(held), Some(given)) = (&record.fingerprint, fingerprint) {
                if **held != *given {
                    return Some(Claim::Mismatch);
                }
            }
            let won = |shard: &mut Shard, attempt| Claim::Won {
                token,
                attempt,
                fence: Some(shard.fence(hash)),
            };
            Some(match &record.state {
                State::Done(None) => Claim::Done,
                State::Done(Some(result)) => Claim::Cached(result.to_vec()),
                State::Failed => Claim::Failed { attempts: record.attempts },
                State::InProgress { lease_until, .. } if *lease_until > now => {
                    Claim::InProgress { lease_left: Some(Duration::from_nanos(lease_until - now)) }
                }
                State::InProgress { .. } | State::Released => {
                    record.attempts += 1;
                    record.state = in_progress();
                    record.expires_at = record.expires_at.max(retain_until);
                    if record.fingerprint.is_none() && fingerprint.is_some() {
                        record.fingerprint = fingerprint.map(|f| Box::new(*f));
                        self.regrow(0, cost(bound, 0, true, 0) - cost(bound, 0, false, 0));
                    }
                    let attempt = record.attempts;
                    won(shard, attempt)
                }
            })
        })
    }
}

impl Shard {
    /// The fence of a claim of a key of this shard (its hash `hash`) that won.
    fn fence(&mut self, hash: u64) -> u64 {
        self.won += 1;
        self.won * SHARDS as u64 + (hash >> 32) % SHARDS as u64
    }

    fn find(&mut self, hash: u64, key: &Key) -> Option<&mut Entry> {
        self.records.find_mut(hash, |e| e.hash == hash && e.key.as_bytes() == key.as_bytes())
    }

    fn enqueue(&mut self, slot: u64, hash: u64) {
        let spare = &mut self.spare;
        self.queue.entry(slot).or_insert_with(|| std::mem::take(spare)).push(hash);
    }

    /// Handles up to `limit` entries of slots that have passed: drops the records that
    /// expired, queues the others again in their expiry's slot. Returns what was
    /// dropped, its cost counted against `bound`.
    fn expire(&mut self, now: Tick, limit: usize, bound: Option<Capacity>) -> Dropped {
        let mut dropped = Dropped::default();
        for _ in 0..limit {
            let Some(mut first) = self.queue.first_entry() else { break };
            let passed = *first.key();
            if passed >= slot(now) {
                break;
            }
            let hash = first.get_mut().pop();
            if first.get().is_empty() {
                let emptied = first.remove();
                if emptied.capacity() > self.spare.capacity() {
                    self.spare = emptied;
                }
            }
            let Some(hash) = hash else { continue };
            dropped = dropped + self.look_at(hash, passed, now, bound);
        }
        dropped
    }

    /// An entry of slot `passed` for `hash` is due: a record with that hash whose live
    /// entry is in that slot is dropped if it expired, else queued again at its
    /// expiry. Returns what was dropped (none or one record). Two keys whose hashes
    /// collide each have their own entry, so each pop handles one of them.
    fn look_at(&mut self, hash: u64, passed: u64, now: Tick, bound: Option<Capacity>) -> Dropped {
        let live = |e: &Entry| e.hash == hash && e.record.queued == passed;
        let Ok(entry) = self.records.find_entry(hash, live) else { return Dropped::default() };
        if entry.get().record.expires_at <= now {
            let cost = entry.get().cost(bound);
            entry.remove();
            return Dropped { records: 1, cost };
        }
        let record = &mut entry.into_mut().record;
        record.queued = slot(record.expires_at.min(now + MAX_AHEAD));
        let queued = record.queued;
        self.enqueue(queued, hash);
        Dropped::default()
    }

    /// Looks at the entries of the current slot as if it had passed: drops the
    /// records that have expired, queues the others again.
    fn expire_current(&mut self, now: Tick, bound: Option<Capacity>) -> Dropped {
        let current = slot(now);
        let Some(hashes) = self.queue.remove(&current) else { return Dropped::default() };
        let each = hashes.into_iter().map(|hash| self.look_at(hash, current, now, bound));
        each.fold(Dropped::default(), |a, b| a + b)
    }
}

/// Records dropped, and what they counted against the store's bound.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Dropped {
    records: usize,
    cost: usize,
}

impl std::ops::Add for Dropped {
    type Output = Dropped;
    fn add(self, other: Dropped) -> Dropped {
        Dropped { records: self.records + other.records, cost: self.cost + other.cost }
    }
}

impl Record {
    /// After the record's expiry moved: when it now expires before the slot of its
    /// live queue entry, moves that to the expiry's slot and returns it, for the
    /// caller to queue (a later expiry is picked up when the live entry is due).
    fn requeue(&mut self) -> Option<u64> {
        let expires = slot(self.expires_at);
        (expires < self.queued).then(|| {
            self.queued = expires;
            expires
        })
    }

    fn holds(&self, token: [u64; 2]) -> bool {
        matches!(self.state, State::InProgress { token: t, .. } if t == token)
    }
}

/// `now + d`, with `d` capped at `Spec::MAX_DURATION` so that no duration a caller
/// passes can overflow the clock.
fn later(now: Tick, d: Duration) -> Tick {
    now.saturating_add(d.min(crate::execute::Spec::MAX_DURATION).as_nanos() as Tick)
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
        if let Some(claim) = self.try_claim(key, lease, ttl, fingerprint) {
            return Ok(claim);
        }
        // Full: drop what is due everywhere (in time proportional to it), then try
        // once more.
        self.drop_due();
        self.try_claim(key, lease, ttl, fingerprint).ok_or(StoreError::Full {
            capacity: self.capacity.unwrap_or(Capacity::Records(usize::MAX)),
        })
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        ttl: Duration,
        result: Option<&[u8]>,
    ) -> Result<Transition, StoreError> {
        let done = self.transition(key, token, |record, now| {
            record.state = State::Done(result.map(Box::from));
            record.expires_at = later(now, ttl);
        });
        if let (Transition::Applied, Some(result)) = (done, result) {
            self.regrow(
                0,
                cost(self.capacity, 0, false, result.len()) - cost(self.capacity, 0, false, 0),
            );
        }
        Ok(done)
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
        let halves = halves(token);
        Ok(self.transition(key, token, |record, now| {
            let lease_until = later(now, lease);
            record.state = State::InProgress { token: halves, lease_until };
            record.expires_at = record.expires_at.max(later(now, claim_retention(lease, ttl)));
        }))
    }

    /// Releases at once: the store is in memory, so this does not block.
    fn abandon(&self, key: &Key, token: Token) {
        let _ = self.transition(key, token, |record, _| record.state = State::Released);
    }
}

/// Keys are listed in byte order; a cursor is the last key listed, in hex. Each page
/// looks at every record held (the store is in memory), keeping only the page's.
#[async_trait]
impl admin::Admin for MemoryStore {
    async fn inspect(&self, key: &Key) -> Result<Option<admin::Record>, StoreError> {
        let now = self.now();
        let hash = self.hasher.hash_one(key.as_bytes());
        let mut shard = self.shards[(hash >> 32) as usize % SHARDS].lock();
        Ok(shard.find(hash, key).and_then(|entry| entry.admin_record(now)))
    }

    async fn list(
        &self,
        filter: &admin::Filter,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<admin::Page, StoreError> {
        let after = cursor.map(admin::unhex).transpose()?;
        let now = self.now();
        // As the other stores: at least one record a page, and no overflow below.
        let limit = limit.clamp(1, usize::MAX - 1);
        // The `limit + 1` smallest keys after the cursor, to know whether more follow.
        let mut page = BTreeMap::<Vec<u8>, admin::Record>::new();
        for shard in self.shards.iter() {
            let shard = shard.lock();
            for entry in shard.records.iter() {
                let key = entry.key.as_bytes();
                if after.as_deref().is_some_and(|after| key <= after)
                    || page.len() > limit
                        && page.last_key_value().is_some_and(|(k, _)| key >= &k[..])
                {
                    continue;
                }
                let Some(record) = entry.admin_record(now).filter(|r| r.matches(filter)) else {
                    continue;
                };
                page.insert(key.to_vec(), record);
                if page.len() > limit + 1 {
                    page.pop_last();
                }
            }
        }
        let more = page.len() > limit;
        let records: Vec<admin::Record> = page.into_values().take(limit).collect();
        let next = match records.last() {
            Some(last) if more => Some(admin::hex(&last.key)),
            _ => None,
        };
        Ok(admin::Page { records, next })
    }

    fn record_key(&self, key: &Key) -> Vec<u8> {
        key.as_bytes().to_vec()
    }

    async fn release_record(
        &self,
        record_key: &[u8],
        expected: Option<admin::State>,
        force: bool,
    ) -> Result<admin::Released, StoreError> {
        let now = self.now();
        let hash = self.hasher.hash_one(record_key);
        let mut shard = self.shards[(hash >> 32) as usize % SHARDS].lock();
        let same = |e: &Entry| e.hash == hash && e.key.as_bytes() == record_key;
        let Ok(entry) = shard.records.find_entry(hash, same) else {
            return Ok(admin::Released::NotFound);
        };
        let Some(record) = entry.get().admin_record(now) else {
            return Ok(admin::Released::NotFound);
        };
        if let Some(expected) = expected.filter(|&expected| record.state != expected) {
            return Ok(admin::changed(Some(record.state), expected));
        }
        if !force {
            if let Some(why) = admin::refusal(record.state, record.lease_left) {
                return Ok(admin::Released::Refused(why));
            }
        }
        // Its queue entry is left behind: a stale entry finds no record and is skipped.
        let cost = entry.get().cost(self.capacity);
        entry.remove();
        self.forget(cost);
        Ok(admin::Released::Released)
    }

    async fn purge(&self) -> Result<u64, StoreError> {
        Ok(self.purge_counted() as u64)
    }

    async fn stats(
        &self,
        filter: &admin::Filter,
    ) -> Result<Vec<(String, admin::State, u64)>, StoreError> {
        let now = self.now();
        let mut records = Vec::new();
        for shard in self.shards.iter() {
            let shard = shard.lock();
            records.extend(
                shard
                    .records
                    .iter()
                    .filter_map(|e| e.admin_record(now))
                    .filter(|r| r.matches(filter)),
            );
        }
        Ok(admin::tally(&records))
    }
}

impl Entry {
    /// The record as [`admin`] shows it; `None` once it has expired.
    fn admin_record(&self, now: Tick) -> Option<admin::Record> {
        let record = &self.record;
        if record.expires_at <= now {
            return None;
        }
        let key = self.key.as_bytes();
        let (namespace, id) = admin::Record::split(key);
        let (state, lease_left, result_len) = match &record.state {
            State::InProgress { lease_until, .. } => (
                admin::State::InProgress,
                (*lease_until > now).then(|| Duration::from_nanos(lease_until - now)),
                None,
            ),
            State::Released => (admin::State::Released, None, None),
            State::Done(result) => (admin::State::Done, None, result.as_ref().map(|r| r.len())),
            State::Failed => (admin::State::Failed, None, None),
        };
        Some(admin::Record {
            key: key.to_vec(),
            namespace,
            id,
            state,
            attempts: record.attempts,
            lease_left,
            ttl_left: Some(Duration::from_nanos(record.expires_at - now)),
            fingerprint: record.fingerprint.as_ref().map(|f| f.to_string()),
            result_len,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(30);
    const TTL: Duration = Duration::from_secs(600);

    fn won(claim: Claim) -> (Token, u32) {
        match claim {
            Claim::Won { token, attempt, .. } => (token, attempt),
            other => panic!("expected a won claim, got {other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn admin_lists_in_pages_releases_and_purges() {
        use admin::{Admin, Filter, Released, State};

        let store = MemoryStore::new();
        let key = |ns: &str, i: usize| Key::new(ns, i.to_string()).unwrap();
        for i in 0..10 {
            let (token, _) = won(store.claim(&key("a", i), LEASE, TTL, None).await.unwrap());
            if i % 2 == 0 {
                let _ = store.complete(&key("a", i), token, TTL, Some(b"r")).await.unwrap();
            }
            let _ = store.claim(&key("b", i), LEASE, Duration::from_secs(1), None).await.unwrap();
        }
        let filter = Filter { namespace: Some("a".to_owned()), state: None };
        let (mut seen, mut cursor) = (Vec::new(), None);
        loop {
            let page = store.list(&filter, cursor.as_deref(), 3).await.unwrap();
            assert!(page.records.len() <= 3);
            seen.extend(page.records.into_iter().map(|r| r.key));
            match page.next {
                Some(next) => cursor = Some(next),
                None => break,
            }
        }
        let mut want: Vec<Vec<u8>> = (0..10).map(|i| key("a", i).as_bytes().to_vec()).collect();
        want.sort();
        assert_eq!(seen, want);
        let stats = store.stats(&Filter::default()).await.unwrap();
        assert_eq!(
            stats,
            vec![
                ("a".to_owned(), State::InProgress, 5),
                ("a".to_owned(), State::Done, 5),
                ("b".to_owned(), State::InProgress, 10),
            ]
        );

        let done = store.inspect(&key("a", 0)).await.unwrap().unwrap();
        assert_eq!((done.state, done.result_len), (State::Done, Some(1)));
        assert!(matches!(
            &store.release_key(&key("a", 0), false).await.unwrap(),
            Released::Refused(_)
        ));
        assert!(matches!(
            &store.release_key(&key("a", 1), false).await.unwrap(),
            Released::Refused(_)
        ));
        assert_eq!(store.release_key(&key("a", 1), true).await.unwrap(), Released::Released);
        tokio::time::advance(LEASE + Duration::from_millis(1)).await;
        // The lease lapsed: no force needed. The `b` records (retained for one lease
        // past it) are still there.
        assert_eq!(store.inspect(&key("a", 3)).await.unwrap().unwrap().lease_left, None);
        assert_eq!(store.release_key(&key("a", 3), false).await.unwrap(), Released::Released);
        assert_eq!(store.release_key(&key("a", 3), false).await.unwrap(), Released::NotFound);
        // The extreme limits: none is lost to an overflow, a zero limit still pages.
        let all = store.list(&Filter::default(), None, usize::MAX).await.unwrap();
        assert!(!all.records.is_empty() && all.next.is_none());
        let one = store.list(&Filter::default(), None, 0).await.unwrap();
        assert_eq!(one.records.len(), 1);
        tokio::time::advance(LEASE).await;
        assert_eq!(store.purge().await.unwrap(), 10);
        assert_eq!(store.len(), 8);
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
    async fn expired_records_are_dropped_by_later_writes_and_by_purge() {
        let store = MemoryStore::new();
        let short = Duration::from_millis(100);
        for i in 0..10_000 {
            let key = Key::new("ns", i.to_string()).unwrap();
            let (token, _) = won(store.claim(&key, short, short, None).await.unwrap());
            let _ = store.complete(&key, token, short, None).await.unwrap();
        }
        assert_eq!(store.len(), 10_000);
        tokio::time::advance(Duration::from_secs(2)).await;
        // Each write drops a few due records; together they drop them all.
        for i in 0..4_000 {
            let key = Key::new("other", i.to_string()).unwrap();
            let _ = store.claim(&key, TTL, TTL, None).await.unwrap();
        }
        assert_eq!(store.len(), 4_000, "expired records kept");
        tokio::time::advance(TTL * 3).await;
        store.purge_expired();
        assert!(store.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_record_expires_when_its_expiry_moves_earlier_or_later() {
        let store = MemoryStore::new();
        let (early, late, renewed) = (
            Key::new("ns", "early").unwrap(),
            Key::new("ns", "late").unwrap(),
            Key::new("ns", "renewed").unwrap(),
        );
        let long = Duration::from_secs(100);
        let short = Duration::from_secs(1);
        // Claimed with a long lease, completed with a short ttl: gone after the ttl.
        let (token, _) = won(store.claim(&early, long, long, None).await.unwrap());
        let _ = store.complete(&early, token, short, None).await.unwrap();
        // Claimed with a short lease, completed with a long ttl: kept for the ttl.
        let (token, _) = won(store.claim(&late, short, short, None).await.unwrap());
        let _ = store.complete(&late, token, long, None).await.unwrap();
        // Renewed past its first retention.
        let (token, _) = won(store.claim(&renewed, short, short, None).await.unwrap());
        for _ in 0..10 {
            tokio::time::advance(short / 2).await;
            assert_eq!(
                store.renew(&renewed, token, short, short).await.unwrap(),
                Transition::Applied
            );
        }
        tokio::time::advance(short * 2).await;
        store.purge_expired();
        assert_eq!(store.len(), 1, "only `late` is within its window");
        assert_eq!(store.claim(&late, short, short, None).await.unwrap(), Claim::Done);
        tokio::time::advance(long).await;
        store.purge_expired();
        assert!(store.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_store_refuses_new_keys_and_evicts_nothing_in_use() {
        let store = MemoryStore::with_capacity(100);
        let short = Duration::from_secs(1);
        let key = |i: u32| Key::new("ns", i.to_string()).unwrap();
        let mut tokens = Vec::new();
        for i in 0..100 {
            tokens.push(won(store.claim(&key(i), short, TTL, None).await.unwrap()).0);
        }
        let _ = store.complete(&key(0), tokens[0], TTL, None).await.unwrap();
        let _ = store.release(&key(1), tokens[1]).await.unwrap();
        let refused = store.claim(&key(100), short, TTL, None).await.unwrap_err();
        assert!(
            matches!(refused, StoreError::Full { capacity: Capacity::Records(100) }),
            "{refused}"
        );
        assert!(!refused.is_permanent(), "retried later, not dead-lettered");
        // Keys it holds are answered as usual: a duplicate, a retry, a live claim.
        assert_eq!(store.claim(&key(0), short, TTL, None).await.unwrap(), Claim::Done);
        assert_eq!(won(store.claim(&key(1), short, TTL, None).await.unwrap()).1, 2);
        assert!(matches!(
            store.claim(&key(2), short, TTL, None).await.unwrap(),
            Claim::InProgress { lease_left: Some(left) } if left <= short
        ));
        // Leases running out do not free room: those records keep their attempts.
        tokio::time::advance(short * 2).await;
        assert!(store.claim(&key(100), short, TTL, None).await.is_err());
        // Records that expire do.
        let _ = store.complete(&key(3), tokens[3], short, None).await;
        tokio::time::advance(TTL * 3).await;
        assert!(matches!(
            store.claim(&key(100), short, TTL, None).await.unwrap(),
            Claim::Won { .. }
        ));
        store.purge_expired();
        assert_eq!((store.len(), store.held.load(atomic::Ordering::Relaxed)), (1, 1));
    }

    /// A store bounded by bytes counts what a hostile producer or a large result makes
    /// a record cost: 60 KB ids fill it after a few records, a cached result counts
    /// once recorded (never refused), and expiry gives every byte back.
    #[tokio::test(start_paused = true)]
    async fn a_memory_limit_counts_long_keys_and_cached_results() {
        let limit = 1024 * 1024;
        let store = MemoryStore::with_memory_limit(limit);
        let short = Duration::from_secs(1);
        let long_key = |i: u32| Key::new("ns", format!("{i:0>60000}")).unwrap();
        let mut held = 0;
        while store.claim(&long_key(held), short, short, None).await.is_ok() {
            held += 1;
        }
        assert_eq!(held as usize, limit / (RECORD_BYTES + 60_003), "60 KB ids");
        let refused = store.claim(&long_key(held), short, short, None).await.unwrap_err();
        assert!(
            matches!(refused, StoreError::Full { capacity: Capacity::Bytes(l) } if l == limit),
            "{refused}"
        );
        assert!(refused.to_string().contains("1048576 bytes of records"), "{refused}");
        tokio::time::advance(short * 2).await;
        store.purge_expired();
        assert_eq!(store.held.load(atomic::Ordering::Relaxed), 0, "every byte given back");

        // Short keys: a result recorded past the bound is kept (its DONE stands), and
        // new keys wait until it expires.
        let key = |i: u32| Key::new("ns", i.to_string()).unwrap();
        let (token, _) = won(store.claim(&key(0), short, short, None).await.unwrap());
        let result = vec![7u8; limit];
        let done = store.complete(&key(0), token, short, Some(&result)).await.unwrap();
        assert_eq!(done, Transition::Applied);
        assert_eq!(store.claim(&key(0), short, short, None).await.unwrap(), Claim::Cached(result));
        assert!(store.claim(&key(1), short, short, None).await.is_err(), "full of the result");
        tokio::time::advance(short * 2).await;
        assert!(matches!(
            store.claim(&key(1), short, short, None).await.unwrap(),
            Claim::Won { .. }
        ));
        store.purge_expired();
        assert_eq!(store.held.load(atomic::Ordering::Relaxed), RECORD_BYTES);
    }

    /// A ttl far shorter than the lease moves each record's expiry earlier than its
    /// queue entry, leaving that entry behind: such entries are gone within
    /// `MAX_AHEAD`, however long the lease.
    #[tokio::test(start_paused = true)]
    async fn entries_left_behind_by_earlier_expiries_do_not_pile_up() {
        let store = MemoryStore::with_capacity(16);
        let (long, short) = (crate::execute::Spec::MAX_DURATION, Duration::from_millis(1));
        let entries = |store: &MemoryStore| -> usize {
            let queues =
                store.shards.iter().map(|s| s.lock().queue.values().map(Vec::len).sum::<usize>());
            queues.sum()
        };
        for i in 0..20_000u32 {
            let key = Key::new("leak", i.to_string()).unwrap();
            let (token, _) = won(store.claim(&key, long, long, None).await.unwrap());
            assert_eq!(
                store.complete(&key, token, short, None).await.unwrap(),
                Transition::Applied
            );
            tokio::time::advance(Duration::from_millis(500)).await;
        }
        store.purge_expired();
        // 2^42 ns (73.3 minutes), and a slot.
        let ahead = Duration::from_secs(4_400);
        assert!(entries(&store) <= (ahead.as_millis() / 500) as usize + 16, "{}", entries(&store));
        tokio::time::advance(ahead).await;
        store.purge_expired();
        assert_eq!((store.len(), entries(&store)), (0, 0), "entries kept for a 100-year lease");
    }

    #[test]
    fn keys_are_kept_whole_inline_and_on_the_heap() {
        assert_eq!(std::mem::size_of::<KeyCopy>(), 32);
        let long: Vec<u8> = (0..=255u8).collect();
        for len in [0, 1, 29, INLINE_KEY, INLINE_KEY + 1, 256] {
            let copy = KeyCopy::new(&long[..len]);
            assert_eq!(copy.as_bytes(), &long[..len]);
            assert_eq!(matches!(copy, KeyCopy::Inline { .. }), len <= INLINE_KEY);
        }
    }

    /// Two keys whose hashes collide: each is found, expired and kept by its own
    /// fields, whichever of their queue entries comes first.
    #[test]
    fn colliding_hashes_are_told_apart() {
        let mut shard = Shard::default();
        let (hash, second) = (42, 1u64 << SLOT_SHIFT);
        let record = |expires_at| Record {
            state: State::Released,
            attempts: 1,
            expires_at,
            queued: 0,
            fingerprint: None,
        };
        for (key, expires_at) in [(&b"ns:a"[..], second / 2), (&b"ns:b"[..], second * 3)] {
            let entry = Entry { hash, key: KeyCopy::new(key), record: record(expires_at) };
            shard.records.insert_unique(hash, entry, |e| e.hash);
            shard.enqueue(0, hash);
        }
        let a = Key::new("ns", "a").unwrap();
        let b = Key::new("ns", "b").unwrap();
        assert_eq!(shard.find(hash, &b).unwrap().record.expires_at, second * 3);
        // Slot 0 has passed: `a` expired, `b` moves to its expiry's slot.
        assert_eq!(shard.expire(second + 1, usize::MAX, None).records, 1);
        assert!(shard.find(hash, &a).is_none());
        assert_eq!(shard.find(hash, &b).unwrap().record.queued, 3);
        assert_eq!(shard.queue.keys().copied().collect::<Vec<_>>(), [3]);
        assert_eq!(shard.expire(second * 4, usize::MAX, None).records, 1);
        assert!(shard.records.is_empty() && shard.queue.is_empty());
    }

    /// The store against a plain model with no expiry queue: random operations on a
    /// few keys with random leases, ttls and time steps give the same answers, and
    /// after a purge the store holds exactly the records the model has live.
    mod model {
        use super::*;
        use proptest::prelude::*;
        use std::collections::HashMap;

        #[derive(Debug, Clone)]
        enum Op {
            Claim(u8, u64, u64),
            Complete(u8, u64),
            Release(u8),
            Fail(u8, u64),
            Renew(u8, u64, u64),
            Advance(u64),
            Purge,
            /// A transition with a token an earlier claim of the key won.
            Stale(u8),
        }

        fn op() -> impl Strategy<Value = Op> {
            let key = 0u8..4;
            // Milliseconds, across the store's 134 ms expiry slots.
            let d = prop::sample::select(vec![10u64, 400, 1500, 5000]);
            prop_oneof![
                (key.clone(), d.clone(), d.clone()).prop_map(|(k, l, t)| Op::Claim(k, l, t)),
                (key.clone(), d.clone()).prop_map(|(k, t)| Op::Complete(k, t)),
                key.clone().prop_map(Op::Release),
                (key.clone(), d.clone()).prop_map(|(k, t)| Op::Fail(k, t)),
                (key, d.clone(), d).prop_map(|(k, l, t)| Op::Renew(k, l, t)),
                prop::sample::select(vec![0u64, 5, 300, 1100, 3000]).prop_map(Op::Advance),
                Just(Op::Purge),
                (0u8..4).prop_map(Op::Stale),
            ]
        }

        #[derive(Clone, Copy, PartialEq, Debug)]
        enum S {
            InProgress(u64),
            Released,
            Done,
            Failed,
        }

        struct Rec {
            s: S,
            attempts: u32,
            expires: u64,
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(512))]
            #[test]
            fn agrees_with_a_plain_model(ops in prop::collection::vec(op(), 1..80), bound in any::<bool>(), boundary in any::<bool>()) {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_time().start_paused(true).build().unwrap();
                rt.block_on(async {
                    let ms = Duration::from_millis;
                    let store = if bound { MemoryStore::with_capacity(3) } else { MemoryStore::new() };
                    let mut model: HashMap<u8, Rec> = HashMap::new();
                    let mut tokens: HashMap<u8, Token> = HashMap::new();
                    let mut now = 0u64;
                    let mut last_purge = 0u64;
                    let mut old_tokens: HashMap<u8, Vec<Token>> = HashMap::new();
                    // Lengths 3, 16, 28 and 40: records keep keys inline and on the heap.
                    // Or keys at the inline limit that share their first bytes: 30 bytes,
                    // the same plus one (31, on the heap), the 30 with a NUL last, and
                    // the 30 less its last byte.
                    let key = |k: u8| {
                        if !boundary {
                            return Key::new("m", format!("{}{k}", "x".repeat(k as usize * 12))).unwrap();
                        }
                        let mut id = vec![b'x'; 28];
                        match k {
                            0 => {}
                            1 => id.push(b'x'),
                            2 => *id.last_mut().unwrap() = 0,
                            _ => { id.pop(); }
                        }
                        Key::new("m", id).unwrap()
                    };
                    for op in ops {
                        let live = |m: &HashMap<u8, Rec>, k: u8, now: u64| m.get(&k).is_some_and(|r| r.expires > now);
                        let holds = |m: &HashMap<u8, Rec>, k: u8, now: u64, t: Option<&Token>| {
                            live(m, k, now) && t.is_some() && matches!(m[&k].s, S::InProgress(_))
                        };
                        match op {
                            Op::Claim(k, l, t) => {
                                let got = store.claim(&key(k), ms(l), ms(t), None).await;
                                let retain = claim_retention(ms(l), ms(t)).as_millis() as u64;
                                let live_count = model.values().filter(|r| r.expires > now).count();
                                let expected = if !live(&model, k, now) {
                                    if bound && live_count >= 3 {
                                        prop_assert!(matches!(got, Err(StoreError::Full { .. })), "{got:?}");
                                        continue;
                                    }
                                    if let Err(StoreError::Full { .. }) = got {
                                        // Records that expired in the current slot since
                                        // the last purge may still take room.
                                        let slot_of = |ms: u64| (ms * 1_000_000) >> SLOT_SHIFT;
                                        let lingering = model.values().filter(|r| {
                                            r.expires <= now
                                                && r.expires > last_purge
                                                && slot_of(r.expires) == slot_of(now)
                                        });
                                        prop_assert!(live_count + lingering.count() >= 3, "refused with room");
                                        continue;
                                    }
                                    model.insert(k, Rec { s: S::InProgress(now + l), attempts: 1, expires: now + retain });
                                    None
                                } else {
                                    let r = model.get_mut(&k).unwrap();
                                    match r.s {
                                        S::Done => Some(Claim::Done),
                                        S::Failed => Some(Claim::Failed { attempts: r.attempts }),
                                        S::InProgress(until) if until > now => {
                                            Some(Claim::InProgress { lease_left: Some(ms(until - now)) })
                                        }
                                        _ => {
                                            r.attempts += 1;
                                            r.s = S::InProgress(now + l);
                                            r.expires = r.expires.max(now + retain);
                                            None
                                        }
                                    }
                                };
                                match (expected, got.unwrap()) {
                                    (None, Claim::Won { token, attempt, .. }) => {
                                        prop_assert_eq!(attempt, model[&k].attempts);
                                        if let Some(old) = tokens.insert(k, token) {
                                            old_tokens.entry(k).or_default().push(old);
                                        }
                                    }
                                    (Some(e), g) => prop_assert_eq!(e, g),
                                    (None, g) => prop_assert!(false, "expected a win, got {:?}", g),
                                }
                            }
                            Op::Complete(k, t) | Op::Fail(k, t) => {
                                let token = tokens.get(&k).copied().unwrap_or(Token::from_u128(0));
                                let got = if matches!(op, Op::Complete(..)) {
                                    store.complete(&key(k), token, ms(t), None).await.unwrap()
                                } else {
                                    store.fail(&key(k), token, ms(t)).await.unwrap()
                                };
                                let applies = holds(&model, k, now, tokens.get(&k));
                                prop_assert_eq!(got == Transition::Applied, applies);
                                if applies {
                                    let r = model.get_mut(&k).unwrap();
                                    r.s = if matches!(op, Op::Complete(..)) { S::Done } else { S::Failed };
                                    r.expires = now + t;
                                    old_tokens.entry(k).or_default().extend(tokens.remove(&k));
                                }
                            }
                            Op::Release(k) => {
                                let token = tokens.get(&k).copied().unwrap_or(Token::from_u128(0));
                                let got = store.release(&key(k), token).await.unwrap();
                                let applies = holds(&model, k, now, tokens.get(&k));
                                prop_assert_eq!(got == Transition::Applied, applies);
                                if applies {
                                    model.get_mut(&k).unwrap().s = S::Released;
                                    old_tokens.entry(k).or_default().extend(tokens.remove(&k));
                                }
                            }
                            Op::Renew(k, l, t) => {
                                let token = tokens.get(&k).copied().unwrap_or(Token::from_u128(0));
                                let got = store.renew(&key(k), token, ms(l), ms(t)).await.unwrap();
                                let applies = holds(&model, k, now, tokens.get(&k));
                                prop_assert_eq!(got == Transition::Applied, applies);
                                if applies {
                                    let r = model.get_mut(&k).unwrap();
                                    r.s = S::InProgress(now + l);
                                    let retain = claim_retention(ms(l), ms(t)).as_millis() as u64;
                                    r.expires = r.expires.max(now + retain);
                                }
                            }
                            Op::Advance(d) => {
                                tokio::time::advance(ms(d)).await;
                                now += d;
                            }
                            Op::Stale(k) => {
                                for &old in old_tokens.get(&k).into_iter().flatten() {
                                    let got = store.complete(&key(k), old, ms(5000), None).await.unwrap();
                                    prop_assert_eq!(got, Transition::LeaseLost);
                                    let got = store.renew(&key(k), old, ms(5000), ms(5000)).await.unwrap();
                                    prop_assert_eq!(got, Transition::LeaseLost);
                                    let got = store.release(&key(k), old).await.unwrap();
                                    prop_assert_eq!(got, Transition::LeaseLost);
                                }
                            }
                            Op::Purge => {
                                store.purge_expired();
                                last_purge = now;
                                let live_count = model.values().filter(|r| r.expires > now).count();
                                prop_assert_eq!(store.len(), live_count);
                                if bound {
                                    prop_assert_eq!(store.held.load(atomic::Ordering::Relaxed), live_count);
                                }
                            }
                        }
                    }
                    Ok(())
                })?;
            }
        }
    }
}
