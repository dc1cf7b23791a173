//! `RedisStore` against real servers: the store-generic suite on the machine's Redis
//! and on a 3-master Cluster of the test's own, two consumers racing through the
//! Cluster, and keys no string-based store would survive.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use idempotent::testing::{self, block_on};
use idempotent::{Claim, Fingerprint, Key, RedisStore, Store, Transition};
use support::{RedisCluster, RedisServer};

// Every row of the life cycle, on standalone Redis.
idempotent::store_suite!(match support::shared_store().await {
    Some(store) => store,
    None => return,
});

/// The same suite with every claim through the claim script, as on a server before
/// Redis 7.0 (which refuses `SET ... NX ... GET`): the script alone takes fresh keys
/// and answers duplicates, as well as telling live claims from lapsed ones.
mod claims_by_script {
    use super::support;

    idempotent::store_suite!(match support::shared_store().await {
        Some(store) => store.with_claims_by_script(),
        None => return,
    });
}

/// The same suite, every case of it, through a Redis Cluster.
#[test]
fn cluster_passes_the_store_suite() {
    if !support::have_redis_server() {
        return;
    }
    let cluster = RedisCluster::start();
    block_on(async {
        let store = RedisStore::cluster(cluster.urls()).await.expect("cluster reachable");
        testing::every_case(store).await;
    });
}

/// Two consumers, each with its own Cluster connection, race over the same 1,000
/// keys: every body runs exactly once.
#[test]
fn two_consumers_race_through_cluster() {
    if !support::have_redis_server() {
        return;
    }
    let cluster = RedisCluster::start();
    block_on(async {
        let namespace = testing::fresh_key("race").namespace().to_owned();
        let runs: Arc<Vec<AtomicU32>> = Arc::new((0..1_000).map(|_| AtomicU32::new(0)).collect());
        let mut consumers = Vec::new();
        for _ in 0..2 {
            let store = Arc::new(RedisStore::cluster(cluster.urls()).await.expect("cluster"));
            let (runs, namespace) = (runs.clone(), namespace.clone());
            consumers.push(tokio::spawn(async move {
                let tasks: Vec<_> = (0..1_000u32)
                    .map(|i| {
                        let (store, runs, namespace) =
                            (store.clone(), runs.clone(), namespace.clone());
                        tokio::spawn(async move {
                            let key = Key::new(&namespace, format!("order:{i}")).unwrap();
                            let spec = idempotent::__private::Spec::default();
                            idempotent::__private::run(
                                idempotent::__private::Call::new(spec, Ok(key)),
                                &*store,
                                |_: &std::io::Error| idempotent::ErrorClass::Retryable,
                                idempotent::__private::process_sink,
                                async {
                                    runs[i as usize].fetch_add(1, Ordering::SeqCst);
                                    Ok::<_, std::io::Error>(())
                                },
                            )
                            .await
                        })
                    })
                    .collect();
                for task in tasks {
                    let outcome = task.await.unwrap().expect("no error");
                    assert!(!matches!(outcome, idempotent::Outcome::Replayed(_)));
                }
            }));
        }
        for consumer in consumers {
            consumer.await.unwrap();
        }
        for (i, n) in runs.iter().enumerate() {
            assert_eq!(n.load(Ordering::SeqCst), 1, "order {i}");
        }
    });
}

