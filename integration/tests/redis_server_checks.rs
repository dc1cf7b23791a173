//! `RedisStore` against servers set up as users run them: eviction policies of managed
//! services, replicas, ACL users with too few permissions, permissions revoked at run
//! time, and a switchover behind one address. Each test runs `redis-server`s of its
//! own.

mod support;

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use idempotent::testing::block_on;
use idempotent::{Disposition, Error, Outcome, RedisStore, StoreError, idempotent};
use support::{FaultProxy, RedisServer};

struct Order {
    order_id: u64,
}

#[derive(Debug, thiserror::Error, idempotent::Classify)]
#[error("never")]
#[idempotent(retryable)]
struct Never;

/// A handler that counts its runs; a short lease, so a claim left in progress lapses
/// within the test.
#[idempotent(key = "order:{order_id}", store = store, lease = 2)]
async fn counted(msg: Order, store: &RedisStore, runs: &AtomicU32) -> Result<(), Never> {
    let _ = msg;
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(())
}

/// Handles order `order_id` on `store`, which must run its handler.
async fn processed(order_id: u64, store: &RedisStore, runs: &AtomicU32) {
    let answer = counted(Order { order_id }, store, runs).await;
    assert_eq!(answer.unwrap(), Outcome::Processed(()), "order {order_id}");
}

fn misconfigured(answer: Result<RedisStore, StoreError>) -> String {
    match answer {
        Err(StoreError::Misconfigured(reason)) => reason,
        Err(other) => panic!("refused, but not as misconfigured: {other}"),
        Ok(_) => panic!("the store connected"),
    }
}

/// The big managed services default to `volatile-lru`: refused at connect, with the
/// setting named; connected only with `allow_eviction`, whose cost is measured here
/// (and quoted in the README): records evicted under memory pressure, and duplicates
/// of those messages run again.
#[test]
fn an_evicting_server_is_refused_unless_allowed_and_then_duplicates_run_again() {
    if !support::have_redis_server() {
        return;
    }
    let server = RedisServer::start_with(&[
        "--save",
        "",
        "--appendonly",
        "no",
        "--maxmemory",
        "4mb",
        "--maxmemory-policy",
        "volatile-lru",
    ]);
    block_on(async {
        let reason = misconfigured(RedisStore::connect(server.url().as_str()).await);
        assert!(
            reason.contains("maxmemory-policy is volatile-lru")
                && reason.contains("allow_eviction"),
            "{reason}"
        );
        let store = RedisStore::options()
            .allow_eviction()
            .connect(server.url().as_str())
            .await
            .expect("allowed");
        let runs = AtomicU32::new(0);
        let orders = 1_000;
        for order_id in 0..orders {
            processed(order_id, &store, &runs).await;
        }
        // Other data of the application, with expiries, fills the memory.
        let mut conn = store.connection_manager().unwrap();
        let filler = vec![b'x'; 10_000];
        for i in 0..600 {
            let _: Result<(), _> = redis::cmd("SET")
                .arg(format!("cache:{i}"))
                .arg(&filler)
                .arg("PX")
                .arg(600_000)
                .query_async(&mut conn)
                .await;
        }
        let before = runs.load(Ordering::SeqCst);
        for order_id in 0..orders {
            let _ = counted(Order { order_id }, &store, &runs).await.unwrap();
        }
        let again = runs.load(Ordering::SeqCst) - before;
        println!("maxmemory 4mb, volatile-lru: {again} of {orders} duplicates ran again");
        assert!(again > 0, "no record was evicted: the test no longer shows the cost");
    });
}

#[test]
fn a_replica_is_refused_at_connect() {
    if !support::have_redis_server() {
        return;
    }
    let master = RedisServer::start();
    let port = master.port.to_string();
    let replica = RedisServer::start_with(&[
        "--save",
        "",
        "--appendonly",
        "no",
        "--replicaof",
        "127.0.0.1",
        &port,
    ]);
    block_on(async {
        let reason = misconfigured(RedisStore::connect(replica.url().as_str()).await);
        assert!(reason.contains("replica") && reason.contains("master"), "{reason}");
    });
}

