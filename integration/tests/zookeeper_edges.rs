//! `ZooKeeperStore` at its edges: many claims at once on one session, keys of any
//! bytes and of the longest length, each against a server of the test's own.

#[path = "support/zookeeper.rs"]
mod zookeeper;

use std::time::Duration;

use idempotent::testing::block_on;
use idempotent::{Claim, Key, Store as _, Transition};
use zookeeper::ZooKeeperServer;

/// 5,000 claims in flight at once on one store (one session), half of them on 50
/// shared keys: every distinct key is won exactly once, every call answers.
#[test]
fn thousands_of_claims_at_once_on_one_session() {
    let Some(server) = ZooKeeperServer::start() else { return };
    block_on(async {
        let store = zookeeper::connect(&server.hosts(), "/many", Duration::from_secs(4)).await;
        let lease = Duration::from_secs(30);
        let claims = (0..5_000u32).map(|i| {
            let store = store.clone();
            let id = if i % 2 == 0 { format!("shared:{}", i % 100) } else { format!("own:{i}") };
            async move {
                let key = Key::new("many", id.clone()).unwrap();
                let claim = tokio::time::timeout(
                    Duration::from_secs(60),
                    store.claim(&key, lease, lease, None),
                )
                .await
                .expect("a claim hung");
                (id, claim.unwrap())
            }
        });
        let answers = futures_util::future::join_all(claims).await;
        let mut won = std::collections::HashMap::<String, u32>::new();
        for (id, claim) in answers {
            match claim {
                Claim::Won { .. } => *won.entry(id).or_default() += 1,
                Claim::InProgress { lease_left: Some(left) } => assert!(left <= lease),
                other => panic!("{id}: {other:?}"),
            }
        }
        assert_eq!(won.len(), 2_500 + 50, "every key won");
        assert!(won.values().all(|&n| n == 1), "a key won twice");
    });
}

/// Keys of every byte value, and the longest namespace and id a key may have.
#[test]
fn keys_of_any_bytes_and_the_longest_length() {
    let Some(server) = ZooKeeperServer::start() else { return };
    block_on(async {
        let store = zookeeper::connect(&server.hosts(), "/bytes", Duration::from_secs(4)).await;
        let lease = Duration::from_secs(30);
        let every: Vec<u8> = (0..=255u8).collect();
        let longest_id = vec![0xffu8; 512];
        let namespace = "n".repeat(idempotent_runtime_max_namespace() - 512);
        let mut keys = vec![
            Key::new("bytes", &every).unwrap(),
            Key::new("bytes", &longest_id).unwrap(),
            Key::new("bytes", vec![b'/'; 40]).unwrap(),
        ];
        keys.push(Key::new(&namespace, &longest_id).unwrap());
        for key in keys {
            let Claim::Won { token, .. } = store.claim(&key, lease, lease, None).await.unwrap()
            else {
                panic!("not won")
            };
            let result = vec![0u8; 100_000];
            let done = store.complete(&key, token, lease, Some(&result)).await.unwrap();
            assert_eq!(done, Transition::Applied);
            let again = store.claim(&key, lease, lease, None).await.unwrap();
            assert_eq!(again, Claim::Cached(result));
        }
    });
}

/// The longest namespace a key accepts, found by trying (the key type caps the whole
/// key, not the namespace alone).
fn idempotent_runtime_max_namespace() -> usize {
    let (mut low, mut high) = (1usize, 70_000usize);
    while low < high {
        let mid = (low + high).div_ceil(2);
        if Key::new(&"n".repeat(mid), [1u8]).is_ok() { low = mid } else { high = mid - 1 }
    }
    low - 1
}

/// A records' root whose ACL lets the store's session only read: connecting is
/// refused as a misconfiguration naming the ACL (retried by a consumer, never
/// dead-lettered), not as a refusal of a message's record.
#[test]
fn a_root_the_session_may_not_write_is_a_misconfiguration() {
    let Some(server) = ZooKeeperServer::start() else { return };
    block_on(async {
        use zookeeper_client as zk;
        let client = zk::Client::connect(&server.hosts()).await.expect("a session");
        let read_only = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_read());
        client.create("/read-only", b"", &read_only).await.expect("the root");
        let refused = idempotent::ZooKeeperStore::connect_with(
            &server.hosts(),
            "/read-only",
            Duration::from_secs(4),
        )
        .await
        .map(|_| ())
        .unwrap_err();
        match refused {
            idempotent::StoreError::Misconfigured(reason) => {
                assert!(reason.contains("ACL"), "{reason}")
            }
            other => panic!("not a misconfiguration: {other}"),
        }
    });
}