/// Ids with spaces, colons, newlines, 10 KB, non-UTF-8 bytes and the hashed form's
/// own prefix are stored and deduplicated correctly, never colliding.
#[test]
fn awkward_keys_are_distinct_and_deduplicated() {
    block_on(async {
        let Some(store) = support::shared_store().await else {
            return;
        };
        let namespace = testing::fresh_key("keys").namespace().to_owned();
        let long_a = "a".repeat(10 * 1024);
        let mut long_b = long_a.clone();
        long_b.push('b');
        let ids: Vec<Vec<u8>> = vec![
            b"order 42".to_vec(),
            b"order:42".to_vec(),
            b"order\n42".to_vec(),
            b"order\r\n42".to_vec(),
            b"order42".to_vec(),
            long_a.clone().into_bytes(),
            long_b.into_bytes(),
            vec![0xff, 0xfe, 0x00, b'4', b'2'],
            vec![0xff, 0xfe, 0x00, b'4', b'3'],
            format!("sha256:{}", hex_sha256(long_a.as_bytes())).into_bytes(),
            "订单:42".as_bytes().to_vec(),
        ];
        let keys: Vec<Key> = ids.iter().map(|id| Key::new(&namespace, id).unwrap()).collect();
        let (lease, ttl) = (testing::LEASE, testing::TTL);
        for (i, key) in keys.iter().enumerate() {
            let Claim::Won { token, attempt: 1, .. } =
                store.claim(key, lease, ttl, None).await.unwrap()
            else {
                panic!("key {i} ({key}) collided with an earlier one")
            };
            let _ = store.complete(key, token, ttl, None).await.unwrap();
        }
        for key in &keys {
            assert_eq!(store.claim(key, lease, ttl, None).await.unwrap(), Claim::Done, "{key}");
        }
        let redis_key = store.redis_key(&keys[5]);
        assert!(redis_key.len() < 200, "long ids are hashed");
    });
}

