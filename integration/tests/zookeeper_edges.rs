//! `ZooKeeperStore` at its edges: many claims at once on one session, keys of any
//! bytes and of the longest length, credentials and ACLs, each against a server of
//! the test's own.

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

/// A raw session of `user` with `password` (`digest`), or without credentials.
async fn raw_session(hosts: &str, digest: Option<&str>) -> zookeeper_client::Client {
    let mut connector = zookeeper_client::Client::connector();
    if let Some(digest) = digest {
        connector = connector.with_auth("digest", digest.as_bytes());
    }
    connector.connect(hosts).await.expect("a session")
}

/// A store with digest credentials creates its root and every record for its
/// identity only: a session without them, or with another user's or another
/// password, can't read a record or the root (checked on the server with raw
/// sessions), and a store connecting as anyone else is refused at start-up with a
/// misconfiguration that names the identity and says what to do. Two stores with
/// the same credentials share the records.
#[test]
fn digest_credentials_make_records_private_to_their_identity() {
    let Some(server) = ZooKeeperServer::start() else { return };
    let hosts = server.hosts();
    block_on(async {
        use zookeeper_client as zk;
        let connect = |user: &str, password: &str| {
            idempotent::zookeeper_store::ZooKeeperStore::builder(&hosts)
                .root("/private/orders")
                .session_timeout(Duration::from_secs(4))
                .digest(user, password)
                .connect()
        };
        let store = connect("orders", "s3cret").await.expect("the owner connects");
        let lease = Duration::from_secs(30);
        let key = Key::new("acl", "order-1").unwrap();
        let Claim::Won { token, .. } = store.claim(&key, lease, lease, None).await.unwrap() else {
            panic!("not won")
        };
        assert_eq!(
            store.complete(&key, token, lease, Some(b"charged")).await.unwrap(),
            Transition::Applied
        );

        // From outside: the owner's raw session finds the record's znode; nobody
        // else may read it, the root or the bucket.
        let owner = raw_session(&hosts, Some("orders:s3cret")).await;
        let buckets = owner.list_children("/private/orders").await.expect("the owner lists");
        let bucket = buckets.iter().find(|b| b.len() == 2).expect("a bucket");
        let bucket = format!("/private/orders/{bucket}");
        let names = owner.list_children(&bucket).await.expect("the owner lists the bucket");
        let record = format!("{bucket}/{}", names[0]);
        let (data, _) = owner.get_data(&record).await.expect("the owner reads the record");
        assert!(data.starts_with(b"D"), "a DONE record");
        let (acls, _) = owner.get_acl(&record).await.expect("the record's ACL");
        assert!(
            acls.iter().all(|acl| acl.scheme() == "digest" && acl.id().starts_with("orders:")),
            "{acls:?}"
        );
        for stranger in [None, Some("orders:wrong"), Some("billing:s3cret")] {
            let session = raw_session(&hosts, stranger).await;
            for path in ["/private/orders", bucket.as_str(), record.as_str()] {
                assert_eq!(
                    session.get_data(path).await.map(|_| ()),
                    Err(zk::Error::NoAuth),
                    "{stranger:?} read {path}"
                );
            }
            assert_eq!(
                session.set_data(&record, b"R", None).await.map(|_| ()),
                Err(zk::Error::NoAuth),
                "{stranger:?} overwrote the record"
            );
        }

        // Another identity's store is refused at connect, saying whose root it is
        // and what to do; so is a store without credentials.
        for (user, password) in [("orders", "hunter2"), ("billing", "s3cret")] {
            match connect(user, password).await.map(|_| ()) {
                Err(idempotent::StoreError::Misconfigured(reason)) => {
                    assert!(reason.contains(&format!("`{user}`")), "{reason}");
                    assert!(reason.contains("ACL") && reason.contains(".digest("), "{reason}");
                    assert!(!reason.contains(password), "the password is in: {reason}");
                }
                other => panic!("{user}:{password} was not refused: {:?}", other.err()),
            }
        }
        let anonymous = idempotent::ZooKeeperStore::connect_with(
            &hosts,
            "/private/orders",
            Duration::from_secs(4),
        )
        .await
        .map(|_| ());
        assert!(
            matches!(&anonymous, Err(idempotent::StoreError::Misconfigured(r)) if r.contains("without credentials")),
            "{anonymous:?}"
        );

        // The same identity on another session shares the records.
        let second = connect("orders", "s3cret").await.expect("the owner again");
        assert_eq!(
            second.claim(&key, lease, lease, None).await.unwrap(),
            Claim::Cached(b"charged".to_vec())
        );

        // An ACL changed under a running store (an operator's `setAcl` on the root)
        // is a misconfiguration of every claim, retried, not a message's refusal.
        let (root_acls, _) = owner.get_acl("/private/orders").await.expect("the root's ACL");
        let read_only = [zk::Acl::new(zk::Permission::READ, root_acls[0].auth_id().clone())];
        owner
            .set_acl("/private/orders", &read_only, None)
            .await
            .expect("the owner narrows the ACL");
        let mut refused = 0;
        for i in 0..50 {
            let key = Key::new("acl", format!("after-{i}")).unwrap();
            match store.claim(&key, lease, lease, None).await {
                Err(idempotent::StoreError::Misconfigured(_)) => refused += 1,
                Ok(Claim::Won { .. }) => {} // a bucket that exists already
                other => panic!("{other:?}"),
            }
        }
        assert!(refused > 0, "no claim met the changed ACL");
    });
}
