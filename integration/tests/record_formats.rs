//! Records of another version of the library in every store (`store::format`).
//!
//! Newer: a record in a format a later version writes (`#<n> ...` in Redis and
//! ZooKeeper, a state letter this version does not know in PostgreSQL and MySQL) is
//! left exactly as it is: a claim fails with `StoreError::NewerFormat`, whose
//! disposition is retry; the handler does not run; complete, release, fail and renew
//! answer `LeaseLost`; `inspect` names it. Older: Redis records of the first format
//! are read and replaced (`redis_store::records_of_the_first_format_are_read`).

mod support;

#[path = "support/mysql.rs"]
mod mysql;
#[path = "support/postgres.rs"]
mod postgres;
#[path = "support/zookeeper.rs"]
mod zookeeper;

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idempotent::admin::{Admin, Filter, Released};
use idempotent::testing::{self, block_on};
use idempotent::{
    Disposition, Error, Fingerprint, Key, MysqlStore, PostgresStore, Store, StoreError, Token,
    Transition, ZooKeeperStore, idempotent,
};
use sha2::{Digest, Sha256};
use zookeeper_client as zk;

#[idempotent(key = "{id}", namespace = "formats", store = store, ttl = 60)]
async fn handle<S: Store + ?Sized>(
    id: &str,
    store: &S,
    runs: &AtomicU32,
) -> Result<(), Infallible> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(())
}

/// A fresh id in the `formats` namespace, and its key.
fn fresh() -> (String, Key) {
    let id = testing::fresh_key("newer").namespace().to_owned();
    let key = Key::new("formats", &id).unwrap();
    (id, key)
}

/// Checks every operation on a key that holds a newer version's record, which
/// `raw` reads as it is stored.
async fn left_alone<S, F, Fut>(store: &S, id: &str, key: &Key, raw: F)
where
    S: Store + Admin,
    F: Fn() -> Fut,
    Fut: Future<Output = Vec<u8>>,
{
    let before = raw().await;
    assert!(!before.is_empty(), "the record was planted");
    let (lease, ttl) = (testing::LEASE, testing::TTL);

    let claim = store.claim(key, lease, ttl, None).await;
    let Err(error @ StoreError::NewerFormat(_)) = &claim else { panic!("{claim:?}") };
    assert!(!error.is_permanent(), "retried, not dead-lettered");
    assert!(error.to_string().contains("newer version"), "{error}");
    // Its fields are the later version's: a fingerprint there is not compared.
    let fingerprint = Fingerprint::of(&b"this version's payload"[..]);
    let claim = store.claim(key, lease, ttl, Some(&fingerprint)).await;
    assert!(matches!(claim, Err(StoreError::NewerFormat(_))), "{claim:?}");

    let runs = AtomicU32::new(0);
    let out = handle(id, store, &runs).await;
    let Err(error @ Error::Store { error: StoreError::NewerFormat(_), handler_ran: false, .. }) =
        &out
    else {
        panic!("{out:?}")
    };
    assert_eq!(error.disposition(), Disposition::Retry);
    assert!(error.retry_delay().is_some_and(|d| d > Duration::ZERO));
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the handler did not run");

    let token = Token::random();
    assert_eq!(store.complete(key, token, ttl, Some(b"x")).await.unwrap(), Transition::LeaseLost);
    assert_eq!(store.release(key, token).await.unwrap(), Transition::LeaseLost);
    assert_eq!(store.fail(key, token, ttl).await.unwrap(), Transition::LeaseLost);
    assert_eq!(store.renew(key, token, lease, ttl).await.unwrap(), Transition::LeaseLost);

    let inspected = store.inspect(key).await;
    assert!(matches!(inspected, Err(StoreError::NewerFormat(_))), "{inspected:?}");
    // Operators: released only with force; listings and counts leave it out and
    // still show the rest.
    let released = store.release_key(key, false).await.unwrap();
    let Released::Refused(why) = &released else { panic!("{released:?}") };
    assert!(why.contains("force"), "{why}");
    let filter = Filter { namespace: Some("formats".into()), state: None };
    let page = store.list(&filter, None, 1000).await.expect("the listing still works");
    let record_key = store.record_key(key);
    assert!(page.records.iter().all(|r| r.key != record_key), "left out of the listing");
    store.stats(&filter).await.expect("the counts still work");
    assert_eq!(raw().await, before, "the record is as the newer version wrote it");
}