/// An ACL user set up as least-privilege users are: each lacking one thing the store
/// needs is refused at connect with what to grant, instead of retrying (or running
/// again) every message.
#[test]
fn acl_users_without_what_the_store_needs_are_refused_at_connect() {
    if !support::have_redis_server() {
        return;
    }
    let server = RedisServer::start();
    let user = |name: &str, rules: &[&str]| {
        let mut args = vec!["ACL", "SETUSER", name, "on", ">secret"];
        args.extend(rules);
        assert!(server.cli(&args).contains("OK"), "ACL SETUSER {name}");
        format!("redis://{name}:secret@127.0.0.1:{}", server.port)
    };
    let no_scripts = user("no-scripts", &["~*", "+@all", "-@scripting"]);
    let no_info = user("no-info", &["~*", "+@all", "-info"]);
    let no_reads = user("no-reads", &["~*", "+@all", "-@read"]);
    let other_keys = user("other-keys", &["~app:*", "+@all"]);
    block_on(async {
        let reason = misconfigured(RedisStore::connect(no_scripts.as_str()).await);
        assert!(reason.contains("+@scripting") && reason.contains("NOPERM"), "{reason}");
        let reason = misconfigured(RedisStore::connect(no_info.as_str()).await);
        assert!(reason.contains("+info"), "{reason}");
        // Claims need no read (`SET NX GET` answers the record), DONE does: a user
        // without reads would run every handler and record nothing.
        let reason = misconfigured(RedisStore::connect(no_reads.as_str()).await);
        assert!(reason.contains("+@read"), "{reason}");
        // Keys outside the user's patterns: a warning at connect, and each claim of
        // such a key refused (retried) before its handler runs.
        let store = RedisStore::connect(other_keys.as_str()).await.expect("a warning only");
        let warnings = store.check().await.unwrap();
        assert!(warnings.iter().any(|w| w.contains("~idempotent:*")), "{warnings:?}");
        let runs = AtomicU32::new(0);
        let refused = counted(Order { order_id: 1 }, &store, &runs).await.unwrap_err();
        assert!(
            matches!(
                &refused,
                Error::Store { error: StoreError::Misconfigured(_), handler_ran: false, .. }
            ),
            "{refused:?}"
        );
        assert_eq!(refused.disposition(), Disposition::Retry);
        assert_eq!(runs.load(Ordering::SeqCst), 0);
        // The same user with the store's prefix inside its key pattern works.
        let store = RedisStore::options().prefix("app").connect(other_keys.as_str()).await;
        let store = store.expect("a prefix the user may write");
        let warnings = store.check().await.unwrap();
        assert!(!warnings.iter().any(|w| w.contains("may not write")), "{warnings:?}");
        processed(1, &store, &runs).await;
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    });
}

