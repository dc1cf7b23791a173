//! `ZooKeeperStore` and ZooKeeper's TTL reaper, on servers of the test's own.
//!
//! The reaper lists the TTL znodes whose TTL ran out and that have no children once
//! per scan (`znode.container.checkIntervalMs`), then deletes them one by one at most
//! `znode.container.maxPerMinute` a minute, checking only, at each delete, that the
//! znode still has no children. A record written over a znode such a scan listed is
//! deleted with it unless it has a child when its turn comes.

#[path = "support/zookeeper.rs"]
mod zookeeper;

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use idempotent::testing::block_on;
use idempotent::{Key, Outcome, ZooKeeperStore, idempotent};
use sha2::{Digest, Sha256};
use zookeeper::ZooKeeperServer;
use zookeeper_client as zk;

struct Order {
    id: u32,
}

#[derive(Debug, thiserror::Error, idempotent::Classify)]
#[error("never")]
#[idempotent(retryable)]
struct Never;

#[idempotent(key = "order:{id}", namespace = "reaper", store = store, ttl = "1h")]
async fn charge(msg: Order, store: &ZooKeeperStore, charges: &AtomicU32) -> Result<(), Never> {
    charges.fetch_add(1, Ordering::SeqCst);
    Ok(())
}

/// The path of `key`'s record under `root`: `{root}/{first byte of the stored key's
/// SHA-256, in hex}/{stored key in hex}` (the store's module documentation).
fn record_path(root: &str, key: &Key) -> String {
    let stored = key.stored();
    let hex: String = stored.iter().map(|b| format!("{b:02x}")).collect();
    format!("{root}/{:02x}/{hex}", Sha256::digest(&stored)[0])
}

fn ttl_node(ttl: Duration) -> zk::CreateOptions<'static> {
    zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all()).with_ttl(ttl)
}

async fn create_path(client: &zk::Client, path: &str) {
    let parents = path.match_indices('/').skip(1).map(|(at, _)| &path[..at]);
    for node in parents.chain([path]) {
        let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        match client.create(node, b"", &persistent).await {
            Ok(_) | Err(zk::Error::NodeExists) => {}
            Err(e) => panic!("creating {node}: {e}"),
        }
    }
}

/// A key comes back after its window, while the reaper still has the znode of its
/// expired record in its queue (behind 40 others, deleted 10 a second). The store
/// takes the key and records DONE on that same znode; the queued delete comes later
/// and must not remove the new DONE: a duplicate delivered after the queue drained is
/// answered `Duplicate`, and the order is charged once.
#[test]
fn a_done_written_over_a_znode_the_reaper_listed_outlives_its_delete() {
    let Some(server) = ZooKeeperServer::start_with(&[
        "-Dznode.container.checkIntervalMs=300",
        "-Dznode.container.maxPerMinute=600",
    ]) else {
        return;
    };
    block_on(async {
        let root = "/reaper";
        let store = zookeeper::connect(&server.hosts(), root, Duration::from_secs(4)).await;
        let client = zk::Client::connect(&server.hosts()).await.unwrap();
        create_path(&client, "/decoys").await;
        for round in 0..5u32 {
            let id = 1_000 + round;
            let key = Key::new("reaper", format!("order:{id}")).unwrap();
            let path = record_path(root, &key);
            create_path(&client, &path[..path.rfind('/').unwrap()]).await;
            // The record an earlier delivery left, done and long expired: kept 1 ms,
            // in a znode whose TTL (1 ms) ran out as well.
            let old = format!("D{:032x} 0 1 1 - ", 7u128);
            let (old_stat, _) = client
                .create(&path, old.as_bytes(), &ttl_node(Duration::from_millis(1)))
                .await
                .unwrap();
            let decoys: Vec<String> = (0..40).map(|i| format!("/decoys/r{round}-{i}")).collect();
            for decoy in &decoys {
                client.create(decoy, b"", &ttl_node(Duration::from_millis(1))).await.unwrap();
            }
            // A scan listed them all once the first is deleted.
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                assert!(Instant::now() < deadline, "the reaper deleted nothing in 30 s");
                if client.check_stat(&decoys[0]).await.unwrap().is_none()
                    || client.list_children("/decoys").await.unwrap().len() < decoys.len()
                {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            // The listed znode must still be there for the claim to meet it: if the
            // reaper deleted it first, the store would make a new one, which no scan
            // listed.
            let listed = client.check_stat(&path).await.unwrap();
            if listed.is_none_or(|stat| stat.czxid != old_stat.czxid) {
                eprintln!("round {round}: the reaper came first; trying again");
                continue;
            }
            let charges = AtomicU32::new(0);
            let first = charge(Order { id }, &store, &charges).await.unwrap();
            assert!(matches!(first, Outcome::Processed(())), "{first:?}");
            // The queue drains, then one more scan.
            let deadline = Instant::now() + Duration::from_secs(30);
            while client
                .list_children("/decoys")
                .await
                .unwrap()
                .iter()
                .any(|d| d.starts_with(&format!("r{round}-")))
            {
                assert!(Instant::now() < deadline, "the reaper's queue did not drain");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
            let again = charge(Order { id }, &store, &charges).await.unwrap();
            assert!(matches!(again, Outcome::Duplicate), "the duplicate ran: {again:?}");
            assert_eq!(charges.load(Ordering::SeqCst), 1, "order {id} charged twice");
            return;
        }
        panic!("the reaper deleted the old record before the claim in every round");
    });
}
