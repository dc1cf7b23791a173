//! ZooKeeper's TTL reaper under sustained load: new keys at a fixed rate through
//! `#[idempotent]` on a ZooKeeper server of the bench's own (reaper scans every
//! second), each key delivered again 3 s later (inside its 10 s window), and one in
//! ten coming back after its window at 15 s, 72 s (when the reaper may just have
//! listed its znode) or 90 s, then delivered again 3 s after that. It reports, every
//! 30 s, the znodes, the data size and the server's resident memory read from the
//! server (`mntr`, `/proc`), and at the end the runs that came inside a window of
//! an earlier run of the same key (duplicates: must be 0).
//!
//! `cargo bench -p idempotent-integration --bench zookeeper_reaper_load` (Debian's
//! `zookeeper` package). `ZK_LOAD_RATE` new keys a second (500), `ZK_LOAD_SECS` how
//! long (300), `ZK_LOAD_PER_MINUTE` the reaper's `znode.container.maxPerMinute`
//! (120000; ZooKeeper's default is 10000).

#[path = "../tests/support/zookeeper.rs"]
mod zookeeper_server;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use idempotent::{ZooKeeperStore, idempotent};
use zookeeper_server::ZooKeeperServer;

/// Each record's window, in seconds.
const TTL: u64 = 10;
/// Deliveries are scheduled in ticks of 100 ms.
const TICK: Duration = Duration::from_millis(100);

static STORE: OnceLock<ZooKeeperStore> = OnceLock::new();
/// When each key's handler last ran.
static LAST_RUN: OnceLock<Mutex<HashMap<u64, Instant>>> = OnceLock::new();
static RUNS: AtomicU64 = AtomicU64::new(0);
static DUPLICATES: AtomicU64 = AtomicU64::new(0);
static ERRORS: AtomicU64 = AtomicU64::new(0);

struct Msg {
    id: u64,
}

#[derive(Debug, thiserror::Error, idempotent::Classify)]
#[error("never")]
#[idempotent(retryable)]
struct Never;

#[idempotent(key = "{id}", namespace = "reaper", ttl = 10, lease = 5, store = store)]
async fn handler(msg: Msg, store: &ZooKeeperStore) -> Result<(), Never> {
    RUNS.fetch_add(1, Ordering::Relaxed);
    let now = Instant::now();
    let earlier = LAST_RUN.get().unwrap().lock().unwrap().insert(msg.id, now);
    // A window starts when DONE is written, after the run: a run less than TTL
    // after the last one came inside that run's window.
    if earlier.is_some_and(|at| now.duration_since(at) < Duration::from_secs(TTL)) {
        DUPLICATES.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The keys of `tick` that are delivered (again) `ticks_ago` ticks later.
fn due(tick: u64, per_tick: u64, ticks_ago: u64, filter: impl Fn(u64) -> bool) -> Vec<u64> {
    if tick < ticks_ago {
        return Vec::new();
    }
    let first = (tick - ticks_ago) * per_tick;
    (first..first + per_tick).filter(|id| filter(id % 10)).collect()
}

#[tokio::main]
async fn main() {
    if std::env::args().any(|a| a == "--list" || a == "--test") {
        return; // `cargo test --benches` probes bench binaries; nothing to list.
    }
    let rate = env("ZK_LOAD_RATE", 500);
    let seconds = env("ZK_LOAD_SECS", 300);
    let per_minute = env("ZK_LOAD_PER_MINUTE", 120_000);
    let per_tick = (rate / 10).max(1);
    let server = ZooKeeperServer::start_with(&[
        "-Dznode.container.checkIntervalMs=1000",
        &format!("-Dznode.container.maxPerMinute={per_minute}"),
    ])
    .expect("ZooKeeper (apt-get install zookeeper)");
    let store =
        zookeeper_server::connect(&server.hosts(), "/reaper-load", Duration::from_secs(10)).await;
    STORE.set(store).ok().unwrap();
    LAST_RUN.set(Mutex::new(HashMap::new())).ok().unwrap();
    println!(
        "{rate} new keys/s for {seconds} s, ttl {TTL} s, reaper every 1 s at most {per_minute} deletions a minute"
    );
    println!("| s | deliveries | runs | znodes | data size (KiB) | resident (MiB) | behind (s) |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");

    let in_flight = Arc::new(tokio::sync::Semaphore::new(256));
    let delivered = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let ticks = seconds * 10;
    let mut peak_znodes = 0u64;
    // New keys and keys back after their window run; deliveries inside a window don't.
    let mut expected_runs = 0u64;
    for tick in 0..ticks {
        let mut ids = due(tick, per_tick, 0, |_| true);
        expected_runs += ids.len() as u64;
        ids.extend(due(tick, per_tick, 30, |_| true));
        for (back, class) in [(150, 0), (720, 1), (900, 2)] {
            let returning = due(tick, per_tick, back, |c| c == class);
            expected_runs += returning.len() as u64;
            ids.extend(returning);
            ids.extend(due(tick, per_tick, back + 30, |c| c == class));
        }
        for id in ids {
            let permit = in_flight.clone().acquire_owned().await.unwrap();
            let delivered = delivered.clone();
            tokio::spawn(async move {
                if handler(Msg { id }, STORE.get().unwrap()).await.is_err() {
                    ERRORS.fetch_add(1, Ordering::Relaxed);
                }
                delivered.fetch_add(1, Ordering::Relaxed);
                drop(permit);
            });
        }
        if (tick + 1) % 300 == 0 {
            let mntr = server.mntr();
            let figure = |name: &str| mntr.get(name).and_then(|v| v.parse::<u64>().ok());
            let znodes = figure("zk_znode_count").unwrap_or(0);
            peak_znodes = peak_znodes.max(znodes);
            let behind = start.elapsed().as_secs_f64() - (tick + 1) as f64 / 10.0;
            println!(
                "| {} | {} | {} | {znodes} | {} | {} | {:.1} |",
                (tick + 1) / 10,
                delivered.load(Ordering::Relaxed),
                RUNS.load(Ordering::Relaxed),
                figure("zk_approximate_data_size").unwrap_or(0) / 1024,
                server.resident_kib().unwrap_or(0) / 1024,
                behind.max(0.0),
            );
        }
        let next = start + TICK * (tick as u32 + 1);
        tokio::time::sleep_until(next.into()).await;
    }
    let _ = in_flight.acquire_many(256).await;
    let elapsed = start.elapsed().as_secs_f64();
    println!(
        "\n{} deliveries in {elapsed:.0} s ({:.0}/s), {} runs ({expected_runs} expected), {} errors, peak {peak_znodes} znodes, \
         duplicates (a run inside an earlier run's window): {}",
        delivered.load(Ordering::Relaxed),
        delivered.load(Ordering::Relaxed) as f64 / elapsed,
        RUNS.load(Ordering::Relaxed),
        ERRORS.load(Ordering::Relaxed),
        DUPLICATES.load(Ordering::Relaxed),
    );
    assert_eq!(DUPLICATES.load(Ordering::Relaxed), 0, "a handler ran again inside its window");
}