#[test]
fn redis_leaves_a_newer_record_alone() {
    block_on(async {
        let Some(store) = support::shared_store().await else { return };
        let mut conn = store.connection_manager().unwrap().clone();
        // Also `#` alone and a mark in the first format's place.
        let records: [&[u8]; 5] = [
            b"#3 P0123 1 1 - whatever a later version keeps",
            b"#",
            b"#12 ",
            // Not UTF-8 where a cut of the head would end.
            "#3 abcdefgh\u{20ac} rest".as_bytes(),
            b"#\xff\xfe\xfd binary",
        ];
        for record in records {
            let (id, key) = fresh();
            let redis_key = store.redis_key(&key);
            let _: () = redis::cmd("SET")
                .arg(&redis_key)
                .arg(record)
                .arg("PX")
                .arg(60_000)
                .query_async(&mut conn)
                .await
                .unwrap();
            let raw = || {
                let (mut conn, redis_key) = (conn.clone(), redis_key.clone());
                async move {
                    let value: Vec<u8> =
                        redis::cmd("GET").arg(&redis_key).query_async(&mut conn).await.unwrap();
                    value
                }
            };
            left_alone(&store, &id, &key, raw).await;
            // Once it expires, the key is anyone's.
            let _: () = redis::cmd("DEL").arg(&redis_key).query_async(&mut conn).await.unwrap();
            assert!(handle(&id, &store, &AtomicU32::new(0)).await.unwrap().is_processed());
        }
        // Another program's string is still refused for good (dead-letter).
        let (_, key) = fresh();
        let _: () = redis::cmd("SET")
            .arg(store.redis_key(&key))
            .arg("someone else's value")
            .arg("PX")
            .arg(60_000)
            .query_async(&mut conn)
            .await
            .unwrap();
        let claim = store.claim(&key, testing::LEASE, testing::TTL, None).await;
        assert!(matches!(claim, Err(StoreError::Rejected(_))), "{claim:?}");
    });
}

#[test]
fn postgres_leaves_a_newer_record_alone() {
    block_on(async {
        let Some(pool) = postgres::pool(4).await else { return };
        let table = format!("idempotent_formats_{:08x}", rand_u32());
        let store = PostgresStore::from_pool(pool.clone()).with_table(&table).unwrap();
        store.migrate().await.unwrap();
        let (id, key) = fresh();
        let insert = format!(
            "INSERT INTO {table} (key, state, attempts, expires_at, fingerprint, result)
             VALUES ($1, 'N', 7, clock_timestamp() + interval '1 hour', $2, 'later')"
        );
        sqlx::query(sqlx::AssertSqlSafe(insert))
            .bind(key.stored().as_ref())
            .bind([7u8; 32].as_slice())
            .execute(&pool)
            .await
            .unwrap();
        let raw = || {
            let (pool, select, stored) = (
                pool.clone(),
                format!("SELECT row_to_json(r)::text FROM {table} r WHERE key = $1"),
                key.stored().into_owned(),
            );
            async move {
                let (row,): (String,) = sqlx::query_as(sqlx::AssertSqlSafe(select))
                    .bind(stored)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
                row.into_bytes()
            }
        };
        left_alone(&store, &id, &key, raw).await;
        let expire = format!("UPDATE {table} SET expires_at = clock_timestamp() WHERE key = $1");
        sqlx::query(sqlx::AssertSqlSafe(expire))
            .bind(key.stored().as_ref())
            .execute(&pool)
            .await
            .unwrap();
        assert!(handle(&id, &store, &AtomicU32::new(0)).await.unwrap().is_processed());
        let drop = format!("DROP TABLE {table}");
        sqlx::query(sqlx::AssertSqlSafe(drop)).execute(&pool).await.unwrap();
    });
}

