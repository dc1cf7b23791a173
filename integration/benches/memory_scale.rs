//! `MemoryStore` with 10 million records: memory per record, the cost of a claim and
//! complete while it holds them, and the cost of expiring them all.
//!
//! `cargo bench -p idempotent-integration --bench memory_scale [-- RECORDS]`
//!
//! Tokio's clock is paused (the store's clock), so the fill's own duration does not
//! expire records; times are measured on the wall clock.
//!
//! 1. Fills the store with RECORDS (default 10,000,000) done records of 20-byte keys,
//!    with a ttl of one hour: resident memory per record.
//! 2. 200,000 claim + complete of fresh keys (long ttl) while it holds them: mean and
//!    the slowest single pair.
//! 3. Two hours later (on the paused clock): 1,000,000 more pairs while every write
//!    also drops expired records: mean and the slowest single pair (a sweep that scans
//!    the records held would show here as milliseconds).
//! 4. `purge_expired` of whatever is left.

use std::time::{Duration, Instant};

use idempotent::{Claim, Key, MemoryStore, Store};

fn rss_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: usize = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
    pages * 4096
}

fn key(i: u64) -> Key {
    // 20 bytes of id, like an order number with a prefix.
    Key::new("orders", format!("order:{i:014}")).unwrap()
}

async fn pair(store: &MemoryStore, key: &Key, ttl: Duration) {
    let lease = Duration::from_secs(30);
    let Claim::Won { token, .. } = store.claim(key, lease, ttl, None).await.unwrap() else {
        panic!("fresh key not won")
    };
    let _ = store.complete(key, token, ttl, None).await.unwrap();
}

/// Mean, 99.9th percentile and slowest of `n` pairs on fresh keys from `from`.
async fn timed(store: &MemoryStore, from: u64, n: u64, ttl: Duration) -> String {
    let keys: Vec<Key> = (from..from + n).map(key).collect();
    let mut times = Vec::with_capacity(keys.len());
    let start = Instant::now();
    for key in &keys {
        let one = Instant::now();
        pair(store, key, ttl).await;
        times.push(one.elapsed());
    }
    let mean = start.elapsed() / n as u32;
    times.sort();
    let p999 = times[times.len() * 999 / 1000];
    format!("{mean:.2?} mean, {p999:.2?} p99.9, {:.2?} slowest", times[times.len() - 1])
}

fn main() {
    let records: u64 = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .and_then(|a| a.parse().ok())
        .unwrap_or(10_000_000);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async {
        let store = MemoryStore::new();
        let short = Duration::from_secs(3600);
        let long = Duration::from_secs(4 * 3600);
        let before = rss_bytes();
        let fill = Instant::now();
        for i in 0..records {
            pair(&store, &key(i), short).await;
        }
        let filled = fill.elapsed();
        let per_record = (rss_bytes() - before) as f64 / records as f64;
        println!(
            "fill: {records} records in {:.1} s ({:.0} ns per claim + complete), {per_record:.0} bytes per record resident",
            filled.as_secs_f64(),
            filled.as_nanos() as f64 / records as f64
        );

        let times = timed(&store, records, 200_000, long).await;
        println!("held {}: claim + complete {times}", store.len());

        tokio::time::advance(short * 2).await;
        let held = store.len();
        let times = timed(&store, records + 200_000, 1_000_000, long).await;
        println!(
            "expiring ({held} held, {} expired dropped by 1,000,000 writes): claim + complete {times}",
            held + 1_000_000 - store.len()
        );

        let purge = Instant::now();
        let left = store.len();
        store.purge_expired();
        println!(
            "purge_expired: {} records dropped in {:?}; {} held",
            left - store.len(),
            purge.elapsed(),
            store.len()
        );
    });
}