fn hex_sha256(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// A claim, a completion or a release sent twice with the same token (a Cluster
/// client resends after a redirect or a dropped connection) answers as the first one
/// did, instead of reading as another consumer's claim or a lost lease.
#[test]
fn the_same_claim_completion_or_release_sent_twice_answers_as_the_first() {
    block_on(async {
        let Some(store) = support::shared_store().await else {
            return;
        };
        let mut conn = store.connection_manager().unwrap().clone();
        let key = testing::fresh_key("resend");
        let record = store.redis_key(&key);
        let token = "0123456789abcdef0123456789abcdef";
        let claim = redis::Script::new(idempotent::redis_store::CLAIM_SCRIPT);
        for _ in 0..2 {
            let reply: (String, u32) = claim
                .key(&record)
                .arg(token)
                .arg(30_000)
                .arg(60_000)
                .arg("-")
                .invoke_async(&mut conn)
                .await
                .unwrap();
            assert_eq!(reply, ("W".to_owned(), 1));
        }
        let finish = redis::Script::new(idempotent::redis_store::FINISH_SCRIPT);
        for _ in 0..2 {
            let applied: i64 = finish
                .key(&record)
                .arg(token)
                .arg("D")
                .arg(60_000)
                .arg("cached")
                .invoke_async(&mut conn)
                .await
                .unwrap();
            assert_eq!(applied, 1);
        }
        let again = store.claim(&key, testing::LEASE, testing::TTL, None).await.unwrap();
        assert_eq!(again, Claim::Cached(b"cached".to_vec()));

        // A release sent twice: the second answers as the first, not as a lost lease.
        let key = testing::fresh_key("resend-release");
        let Claim::Won { token, .. } =
            store.claim(&key, testing::LEASE, testing::TTL, None).await.unwrap()
        else {
            panic!("a fresh key is won");
        };
        let release = redis::Script::new(idempotent::redis_store::RELEASE_SCRIPT);
        for _ in 0..2 {
            let applied: i64 = release
                .key(store.redis_key(&key))
                .arg(token.to_string())
                .arg("0")
                .invoke_async(&mut conn)
                .await
                .unwrap();
            assert_eq!(applied, 1);
        }
        let next = store.claim(&key, testing::LEASE, testing::TTL, None).await.unwrap();
        assert!(matches!(next, Claim::Won { attempt: 2, .. }), "{next:?}");
    });
}

/// Another program's key under the store's name, or a record in a format this
/// version can't read, fails the same way every time: the error is permanent and the
/// message is dead-lettered, not retried for ever.
#[test]
fn a_foreign_or_unreadable_record_is_refused_for_good() {
    block_on(async {
        let Some(store) = support::shared_store().await else {
            return;
        };
        let mut conn = store.connection_manager().unwrap().clone();
        let (foreign, unreadable) = (testing::fresh_key("foreign"), testing::fresh_key("garbled"));
        let _: () = redis::cmd("HSET")
            .arg(store.redis_key(&foreign))
            .arg("field")
            .arg("value")
            .query_async(&mut conn)
            .await
            .unwrap();
        let _: () = redis::cmd("SET")
            .arg(store.redis_key(&unreadable))
            .arg("v9|something else")
            .query_async(&mut conn)
            .await
            .unwrap();
        for key in [&foreign, &unreadable] {
            let err = store.claim(key, testing::LEASE, testing::TTL, None).await.unwrap_err();
            assert!(err.is_permanent(), "{key}: {err}");
            let call = idempotent::Error::<std::io::Error>::Store {
                error: err,
                handler_ran: false,
                retry_after: std::time::Duration::ZERO,
            };
            assert_eq!(call.disposition(), idempotent::Disposition::DeadLetter);
        }
    });
}

/// A claim on a fresh key, and one that finds the key DONE, FAILED or of another
/// payload, is one `SET ... NX PX ... GET` on the server: no script runs.
#[test]
fn fresh_and_duplicate_claims_run_no_script() {
    if !support::have_redis_server() {
        return;
    }
    let server = RedisServer::start();
    block_on(async {
        let store = RedisStore::connect(server.url()).await.unwrap();
        let (lease, ttl) = (testing::LEASE, testing::TTL);
        let (done, failed) = (testing::fresh_key("one-set"), testing::fresh_key("one-set"));
        let (first, other) = (Fingerprint::of(&b"first"[..]), Fingerprint::of(&b"other"[..]));
        let Claim::Won { token, attempt: 1, .. } =
            store.claim(&done, lease, ttl, Some(&first)).await.unwrap()
        else {
            panic!("a fresh key is won")
        };
        assert_eq!(store.complete(&done, token, ttl, None).await.unwrap(), Transition::Applied);
        let Claim::Won { token, .. } = store.claim(&failed, lease, ttl, None).await.unwrap() else {
            panic!("a fresh key is won")
        };
        assert_eq!(store.fail(&failed, token, ttl).await.unwrap(), Transition::Applied);
        assert!(server.cli(&["config", "resetstat"]).contains("OK"));

        let fresh = testing::fresh_key("one-set");
        let won = store.claim(&fresh, lease, ttl, None).await.unwrap();
        assert!(matches!(won, Claim::Won { attempt: 1, .. }), "{won:?}");
        assert_eq!(store.claim(&done, lease, ttl, Some(&first)).await.unwrap(), Claim::Done);
        assert_eq!(store.claim(&done, lease, ttl, Some(&other)).await.unwrap(), Claim::Mismatch);
        let answer = store.claim(&failed, lease, ttl, None).await.unwrap();
        assert_eq!(answer, Claim::Failed { attempts: 1 });

        let stats = server.cli(&["info", "commandstats"]);
        assert!(stats.contains("cmdstat_set:calls=4,"), "{stats}");
        assert!(!stats.contains("cmdstat_eval"), "no script ran: {stats}");
    });
}

/// A record in progress under another token is left alone while its lease lasts and
/// taken over, attempt counted, once it lapses; the lease is the server's to time (the
/// record holds it against the key's own expiry).
#[test]
fn another_claims_lease_is_timed_by_the_server() {
    block_on(async {
        let Some(store) = support::shared_store().await else {
            return;
        };
        let (lease, ttl) = (testing::LEASE, testing::TTL);
        let key = testing::fresh_key("takeover");
        let Claim::Won { token: stale, attempt: 1, .. } =
            store.claim(&key, lease, ttl, None).await.unwrap()
        else {
            panic!("a fresh key is won")
        };
        assert!(matches!(
            store.claim(&key, lease, ttl, None).await.unwrap(),
            Claim::InProgress { .. }
        ));
        tokio::time::sleep(lease + std::time::Duration::from_millis(100)).await;
        let Claim::Won { token, attempt: 2, .. } =
            store.claim(&key, lease, ttl, None).await.unwrap()
        else {
            panic!("a lapsed lease is taken over")
        };
        // The takeover holds a full lease of its own, and keeps the record for the
        // claim's retention.
        assert!(matches!(
            store.claim(&key, lease, ttl, None).await.unwrap(),
            Claim::InProgress { .. }
        ));
        let mut conn = store.connection_manager().unwrap().clone();
        let pttl: i64 =
            redis::cmd("PTTL").arg(store.redis_key(&key)).query_async(&mut conn).await.unwrap();
        let retention = idempotent::claim_retention(lease, ttl).as_millis() as i64;
        assert!(pttl > retention - 1_000 && pttl <= retention, "{pttl}");
        assert_eq!(store.complete(&key, stale, ttl, None).await.unwrap(), Transition::LeaseLost);
        assert_eq!(store.complete(&key, token, ttl, None).await.unwrap(), Transition::Applied);
        assert_eq!(store.claim(&key, lease, ttl, None).await.unwrap(), Claim::Done);
    });
}

/// Records written by the first version of the format (`<state> <attempts> <lease
/// deadline ms> <token> <fingerprint> <result>`, the deadline on the server's clock)
/// are read: DONE, cached results and FAILED answer as they did, a claim in progress
/// holds until its deadline, and a lapsed or released one is taken over with its
/// attempt count and fingerprint.
#[test]
fn records_of_the_first_format_are_read() {
    block_on(async {
        let Some(store) = support::shared_store().await else {
            return;
        };
        let mut conn = store.connection_manager().unwrap().clone();
        let (lease, ttl) = (testing::LEASE, testing::TTL);
        let (seconds, micros): (u64, u64) =
            redis::cmd("TIME").query_async(&mut conn).await.unwrap();
        let now = seconds * 1_000 + micros / 1_000;
        let token = "0123456789abcdef0123456789abcdef";
        let (first, other) = (Fingerprint::of(&b"first"[..]), Fingerprint::of(&b"other"[..]));
        let cases = [
            (format!("D 2 0 {token} - "), Claim::Done),
            (format!("D 1 0 {token} - cached result"), Claim::Cached(b"cached result".to_vec())),
            (format!("F 3 0 {token} - "), Claim::Failed { attempts: 3 }),
            (
                format!("P 1 {} {token} - ", now + 30_000),
                Claim::InProgress { lease_left: Some(std::time::Duration::from_secs(30)) },
            ),
            (format!("D 1 0 {token} {other} "), Claim::Mismatch),
        ];
        for (record, expected) in cases {
            let key = testing::fresh_key("first-format");
            let _: () = redis::cmd("SET")
                .arg(store.redis_key(&key))
                .arg(&record)
                .arg("PX")
                .arg(60_000)
                .query_async(&mut conn)
                .await
                .unwrap();
            let answer = store.claim(&key, lease, ttl, Some(&first)).await.unwrap();
            match (&answer, &expected) {
                // The deadline's lease left, give or take the test's own time.
                (
                    Claim::InProgress { lease_left: Some(left) },
                    Claim::InProgress { lease_left: Some(most) },
                ) => assert!(
                    *left <= *most && *left > *most - std::time::Duration::from_secs(5),
                    "{left:?}"
                ),
                _ => assert_eq!(answer, expected, "{record}"),
            }
        }
        for (record, attempt) in
            [(format!("P 1 {} {token} {first} ", now - 1), 2), (format!("R 4 0 - {first} "), 5)]
        {
            let key = testing::fresh_key("first-format");
            let _: () = redis::cmd("SET")
                .arg(store.redis_key(&key))
                .arg(&record)
                .arg("PX")
                .arg(60_000)
                .query_async(&mut conn)
                .await
                .unwrap();
            let answer = store.claim(&key, lease, ttl, Some(&other)).await.unwrap();
            assert_eq!(answer, Claim::Mismatch, "the fingerprint is kept: {record}");
            let Claim::Won { token, attempt: won, .. } =
                store.claim(&key, lease, ttl, Some(&first)).await.unwrap()
            else {
                panic!("{record} is taken over")
            };
            assert_eq!(won, attempt, "{record}");
            assert!(matches!(
                store.claim(&key, lease, ttl, None).await.unwrap(),
                Claim::InProgress { .. }
            ));
            let applied = store.complete(&key, token, ttl, Some(b"v2")).await.unwrap();
            assert_eq!(applied, Transition::Applied);
            let answer = store.claim(&key, lease, ttl, None).await.unwrap();
            assert_eq!(answer, Claim::Cached(b"v2".to_vec()));
        }
    });
}
