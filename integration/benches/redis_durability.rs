//! What waiting for durability costs: messages per second through `#[idempotent]` on a
//! Redis master with one replica (both `redis-server` processes of the bench's own, on
//! loopback, the master with `appendonly yes` and `appendfsync everysec`), at
//! concurrency 1 and 64, without waiting, with `wait_for_replicas(1, …)` (`WAIT`) and
//! with `wait_for_local_fsync` too (`WAITAOF`, Redis 7.2 or newer; skipped before).
//!
//! `cargo bench -p idempotent-integration --bench redis_durability` (`redis-server` on
//! the `PATH`).

mod load;

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use load::{median, throughput};

use idempotent::{RedisStore, Token, idempotent};

const ROUNDS: usize = 3;

static STORES: OnceLock<Vec<RedisStore>> = OnceLock::new();
static NEXT: AtomicU64 = AtomicU64::new(0);

struct Msg {
    id: u64,
}

#[derive(Debug, thiserror::Error, idempotent::Classify)]
#[error("never")]
#[idempotent(retryable)]
struct Never;

#[idempotent(key = "{id}", namespace = "durability", ttl = 60, lease = 30, store = store)]
async fn handler(msg: Msg, store: &RedisStore) -> Result<u64, Never> {
    Ok(msg.id)
}

/// A `redis-server` of the bench's own, killed when dropped.
struct Server {
    port: u16,
    child: Child,
    dir: std::path::PathBuf,
}

impl Server {
    fn start(extra: &[&str]) -> Server {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let dir = std::env::temp_dir().join(format!("idempotent-bench-redis-{port}"));
        std::fs::create_dir_all(&dir).unwrap();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", ""])
            .arg("--dir")
            .arg(&dir)
            .args(extra)
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server on the PATH");
        let server = Server { port, child, dir };
        let deadline = Instant::now() + Duration::from_secs(10);
        while server.cli(&["PING"]) != "PONG" {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("redis-cli");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::main]
async fn main() {
    if std::env::args().any(|a| a == "--list" || a == "--test") {
        return; // `cargo test --benches` probes bench binaries; nothing to list.
    }
    let master = Server::start(&["--appendonly", "yes", "--appendfsync", "everysec"]);
    let port = master.port.to_string();
    let replica = Server::start(&["--appendonly", "no", "--replicaof", "127.0.0.1", &port]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !replica.cli(&["INFO", "replication"]).contains("master_link_status:up") {
        assert!(Instant::now() < deadline, "the replica never synced");
        std::thread::sleep(Duration::from_millis(50));
    }
    let timeout = Duration::from_secs(1);
    let url = master.url();
    let mut stores = vec![
        ("no waiting", RedisStore::connect(url.as_str()).await.expect("master")),
        (
            "wait_for_replicas(1)",
            RedisStore::options()
                .wait_for_replicas(1, timeout)
                .connect(url.as_str())
                .await
                .expect("master"),
        ),
    ];
    match RedisStore::options()
        .wait_for_replicas(1, timeout)
        .wait_for_local_fsync(timeout)
        .connect(url.as_str())
        .await
    {
        Ok(store) => stores.push(("and wait_for_local_fsync", store)),
        Err(error) => eprintln!("WAITAOF skipped: {error}"),
    }
    let names: Vec<&str> = stores.iter().map(|(name, _)| *name).collect();
    STORES.set(stores.into_iter().map(|(_, store)| store).collect()).ok().unwrap();
    NEXT.store((Token::random().as_u128() as u64) & !((1 << 48) - 1), Ordering::Relaxed);

    let header: Vec<String> = names.iter().map(|name| format!("{name} msg/s")).collect();
    println!("| concurrency | {} |", header.join(" | "));
    println!("|{}", " --- |".repeat(names.len() + 1));
    for (concurrency, total) in [(1usize, 2_000u64), (64, 20_000)] {
        let mut row = Vec::new();
        for store in 0..names.len() {
            let mut rates = Vec::new();
            for _ in 0..ROUNDS {
                let base = NEXT.fetch_add(1 << 32, Ordering::Relaxed);
                rates.push(
                    throughput(concurrency, total, move |i| async move {
                        let on = &STORES.get().unwrap()[store];
                        let out = handler(Msg { id: base + i }, on).await.expect("processed");
                        assert!(out.is_processed());
                    })
                    .await,
                );
            }
            row.push(format!("{:.0}", median(rates)));
        }
        println!("| {concurrency} | {} |", row.join(" | "));
    }
}
