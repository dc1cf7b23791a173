//! `RedisStore` through a failover: Redis Sentinel (a master, replicas and three
//! Sentinels of the test's own on loopback) and a Redis Cluster with replicas. A
//! master's process is SIGKILLed while messages are being handled, a replica is
//! promoted, and the same store follows. Judged from outside the store: the handlers'
//! runs counted per order, and the records read back from the promoted master with
//! `redis-cli`.

mod support;

use std::collections::HashSet;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotent::testing::block_on;
use idempotent::{Error, Outcome, RedisStore, idempotent};
use support::{RedisCluster, RedisSentinels, RedisServer, SENTINEL_SERVICE};
use tokio::sync::Notify;

const PASSWORD: &str = "sentinel-test-secret";

struct Order {
    order_id: u64,
}

#[derive(Debug, thiserror::Error, idempotent::Classify)]
#[error("never")]
#[idempotent(retryable)]
struct Never;

/// Counts each order's runs in `runs` (indexed by order id). A short lease, so a claim
/// whose DONE was lost with the master lapses within the test.
#[idempotent(key = "order:{order_id}", store = store, lease = 2)]
async fn counted(msg: Order, store: &RedisStore, runs: &[AtomicU32]) -> Result<(), Never> {
    runs[msg.order_id as usize].fetch_add(1, Ordering::SeqCst);
    Ok(())
}

