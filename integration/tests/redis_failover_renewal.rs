//! With `wait_for_replicas(1, ..)`, a renewal counts only once a replica has it. A
//! renewal the master applied but never replicated is lost at a failover: the
//! promoted master's lease lapsed a lease after the last *replicated* write. Were the
//! consumer to go by that renewal, a second consumer taking the key over on the new
//! master would apply the effect while the first one's body, inside the lease it
//! believes it holds, applied it too (two effects, before renewals waited for the
//! replicas). Here the replica is cut off after the claim, the master killed after
//! the renewals it alone applied, and a second consumer takes the key over on the
//! promoted replica: one effect.

mod support;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use idempotent::testing::block_on;
use idempotent::{Outcome, RedisStore, idempotent};
use support::{RedisSentinels, RedisServer, SENTINEL_SERVICE};
use tokio::sync::Notify;

const PASSWORD: &str = "sentinel-test-secret";

struct Order {
    id: String,
}

#[derive(Debug, thiserror::Error, idempotent::Classify)]
#[error("never")]
#[idempotent(retryable)]
struct Never;

#[derive(Default)]
struct Ledger(Mutex<Vec<&'static str>>);

/// Calls `started`, waits for `go`, then takes effect (recording who did).
#[idempotent(key = "{id}", namespace = "failover-renewal", lease = 6, ttl = 120, store = store)]
async fn apply(
    order: Order,
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

fn authed(server: &RedisServer, args: &[&str]) -> String {
    let mut all = vec!["--no-auth-warning", "-a", PASSWORD];
    all.extend_from_slice(args);
    server.cli(&all)
}

#[test]
fn a_renewal_that_reached_no_replica_does_not_keep_the_body_running_past_a_failover() {
    if !support::have_redis_server() {
        return;
    }
    block_on(async {
        let auth = ["--requirepass", PASSWORD, "--masterauth", PASSWORD];
        let mut args = vec!["--save", "", "--appendonly", "no"];
        args.extend(auth);
        let mut master = RedisServer::start_with(&args);
        let port = master.port.to_string();
        args.extend(["--replicaof", "127.0.0.1", &port]);
        let replica = RedisServer::start_with(&args);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !authed(&replica, &["INFO", "replication"]).contains("master_link_status:up") {
            assert!(Instant::now() < deadline, "the replica never synced");
            std::thread::sleep(Duration::from_millis(50));
        }
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
            let call = apply(Order { id: id.clone() }, &store, &ledger, "first", &started, &go);
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
                match apply(Order { id: id.clone() }, &second, &ledger, "second", &s2, &g2).await {
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