#[test]
fn mysql_leaves_a_newer_record_alone() {
    block_on(async {
        let Some(pool) = mysql::pool(4).await else { return };
        let table = mysql::table("idempotent_formats");
        let store = MysqlStore::from_pool(pool.clone()).with_table(&table).unwrap();
        store.migrate().await.unwrap();
        let (id, key) = fresh();
        let insert = format!(
            "INSERT INTO {table} (`key`, state, attempts, expires_at, fingerprint, result)
             VALUES (?, 'N', 7, NOW(6) + INTERVAL 1 HOUR, ?, 'later')"
        );
        sqlx::query(sqlx::AssertSqlSafe(insert))
            .bind(key.stored().as_ref())
            .bind([7u8; 32].as_slice())
            .execute(&pool)
            .await
            .unwrap();
        let raw = || {
            let (pool, select, stored) = (
                pool.clone(),
                format!(
                    "SELECT CONCAT_WS(' ', state, attempts, HEX(token), lease_until, expires_at,
                         HEX(fingerprint), HEX(result)) FROM {table} WHERE `key` = ?"
                ),
                key.stored().into_owned(),
            );
            async move {
                let (row,): (Vec<u8>,) = sqlx::query_as(sqlx::AssertSqlSafe(select))
                    .bind(stored)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
                row
            }
        };
        left_alone(&store, &id, &key, raw).await;
        let expire = format!("UPDATE {table} SET expires_at = NOW(6) WHERE `key` = ?");
        sqlx::query(sqlx::AssertSqlSafe(expire))
            .bind(key.stored().as_ref())
            .execute(&pool)
            .await
            .unwrap();
        assert!(handle(&id, &store, &AtomicU32::new(0)).await.unwrap().is_processed());
        mysql::drop_tables(&pool, &[&table]).await;
    });
}

#[test]
fn zookeeper_leaves_a_newer_record_alone() {
    block_on(async {
        let root = format!("/idempotent-formats-test-{:08x}", rand_u32());
        let hosts = std::env::var("ZOOKEEPER_HOSTS").unwrap_or_else(|_| "127.0.0.1:2181".into());
        let (store, hosts, _server) =
            match ZooKeeperStore::connect_with(&hosts, &root, Duration::from_secs(6)).await {
                Ok(store) => (store, hosts, None),
                Err(e) => {
                    eprintln!("no ZooKeeper at {hosts} ({e}): starting one");
                    let Some(server) = zookeeper::ZooKeeperServer::start() else { return };
                    let store = ZooKeeperStore::connect_with(
                        &server.hosts(),
                        &root,
                        Duration::from_secs(6),
                    )
                    .await
                    .unwrap();
                    (store, server.hosts(), Some(server))
                }
            };
        let client = zk::Client::connect(&hosts).await.unwrap();
        let (id, key) = fresh();
        // The record's path, as the store lays it out: `{root}/{bucket}/{key in hex}`.
        let stored = key.stored();
        let bucket = format!("{root}/{:02x}", Sha256::digest(&stored)[0]);
        let hex: String = stored.iter().map(|b| format!("{b:02x}")).collect();
        let path = format!("{bucket}/{hex}");
        let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        match client.create(&bucket, b"", &persistent).await {
            Ok(_) | Err(zk::Error::NodeExists) => {}
            Err(e) => panic!("{e}"),
        }
        client.create(&path, b"#2 P- 1 1 1 - later", &persistent).await.unwrap();
        let raw = || {
            let (client, path) = (client.clone(), path.clone());
            async move { client.get_data(&path).await.unwrap().0 }
        };
        left_alone(&store, &id, &key, raw).await;
        client.delete(&path, None).await.unwrap();
        assert!(handle(&id, &store, &AtomicU32::new(0)).await.unwrap().is_processed());
    });
}

fn rand_u32() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    hasher.finish() as u32
}