/// A master and `replicas` replicas of it, all asking for `PASSWORD`, synced.
fn master_and_replicas(replicas: usize) -> (RedisServer, Vec<RedisServer>) {
    let auth = ["--requirepass", PASSWORD, "--masterauth", PASSWORD];
    let mut args = vec!["--save", "", "--appendonly", "no"];
    args.extend(auth);
    let master = RedisServer::start_with(&args);
    let port = master.port.to_string();
    args.extend(["--replicaof", "127.0.0.1", &port]);
    let replicas: Vec<_> = (0..replicas).map(|_| RedisServer::start_with(&args)).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    for replica in &replicas {
        while !authed(replica, &["INFO", "replication"]).contains("master_link_status:up") {
            assert!(Instant::now() < deadline, "the replica never synced");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    (master, replicas)
}

fn authed(server: &RedisServer, args: &[&str]) -> String {
    let mut all = vec!["--no-auth-warning", "-a", PASSWORD];
    all.extend_from_slice(args);
    server.cli(&all)
}

/// Delivers `order_id` until the store answers (as a broker redelivers a message its
/// consumer did not ack), for up to three minutes (a failover and a replica's resync
/// on a loaded machine). Returns whether an attempt ran the
/// handler but could not record DONE (the master died under it).
async fn deliver(order_id: u64, store: &RedisStore, runs: &[AtomicU32]) -> bool {
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut done_lost = false;
    loop {
        match counted(Order { order_id }, store, runs).await {
            Ok(Outcome::Processed(()) | Outcome::Duplicate) => return done_lost,
            Ok(Outcome::InProgress { .. }) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Ok(other) => panic!("order {order_id}: {other:?}"),
            Err(Error::Store { handler_ran, .. }) if Instant::now() < deadline => {
                done_lost |= handler_ran;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(other) => panic!("order {order_id}: {other:?}"),
        }
    }
}

/// Waits until the Sentinels name a master other than `old`, and returns its port.
fn promoted(sentinels: &RedisSentinels, old: u16) -> u16 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let port = sentinels.master_port();
        if port != old {
            return port;
        }
        assert!(Instant::now() < deadline, "the Sentinels never promoted the replica");
        std::thread::sleep(Duration::from_millis(100));
    }
}

const ORDERS: u64 = 300;

/// What four consumers did with `ORDERS` orders, `fail` starting after 100 were
/// acknowledged.
struct Consumed {
    runs: Arc<Vec<AtomicU32>>,
    /// The orders an attempt of which ran the handler but could not record DONE.
    done_lost: HashSet<u64>,
    acked_at_fault: u64,
    /// From the fault until the last order was handled.
    handled_after: Duration,
}

async fn consume_through(
    store: &RedisStore,
    fail: impl std::future::Future<Output = ()>,
) -> Consumed {
    let runs: Arc<Vec<AtomicU32>> = Arc::new((0..ORDERS).map(|_| AtomicU32::new(0)).collect());
    let (next, acked) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let done_lost = Arc::new(Mutex::new(HashSet::new()));
    let consumers: Vec<_> = (0..4)
        .map(|_| {
            let (store, runs, next, acked, done_lost) =
                (store.clone(), runs.clone(), next.clone(), acked.clone(), done_lost.clone());
            tokio::spawn(async move {
                loop {
                    let order_id = next.fetch_add(1, Ordering::SeqCst);
                    if order_id >= ORDERS {
                        return;
                    }
                    if deliver(order_id, &store, &runs).await {
                        done_lost.lock().unwrap().insert(order_id);
                    }
                    acked.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
        })
        .collect();
    while acked.load(Ordering::SeqCst) < 100 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let failed = Instant::now();
    let acked_at_fault = acked.load(Ordering::SeqCst);
    fail.await;
    for consumer in consumers {
        consumer.await.unwrap();
    }
    let done_lost = done_lost.lock().unwrap().clone();
    Consumed { runs, done_lost, acked_at_fault, handled_after: failed.elapsed() }
}

/// Every order handled, none acknowledged ran twice, and no duplicate runs now.
async fn judge(store: &RedisStore, consumed: &Consumed, failover: &str) {
    let runs = &consumed.runs;
    println!(
        "{failover}: {} orders acked at the kill, all {ORDERS} handled {:.1} s after it",
        consumed.acked_at_fault,
        consumed.handled_after.as_secs_f64()
    );
    let before: u32 = runs.iter().map(|r| r.load(Ordering::SeqCst)).sum();
    for order_id in 0..ORDERS {
        assert_eq!(counted(Order { order_id }, store, runs).await.unwrap(), Outcome::Duplicate);
    }
    let after: u32 = runs.iter().map(|r| r.load(Ordering::SeqCst)).sum();
    assert_eq!(after, before, "a duplicate ran after the failover");

    let twice: Vec<u64> =
        (0..ORDERS).filter(|&id| runs[id as usize].load(Ordering::SeqCst) > 1).collect();
    for order_id in &twice {
        assert!(
            consumed.done_lost.contains(order_id),
            "order {order_id} ran twice though its DONE was recorded"
        );
    }
    assert!(twice.len() <= 4, "more orders ran twice than were in flight: {twice:?}");
    assert!((0..ORDERS).all(|id| runs[id as usize].load(Ordering::SeqCst) >= 1));
    println!("{failover}: ran twice (in flight at the kill, DONE lost with the master): {twice:?}");
}

/// Four consumers handle 300 orders through a store connected by Sentinel with
/// `wait_for_replicas(1, ..)` to a master with two replicas (so one is left to
/// confirm writes after a failover); the master is SIGKILLed after 100 were
/// acknowledged. The same store follows the failover; every order is handled, and
/// none acknowledged before or after ran twice. The only orders run twice are those
/// whose handler ran while the master died, so their DONE was never recorded: a
/// broker redelivers them, as after a consumer crash.
#[test]
fn a_sentinel_failover_mid_consumption_runs_no_acknowledged_order_twice() {
    if !support::have_redis_server() {
        return;
    }
    block_on(async {
        let (mut master, replicas) = master_and_replicas(2);
        let sentinels = RedisSentinels::start(master.port, Some(PASSWORD));
        let store = RedisStore::options()
            .master_credentials("default", PASSWORD)
            .wait_for_replicas(1, Duration::from_millis(500))
            .sentinel(sentinels.urls(), SENTINEL_SERVICE)
            .await
            .expect("the master, through the Sentinels");
        let old = master.port;
        let consumed = consume_through(&store, async { master.kill() }).await;
        let new = promoted(&sentinels, old);
        let replica = replicas.iter().find(|r| r.port == new).expect("a replica was promoted");
        judge(&store, &consumed, "Sentinel failover").await;

        // From outside: the promoted master holds one record per order, and is a master.
        assert!(authed(replica, &["ROLE"]).starts_with("master"));
        assert_eq!(authed(replica, &["DBSIZE"]).trim(), ORDERS.to_string());
    });
}

/// The same through a Redis Cluster of three masters with a replica each: one master
/// is SIGKILLed, the Cluster promotes its replica, and a supervisor restarts the
/// killed node (empty), which rejoins as the new master's replica, so writes to its
/// slots can be confirmed again. The Cluster connection follows the new slot map.
#[test]
fn a_cluster_failover_mid_consumption_runs_no_acknowledged_order_twice() {
    if !support::have_redis_server() {
        return;
    }
    let mut cluster = RedisCluster::with_replicas();
    block_on(async {
        let store = RedisStore::options()
            .wait_for_replicas(1, Duration::from_millis(500))
            .cluster(cluster.urls())
            .await
            .expect("the Cluster");
        let victim = cluster
            .nodes
            .iter()
            .position(|node| node.cli(&["ROLE"]).starts_with("master"))
            .expect("a master");
        let port = cluster.nodes[victim].port;
        let replica = cluster
            .nodes
            .iter()
            .find(|node| {
                node.cli(&["INFO", "replication"]).contains(&format!("master_port:{port}"))
            })
            .expect("the master's replica")
            .port;
        let fail = async {
            cluster.nodes[victim].kill();
            let deadline = Instant::now() + Duration::from_secs(30);
            while !support::cli(replica, &["ROLE"]).starts_with("master") {
                assert!(Instant::now() < deadline, "the Cluster never promoted the replica");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            cluster.nodes[victim].restart();
        };
        let consumed = consume_through(&store, fail).await;
        judge(&store, &consumed, "Cluster failover").await;

        // From outside: the masters hold one record per order between them.
        let records: u64 = cluster
            .nodes
            .iter()
            .filter(|node| node.cli(&["ROLE"]).starts_with("master"))
            .map(|node| node.cli(&["DBSIZE"]).trim().parse::<u64>().unwrap())
            .sum();
        assert_eq!(records, ORDERS);
    });
}

/// The replica stops receiving (its link is cut and can't log in again), orders go on
/// being handled, then the master is SIGKILLed and the Sentinels promote the replica;
/// the old master is restarted (empty) as a replica of the promoted one. Without
/// waiting for replicas, the orders the old master acknowledged meanwhile are
/// lost with it and each of their duplicates runs again; with `wait_for_replicas`
/// their claims are refused before any handler runs, and none runs again.
#[test]
fn without_waiting_a_sentinel_failover_loses_what_the_replica_had_not_received() {
    if !support::have_redis_server() {
        return;
    }
    for wait in [false, true] {
        block_on(async {
            let (mut master, mut replicas) = master_and_replicas(1);
            let replica = replicas.remove(0);
            let sentinels = RedisSentinels::start(master.port, Some(PASSWORD));
            let options = RedisStore::options().master_credentials("default", PASSWORD);
            let options = if wait {
                // Short, so the 25 refusals below keep the replica's link down for less
                // than the ten `down-after` periods past which the Sentinels would no
                // longer promote it.
                options.wait_for_replicas(1, Duration::from_millis(100))
            } else {
                options
            };
            let store = options.sentinel(sentinels.urls(), SENTINEL_SERVICE).await.unwrap();
            let runs: Vec<AtomicU32> = (0..75).map(|_| AtomicU32::new(0)).collect();
            for order_id in 0..25 {
                deliver(order_id, &store, &runs).await;
            }
            // The replica can't log in again once its link is cut.
            assert!(authed(&replica, &["CONFIG", "SET", "masterauth", "wrong"]).contains("OK"));
            authed(&master, &["CLIENT", "KILL", "TYPE", "replica"]);
            let deadline = Instant::now() + Duration::from_secs(10);
            while !authed(&master, &["INFO", "replication"]).contains("connected_slaves:0") {
                assert!(Instant::now() < deadline, "the replica stayed connected");
                std::thread::sleep(Duration::from_millis(20));
            }
            let (mut refused, cut_at) = (0, Instant::now());
            for order_id in 25..50 {
                match counted(Order { order_id }, &store, &runs).await {
                    Ok(Outcome::Processed(())) => assert!(!wait, "the replica confirmed nothing"),
                    Err(Error::Store { handler_ran: false, .. }) if wait => refused += 1,
                    other => panic!("order {order_id}: {other:?}"),
                }
            }
            let ran_before: u32 = runs.iter().map(|r| r.load(Ordering::SeqCst)).sum();
            assert_eq!(ran_before, if wait { 25 } else { 50 });
            assert_eq!(refused, if wait { 25 } else { 0 });
            println!("wait_for_replicas {wait}: link down {:?} before the kill", cut_at.elapsed());

            let old = master.port;
            master.kill();
            // Its master gone, the replica may log in again: a second failover on a
            // loaded machine (the promoted replica slow to answer the Sentinels while
            // it syncs the restarted server) makes it a replica once more.
            assert!(authed(&replica, &["CONFIG", "SET", "masterauth", PASSWORD]).contains("OK"));
            let consumer = async {
                let first = if wait { 25 } else { 50 };
                for order_id in first..75 {
                    deliver(order_id, &store, &runs).await;
                }
            };
            // A supervisor restarts the old master once the replica took over (its
            // data is gone: no persistence), as a replica of the master the Sentinels
            // name, which lets a write be confirmed again.
            let restarted = async {
                while sentinels.master_port() == old {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                master.restart_replica_of(sentinels.master_port());
            };
            let both = async { tokio::join!(consumer, restarted) };
            if tokio::time::timeout(Duration::from_secs(150), both).await.is_err() {
                panic!(
                    "the orders were not all handled within 150 s after the failover.\n\
                     Sentinel: {}\nold master: {}\nreplica: {}",
                    sentinels.nodes[0].cli(&["SENTINEL", "MASTER", SENTINEL_SERVICE]),
                    authed(&master, &["INFO", "replication"]),
                    authed(&replica, &["INFO", "replication"]),
                );
            }
            // The replica was promoted (`restarted` waited for it); a second failover
            // may have made the restarted server the master since, synced from it.
            let before: u32 = runs.iter().map(|r| r.load(Ordering::SeqCst)).sum();
            for order_id in 0..75 {
                deliver(order_id, &store, &runs).await;
            }
            let again = runs.iter().map(|r| r.load(Ordering::SeqCst)).sum::<u32>() - before;
            println!(
                "Sentinel, wait_for_replicas {wait}: {again} of 75 duplicates ran again after the failover"
            );
            if wait {
                assert_eq!(again, 0);
                assert!(runs.iter().all(|r| r.load(Ordering::SeqCst) == 1), "each order ran once");
            } else {
                assert_eq!(again, 25, "the orders the replica never received");
            }
            assert_eq!(authed(&replica, &["DBSIZE"]).trim(), "75");
        });
    }
}

/// A message held by [`apply`] while a failover happens under it.
struct Claimed {
    id: String,
}

#[derive(Default)]
struct Ledger(Mutex<Vec<&'static str>>);

/// Calls `started`, waits for `go`, then takes effect (recording who did).
#[idempotent(key = "{id}", namespace = "failover-renewal", lease = 6, ttl = 120, store = store)]
async fn apply(
    order: Claimed,
    store: &RedisStore,
    ledger: &Ledger,
    who: &'static str,
    started: &Notify,
    go: &Notify,
) -> Result<(), Never> {
    started.notify_one();
    go.notified().await;
    ledger.0.lock().unwrap().push(who);
    Ok(())
}

/// With `wait_for_replicas(1, ..)`, a renewal counts only once a replica has it. A
/// renewal the master applied but never replicated is lost at a failover: the
/// promoted master's lease lapsed a lease after the last *replicated* write. Were the
/// consumer to go by that renewal, a second consumer taking the key over on the new
/// master would apply the effect while the first one's body, inside the lease it
/// believes it holds, applied it too (two effects, before renewals waited for the
/// replicas). Here the replica is cut off after the claim, the master killed after
/// the renewals it alone applied, and a second consumer takes the key over on the
/// promoted replica: one effect.
#[test]
fn a_renewal_that_reached_no_replica_does_not_keep_the_body_running_past_a_failover() {
    if !support::have_redis_server() {
        return;
    }
    block_on(async {
        let (mut master, mut replicas) = master_and_replicas(1);
        let replica = replicas.pop().expect("one replica");
        let sentinels = RedisSentinels::start(master.port, Some(PASSWORD));
        let store = RedisStore::options()
            .master_credentials("default", PASSWORD)
            .wait_for_replicas(1, Duration::from_millis(300))
            .sentinel(sentinels.urls(), SENTINEL_SERVICE)
            .await
            .expect("the master, through the Sentinels");

        let ledger = Ledger::default();
        let id = format!("order-{}", std::process::id());
        let (started, go) = (Notify::new(), Notify::new());
        let first = async {
            let call = apply(Claimed { id: id.clone() }, &store, &ledger, "first", &started, &go);
            tokio::time::timeout(Duration::from_secs(60), call).await
        };
        let attack = async {
            started.notified().await;
            let claimed = Instant::now();
            // The claim was confirmed by the replica; now the replica stops receiving.
            assert!(authed(&replica, &["CONFIG", "SET", "masterauth", "wrong"]).contains("OK"));
            authed(&master, &["CLIENT", "KILL", "TYPE", "replica"]);
            while !authed(&master, &["INFO", "replication"]).contains("connected_slaves:0") {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            // Renewals at 2, 4, 6, 8 s are applied by the master only. Kill it just
            // after the one at 8 s: the first consumer holds the key until ~14 s.
            tokio::time::sleep_until((claimed + Duration::from_millis(8_400)).into()).await;
            master.kill();
            let killed = Instant::now();
            while !authed(&replica, &["ROLE"]).starts_with("master") {
                assert!(killed.elapsed() < Duration::from_secs(30), "no failover");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            println!("promoted {:?} after the claim", claimed.elapsed());
            // A second consumer, on the promoted master.
            let url = format!("redis://:{PASSWORD}@127.0.0.1:{}", replica.port);
            let second = RedisStore::connect(url).await.expect("the promoted master");
            let (s2, g2) = (Notify::new(), Notify::new());
            g2.notify_one();
            let out = loop {
                match apply(Claimed { id: id.clone() }, &second, &ledger, "second", &s2, &g2).await
                {
                    Ok(Outcome::InProgress { .. }) => {
                        tokio::time::sleep(Duration::from_millis(20)).await
                    }
                    other => break other,
                }
            };
            println!("second consumer: {out:?} at {:?} after the claim", claimed.elapsed());
            go.notify_one();
        };
        let (first, ()) = tokio::join!(first, attack);
        println!("first consumer: {first:?}");
        let effects = ledger.0.lock().unwrap().clone();
        println!("effects: {effects:?}");
        assert!(
            !matches!(first, Ok(Ok(Outcome::Processed(())))) || effects.len() == 1,
            "both processed"
        );
        assert_eq!(effects.len(), 1, "expected one effect for the key, got {effects:?}");
    });
}