/// Scripting revoked while the store runs: the call in flight (its claim needed no
/// script) runs its handler and can't record DONE; from then on every claim is
/// refused as misconfigured, with a retry disposition (never dead-lettered) and no
/// handler run, until the permission is back, when claims resume within the store's
/// recheck interval.
#[test]
fn scripting_revoked_at_run_time_refuses_claims_until_restored() {
    if !support::have_redis_server() {
        return;
    }
    let server = RedisServer::start();
    assert!(server.cli(&["ACL", "SETUSER", "app", "on", ">secret", "~*", "+@all"]).contains("OK"));
    let url = format!("redis://app:secret@127.0.0.1:{}", server.port);
    block_on(async {
        let store = RedisStore::connect(url.as_str()).await.expect("a full user");
        let runs = AtomicU32::new(0);
        processed(1, &store, &runs).await;
        assert!(server.cli(&["ACL", "SETUSER", "app", "-@scripting"]).contains("OK"));
        // In flight when it was revoked: ran, DONE refused, left for a retry.
        let caught = counted(Order { order_id: 2 }, &store, &runs).await.unwrap_err();
        assert!(
            matches!(
                &caught,
                Error::Store { error: StoreError::Misconfigured(_), handler_ran: true, .. }
            ),
            "{caught:?}"
        );
        assert_eq!(caught.disposition(), Disposition::Retry);
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        // From then on nothing runs, nothing is dead-lettered.
        for order_id in 3..10 {
            let refused = counted(Order { order_id }, &store, &runs).await.unwrap_err();
            assert!(
                matches!(
                    &refused,
                    Error::Store { error: StoreError::Misconfigured(_), handler_ran: false, .. }
                ),
                "{refused:?}"
            );
            assert_eq!(refused.disposition(), Disposition::Retry);
        }
        assert_eq!(runs.load(Ordering::SeqCst), 2, "no handler ran while refused");
        assert!(server.cli(&["ACL", "SETUSER", "app", "+@scripting"]).contains("OK"));
        let deadline = Instant::now() + idempotent::redis_store::RECHECK_INTERVAL * 3;
        loop {
            match counted(Order { order_id: 3 }, &store, &runs).await {
                Ok(Outcome::Processed(())) => break,
                Err(Error::Store { error: StoreError::Misconfigured(_), .. }) => {}
                other => panic!("{other:?}"),
            }
            assert!(Instant::now() < deadline, "claims never resumed");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert_eq!(runs.load(Ordering::SeqCst), 3);
        // Order 2's redelivery, after its lease: the run the revocation cost.
        tokio::time::sleep(Duration::from_secs(2)).await;
        processed(2, &store, &runs).await;
        assert_eq!(runs.load(Ordering::SeqCst), 4);
    });
}

/// A switchover behind one address (a virtual IP, a proxy, a DNS name): the old
/// master is demoted to a replica of the new one, and the address now leads to the
/// new master, but the store's open connection still reaches the old one, which
/// answers `READONLY`. The store opens a new connection: claims succeed again within
/// seconds, each handler running once.
#[test]
fn a_switchover_behind_one_address_reaches_the_new_master() {
    if !support::have_redis_server() {
        return;
    }
    let old = RedisServer::start();
    let old_port = old.port.to_string();
    let new = RedisServer::start_with(&[
        "--save",
        "",
        "--appendonly",
        "no",
        "--replicaof",
        "127.0.0.1",
        &old_port,
    ]);
    block_on(async {
        let proxy = FaultProxy::start(old.port).await;
        let store = RedisStore::connect(proxy.url().as_str()).await.expect("the master");
        let runs = AtomicU32::new(0);
        processed(0, &store, &runs).await;
        let deadline = Instant::now() + Duration::from_secs(10);
        while !new.cli(&["INFO", "replication"]).contains("master_link_status:up") {
            assert!(Instant::now() < deadline, "the replica never synced");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(new.cli(&["REPLICAOF", "NO", "ONE"]).contains("OK"));
        assert!(old.cli(&["REPLICAOF", "127.0.0.1", &new.port.to_string()]).contains("OK"));
        proxy.retarget(new.port);
        let started = Instant::now();
        let mut failures = 0;
        for order_id in 1..=20 {
            loop {
                match counted(Order { order_id }, &store, &runs).await {
                    Ok(_) => break,
                    Err(Error::Store { handler_ran: false, .. }) => failures += 1,
                    Err(other) => panic!("order {order_id}: {other:?}"),
                }
                assert!(
                    started.elapsed() < Duration::from_secs(10),
                    "never reached the new master"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        println!("{failures} claims refused before the store reached the new master");
        assert_eq!(runs.load(Ordering::SeqCst), 21, "each handler ran once");
        assert!(new.cli(&["KEYS", "*order:20"]).contains("order:20"), "on the new master");
    });
}

/// A server SIGKILLed and restarted mid-stream: without an append-only file (a
/// warning at connect) every record is gone and every duplicate runs again; with
/// `appendfsync always` (no warning) none does.
#[test]
fn a_restart_loses_the_records_no_append_only_file_kept() {
    if !support::have_redis_server() {
        return;
    }
    for (mut server, persistent) in
        [(RedisServer::start(), false), (RedisServer::start_persistent(), true)]
    {
        block_on(async {
            let store = RedisStore::connect(server.url().as_str()).await.expect("connects");
            let warnings = store.check().await.expect("passes");
            assert_eq!(
                warnings.iter().any(|w| w.contains("append-only")),
                !persistent,
                "{warnings:?}"
            );
            let (runs, orders) = (AtomicU32::new(0), 200);
            for order_id in 0..orders {
                processed(order_id, &store, &runs).await;
            }
            server.kill();
            server.restart();
            let before = runs.load(Ordering::SeqCst);
            for order_id in 0..orders {
                // The first calls may meet the connection the kill cut.
                let deadline = Instant::now() + Duration::from_secs(10);
                while counted(Order { order_id }, &store, &runs).await.is_err() {
                    assert!(Instant::now() < deadline, "Redis never came back");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            let again = runs.load(Ordering::SeqCst) - before;
            println!(
                "appendonly {persistent}: {again} of {orders} duplicates ran again after a restart"
            );
            assert_eq!(again, if persistent { 0 } else { orders as u32 });
        });
    }
}

/// Starts a master and a replica of it that replicates through `link` (a proxy the
/// test can make swallow the replication stream), and waits until it has synced.
async fn master_and_replica() -> (RedisServer, RedisServer, FaultProxy) {
    let master = RedisServer::start();
    let link = FaultProxy::start(master.port).await;
    let port = link.port.to_string();
    let replica = RedisServer::start_with(&[
        "--save",
        "",
        "--appendonly",
        "no",
        "--replicaof",
        "127.0.0.1",
        &port,
    ]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !replica.cli(&["INFO", "replication"]).contains("master_link_status:up") {
        assert!(Instant::now() < deadline, "the replica never synced");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (master, replica, link)
}

/// A failover to an asynchronous replica that had not received the last writes (its
/// link stopped delivering): without waiting for replicas, the master acknowledged
/// every DONE, died, and each duplicate of the orders handled meanwhile ran again on
/// the promoted replica; with `wait_for_replicas`, a claim the replica did not confirm
/// is refused before its handler runs (and retried once the link is back), and no
/// duplicate runs again.
#[test]
fn waiting_for_a_replica_keeps_every_record_through_a_failover() {
    if !support::have_redis_server() {
        return;
    }
    for wait in [false, true] {
        block_on(async {
            let (mut master, replica, link) = master_and_replica().await;
            let options = RedisStore::options();
            let options = if wait {
                options.wait_for_replicas(1, Duration::from_millis(300))
            } else {
                options
            };
            let store = options.connect(master.url().as_str()).await.expect("the master");
            let (runs, orders) = (AtomicU32::new(0), 100);
            for order_id in 0..orders / 2 {
                processed(order_id, &store, &runs).await;
            }
            // The replica has everything so far; then its link stops delivering.
            caught_up(&master);
            link.swallow();
            let mut refused = 0;
            for order_id in orders / 2..orders {
                loop {
                    match counted(Order { order_id }, &store, &runs).await {
                        Ok(processed) => {
                            assert_eq!(processed, Outcome::Processed(()));
                            break;
                        }
                        Err(Error::Store { handler_ran: false, .. }) if wait => {
                            refused += 1;
                            // The link comes back; the replica resyncs.
                            link.release();
                        }
                        Err(other) => panic!("order {order_id}: {other:?}"),
                    }
                }
            }
            assert_eq!(runs.load(Ordering::SeqCst), orders as u32, "each handler ran once");
            if wait {
                assert_eq!(refused, 1, "the claim the replica did not confirm");
            }
            // The master dies; the replica is promoted.
            master.kill();
            assert!(replica.cli(&["REPLICAOF", "NO", "ONE"]).contains("OK"));
            let promoted = RedisStore::connect(replica.url().as_str()).await.expect("promoted");
            let before = runs.load(Ordering::SeqCst);
            for order_id in 0..orders {
                let _ = counted(Order { order_id }, &promoted, &runs).await.unwrap();
            }
            let again = runs.load(Ordering::SeqCst) - before;
            println!(
                "wait_for_replicas {wait}: {again} of {orders} duplicates ran again after the failover"
            );
            if wait {
                assert_eq!(again, 0);
            } else {
                assert_eq!(again, orders as u32 / 2, "the writes the replica never received");
            }
        });
    }
}

/// Waits until `master`'s replica acknowledged every write so far.
fn caught_up(master: &RedisServer) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let info = master.cli(&["INFO", "replication"]);
        let field = |name: &str| {
            info.split(['\n', ',', '\r'])
                .find_map(|part| part.strip_prefix(name))
                .map(str::to_owned)
        };
        if field("master_repl_offset:").is_some()
            && field("master_repl_offset:") == field("offset=")
        {
            return;
        }
        assert!(Instant::now() < deadline, "the replica never caught up: {info}");
        std::thread::sleep(Duration::from_millis(20));
    }
}
