//! `Admin` on the real stores: records in every state made through the `Store` trait,
//! then inspected, listed page by page, counted, released and purged. On the machine's
//! Redis (in namespaces of each test's own), on a Redis Cluster of the test's own, on
//! the machine's PostgreSQL and MySQL or MariaDB (in a table of each test's own), and
//! on ZooKeeper (the machine's, `ZOOKEEPER_HOSTS`, default `127.0.0.1:2181`, or else
//! a server of the test's own; under a root of each test's own).

mod support;

#[path = "support/mysql.rs"]
mod mysql;
#[path = "support/postgres.rs"]
mod postgres;
#[path = "support/zookeeper.rs"]
mod zookeeper;

use std::collections::BTreeSet;
use std::time::Duration;

use idempotent::admin::{Admin, Filter, Record, Released, State};
use idempotent::testing::{self, block_on};
use idempotent::{
    Claim, Fingerprint, Key, MysqlStore, PostgresStore, RedisStore, Store, Token, Transition,
    ZooKeeperStore,
};
use support::RedisCluster;

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(600);

async fn won<S: Store>(store: &S, key: &Key, lease: Duration, fp: Option<&Fingerprint>) -> Token {
    match store.claim(key, lease, TTL, fp).await.unwrap() {
        Claim::Won { token, .. } => token,
        other => panic!("{key}: expected a won claim, got {other:?}"),
    }
}

/// The keys of one namespace, one per state the scenario makes.
struct Keys {
    namespace: String,
    done: Key,
    hashed: Key,
    failed: Key,
    live: Key,
    lapsed: Key,
    released: Key,
}

impl Keys {
    fn new(case: &str) -> Keys {
        let namespace = testing::fresh_key(case).namespace().to_owned();
        let key = |id: &[u8]| Key::new(&namespace, id).unwrap();
        Keys {
            done: key(b"done:1"),
            hashed: key(&[b'x'; 600]),
            failed: key(b"failed"),
            live: key(b"live"),
            lapsed: key(b"lapsed \xff"),
            released: key(b"released"),
            namespace,
        }
    }

    fn all(&self) -> [&Key; 6] {
        [&self.done, &self.hashed, &self.failed, &self.live, &self.lapsed, &self.released]
    }

    fn stored(&self) -> BTreeSet<Vec<u8>> {
        self.all().iter().map(|k| k.stored().into_owned()).collect()
    }
}

/// Writes one record in each state: DONE with a cached result and a fingerprint, DONE
/// under a hashed id, FAILED at attempt 2, in progress with a live lease and with a
/// lapsed one, and RELEASED.
async fn make_records<S: Store>(store: &S, keys: &Keys, fingerprint: &Fingerprint) {
    let token = won(store, &keys.done, LEASE, Some(fingerprint)).await;
    let applied = store.complete(&keys.done, token, TTL, Some(b"cached!")).await.unwrap();
    assert_eq!(applied, Transition::Applied);
    let token = won(store, &keys.hashed, LEASE, None).await;
    let _ = store.complete(&keys.hashed, token, TTL, None).await.unwrap();
    let token = won(store, &keys.failed, LEASE, None).await;
    let _ = store.release(&keys.failed, token).await.unwrap();
    let token = won(store, &keys.failed, LEASE, None).await;
    let _ = store.fail(&keys.failed, token, TTL).await.unwrap();
    won(store, &keys.live, LEASE, None).await;
    won(store, &keys.lapsed, Duration::from_millis(100), None).await;
    let token = won(store, &keys.released, LEASE, None).await;
    let _ = store.release(&keys.released, token).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
}

/// Every page of a listing, checking that none holds more than `limit` records.
async fn list_all<A: Admin>(store: &A, filter: &Filter, limit: usize) -> Vec<Record> {
    let mut records = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..10_000 {
        let page = store.list(filter, cursor.as_deref(), limit).await.unwrap();
        assert!(page.records.len() <= limit, "{} records in a page of {limit}", page.records.len());
        records.extend(page.records);
        match page.next {
            Some(next) => cursor = Some(next),
            None => return records,
        }
    }
    panic!("the listing never ended");
}

fn keys_of(records: &[Record]) -> Vec<Vec<u8>> {
    let mut keys: Vec<Vec<u8>> = records.iter().map(|r| r.key.clone()).collect();
    keys.sort();
    keys
}

/// What every store must answer about the records `make_records` wrote.
async fn check_inspect<A: Admin>(store: &A, keys: &Keys, fingerprint: &Fingerprint) {
    let ttl_near = |r: &Record, ttl: Duration| {
        let left = r.ttl_left.expect("an expiry");
        assert!(left <= ttl && left > ttl - Duration::from_secs(10), "ttl left {left:?}");
    };

    let done = store.inspect(&keys.done).await.unwrap().expect("done record");
    assert_eq!(done.state, State::Done);
    assert_eq!(done.key, keys.done.stored().into_owned());
    assert_eq!(done.namespace, keys.namespace);
    assert_eq!(done.id, b"done:1");
    assert_eq!(done.attempts, 1);
    assert_eq!(done.lease_left, None);
    assert_eq!(done.fingerprint, Some(fingerprint.to_string()));
    assert_eq!(done.result_len, Some(7));
    ttl_near(&done, TTL);

    let hashed = store.inspect(&keys.hashed).await.unwrap().expect("hashed record");
    assert!(hashed.id.starts_with(b"sha256:"), "{:?}", hashed.id.escape_ascii().to_string());
    assert_eq!((hashed.state, hashed.result_len, hashed.fingerprint), (State::Done, None, None));

    let failed = store.inspect(&keys.failed).await.unwrap().expect("failed record");
    assert_eq!((failed.state, failed.attempts, failed.lease_left), (State::Failed, 2, None));
    ttl_near(&failed, TTL);

    let live = store.inspect(&keys.live).await.unwrap().expect("live record");
    assert_eq!((live.state, live.attempts), (State::InProgress, 1));
    let left = live.lease_left.expect("a live lease");
    assert!(left <= LEASE && left > LEASE - Duration::from_secs(10), "lease left {left:?}");
    ttl_near(&live, TTL + LEASE);

    let lapsed = store.inspect(&keys.lapsed).await.unwrap().expect("lapsed record");
    assert_eq!((lapsed.state, lapsed.lease_left), (State::InProgress, None));
    assert_eq!(lapsed.id, b"lapsed \xff");

    let released = store.inspect(&keys.released).await.unwrap().expect("released record");
    assert_eq!((released.state, released.attempts), (State::Released, 1));

    let missing = Key::new(&keys.namespace, "never").unwrap();
    assert_eq!(store.inspect(&missing).await.unwrap(), None);
}

/// Listing by namespace and state, in pages of every small size, and the counts.
async fn check_list_and_stats<A: Admin>(store: &A, keys: &Keys, other: &Keys) {
    let ns = |state: Option<State>| Filter { namespace: Some(keys.namespace.clone()), state };
    for limit in [1, 2, 3, 5, 100] {
        let records = list_all(store, &ns(None), limit).await;
        let seen = keys_of(&records);
        assert_eq!(seen, keys.stored().into_iter().collect::<Vec<_>>(), "limit {limit}");
    }
    for (state, want) in [
        (State::Done, vec![&keys.done, &keys.hashed]),
        (State::InProgress, vec![&keys.live, &keys.lapsed]),
        (State::Failed, vec![&keys.failed]),
        (State::Released, vec![&keys.released]),
    ] {
        let records = list_all(store, &ns(Some(state)), 1).await;
        let mut want: Vec<Vec<u8>> = want.iter().map(|k| k.stored().into_owned()).collect();
        want.sort();
        assert_eq!(keys_of(&records), want, "{state}");
        assert!(records.iter().all(|r| r.state == state));
    }
    let stats = store.stats(&ns(None)).await.unwrap();
    let n = &keys.namespace;
    assert_eq!(
        stats,
        vec![
            (n.clone(), State::InProgress, 2),
            (n.clone(), State::Released, 1),
            (n.clone(), State::Done, 2),
            (n.clone(), State::Failed, 1),
        ]
    );
    let done = store.stats(&ns(Some(State::Done))).await.unwrap();
    assert_eq!(done, vec![(n.clone(), State::Done, 2)]);
    let other_stats = store
        .stats(&Filter { namespace: Some(other.namespace.clone()), state: None })
        .await
        .unwrap();
    assert_eq!(other_stats.iter().map(|(_, _, n)| n).sum::<u64>(), 6);
}

/// Release: FAILED, RELEASED and lapsed records go (and the key processes again, from
/// attempt 1); DONE and live ones need force.
async fn check_release<S: Store + Admin>(store: &S, keys: &Keys) {
    assert_eq!(store.release_key(&keys.failed, false).await.unwrap(), Released::Released);
    assert_eq!(store.inspect(&keys.failed).await.unwrap(), None);
    match store.claim(&keys.failed, LEASE, TTL, None).await.unwrap() {
        Claim::Won { attempt, token, .. } => {
            assert_eq!(attempt, 1, "attempts start again");
            let _ = store.complete(&keys.failed, token, TTL, None).await.unwrap();
        }
        other => panic!("a released FAILED key is processable again, got {other:?}"),
    }
    assert_eq!(store.release_key(&keys.released, false).await.unwrap(), Released::Released);
    assert_eq!(store.release_key(&keys.lapsed, false).await.unwrap(), Released::Released);

    match store.release_key(&keys.done, false).await.unwrap() {
        Released::Refused(why) => assert!(why.starts_with("DONE"), "{why}"),
        other => panic!("DONE released without force: {other:?}"),
    }
    assert_eq!(store.inspect(&keys.done).await.unwrap().map(|r| r.state), Some(State::Done));
    assert_eq!(store.release_key(&keys.done, true).await.unwrap(), Released::Released);
    assert!(matches!(store.claim(&keys.done, LEASE, TTL, None).await.unwrap(), Claim::Won { .. }));

    match store.release_key(&keys.live, false).await.unwrap() {
        Released::Refused(why) => assert!(why.contains("s of lease left"), "{why}"),
        other => panic!("a live claim released without force: {other:?}"),
    }
    assert_eq!(store.release_key(&keys.live, true).await.unwrap(), Released::Released);
    assert_eq!(store.release_key(&keys.live, false).await.unwrap(), Released::NotFound);

    // A stuck claim listed, then finished before its release comes: even with force,
    // a release of what was listed as in progress leaves the DONE record alone.
    let changing = Key::new(&keys.namespace, "changing").unwrap();
    let token = won(store, &changing, LEASE, None).await;
    let filter = Filter { namespace: Some(keys.namespace.clone()), state: Some(State::InProgress) };
    let listed = list_all(store, &filter, 100).await;
    let stuck = listed.iter().find(|r| r.id == b"changing").expect("listed in progress");
    assert_eq!(store.complete(&changing, token, TTL, None).await.unwrap(), Transition::Applied);
    match store.release_record(&stuck.key, Some(State::InProgress), true).await.unwrap() {
        Released::Refused(why) => assert!(why.contains("done now"), "{why}"),
        other => panic!("a record that changed since it was listed was released: {other:?}"),
    }
    assert_eq!(store.inspect(&changing).await.unwrap().map(|r| r.state), Some(State::Done));
    assert_eq!(
        store.release_record(&stuck.key, Some(State::Done), false).await.unwrap(),
        Released::Refused("DONE: pass force to reprocess it".to_owned()),
        "in the expected state, the usual rules apply"
    );

    // A namespace holds no `:`: a filter with one matches nothing, not the ids of
    // another namespace that start with its tail (a key range would).
    let colon = Filter { namespace: Some(format!("{}:done", keys.namespace)), state: None };
    assert_eq!(list_all(store, &colon, 100).await, vec![]);
    assert_eq!(store.stats(&colon).await.unwrap(), vec![]);

    // A hashed id is released from its listing, where only the hash is known.
    let filter = Filter { namespace: Some(keys.namespace.clone()), state: Some(State::Done) };
    let listed = list_all(store, &filter, 100).await;
    let hashed = (listed.iter())
        .find(|r| r.id.starts_with(b"sha256:"))
        .expect("the hashed record is listed");
    assert_eq!(hashed.key, store.record_key(&keys.hashed));
    assert!(matches!(
        store.release_record(&hashed.key, None, false).await.unwrap(),
        Released::Refused(_)
    ));
    assert_eq!(store.release_record(&hashed.key, None, true).await.unwrap(), Released::Released);
    assert_eq!(store.inspect(&keys.hashed).await.unwrap(), None);
}

/// The whole scenario on one store, in two fresh namespaces.
async fn scenario<S: Store + Admin>(store: &S) {
    let fingerprint = Fingerprint::of(b"the payload".as_slice());
    let (keys, other) = (Keys::new("admin"), Keys::new("admin-other"));
    make_records(store, &keys, &fingerprint).await;
    make_records(store, &other, &fingerprint).await;
    check_inspect(store, &keys, &fingerprint).await;
    check_list_and_stats(store, &keys, &other).await;
    check_release(store, &keys).await;
}

#[test]
fn redis_inspects_lists_counts_and_releases() {
    block_on(async {
        let Some(store) = support::shared_store().await else { return };
        scenario(&store).await;
        assert_eq!(store.purge().await.unwrap(), 0, "Redis expires keys itself");
    });
}

#[test]
fn redis_reads_records_of_the_first_format_and_skips_foreign_keys() {
    block_on(async {
        let Some(store) = support::shared_store().await else { return };
        let namespace = testing::fresh_key("admin-old").namespace().to_owned();
        let mut conn = store.connection_manager().unwrap().clone();
        let old = Key::new(&namespace, "old").unwrap();
        let live = Key::new(&namespace, "old-live").unwrap();
        let foreign = Key::new(&namespace, "foreign").unwrap();
        let now_ms =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis()
                as u64;
        let token = "0123456789abcdef0123456789abcdef";
        let set = |key: &Key, value: Vec<u8>| {
            let mut cmd = redis::cmd("SET");
            cmd.arg(store.redis_key(key)).arg(value).arg("PX").arg(60_000);
            cmd
        };
        let records = [
            (&old, format!("D 3 0 {token} - cached").into_bytes()),
            (&live, format!("P 1 {} {token} - ", now_ms + 20_000).into_bytes()),
            (&foreign, b"v9|something else".to_vec()),
        ];
        for (key, value) in records {
            let () = set(key, value).query_async(&mut conn).await.unwrap();
        }
        let record = store.inspect(&old).await.unwrap().unwrap();
        assert_eq!((record.state, record.attempts, record.result_len), (State::Done, 3, Some(6)));
        let record = store.inspect(&live).await.unwrap().unwrap();
        assert_eq!(record.state, State::InProgress);
        let left = record.lease_left.expect("a live first-format lease");
        assert!(left > Duration::from_secs(10) && left <= Duration::from_secs(21), "{left:?}");
        assert!(store.inspect(&foreign).await.unwrap_err().is_permanent());

        let filter = Filter { namespace: Some(namespace.clone()), state: None };
        let listed = list_all(&store, &filter, 1).await;
        let mut want = vec![old.stored().into_owned(), live.stored().into_owned()];
        want.sort();
        assert_eq!(keys_of(&listed), want, "the foreign key is skipped");

        assert!(matches!(&store.release_key(&foreign, false).await.unwrap(), Released::Refused(_)));
        assert!(matches!(&store.release_key(&live, false).await.unwrap(), Released::Refused(_)));
        assert!(matches!(&store.release_key(&old, false).await.unwrap(), Released::Refused(_)));
        for key in [&foreign, &live, &old] {
            assert_eq!(store.release_key(key, true).await.unwrap(), Released::Released);
        }
    });
}

#[test]
fn redis_cluster_inspects_lists_counts_and_releases() {
    if !support::have_redis_server() {
        return;
    }
    let cluster = RedisCluster::start();
    block_on(async {
        let store = RedisStore::cluster(cluster.urls()).await.expect("cluster reachable");
        scenario(&store).await;
        // The whole Cluster, every master scanned in turn: the cluster is this test's
        // own, so what the scenario left is all there is.
        let more = Keys::new("admin-more");
        make_records(&store, &more, &Fingerprint::of(b"x".as_slice())).await;
        for limit in [1, 4, 1000] {
            let all = list_all(&store, &Filter::default(), limit).await;
            let keys = keys_of(&all);
            let unique: BTreeSet<Vec<u8>> = keys.iter().cloned().collect();
            assert_eq!(unique.len(), keys.len(), "a key listed twice with limit {limit}");
            assert!(more.stored().is_subset(&unique), "limit {limit}");
            let stats = store.stats(&Filter::default()).await.unwrap();
            assert_eq!(stats.iter().map(|(_, _, n)| *n).sum::<u64>(), keys.len() as u64);
        }
    });
}

/// A store on a table of the test's own, dropped afterwards.
async fn postgres_store(case: &str) -> Option<PostgresStore> {
    let pool = postgres::pool(5).await?;
    let table = format!(
        "idempotent_admin_{case}_{}",
        testing::fresh_key("t").namespace().replace('-', "_")
    );
    let store = PostgresStore::from_pool(pool).with_table(&table).unwrap();
    store.migrate().await.expect("migration");
    Some(store)
}

async fn drop_table(store: &PostgresStore) {
    let table = format!("{store:?}");
    let table = table.split('"').nth(1).expect("the table's name");
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(store.pool())
        .await
        .unwrap();
}

#[test]
fn postgres_inspects_lists_counts_and_releases() {
    block_on(async {
        let Some(store) = postgres_store("scenario").await else { return };
        scenario(&store).await;
        // The table is the test's own: an unfiltered listing holds both namespaces.
        let all = list_all(&store, &Filter::default(), 4).await;
        let keys = keys_of(&all);
        let unique: BTreeSet<Vec<u8>> = keys.iter().cloned().collect();
        assert_eq!(unique.len(), keys.len());
        let stats = store.stats(&Filter::default()).await.unwrap();
        assert_eq!(stats.iter().map(|(_, _, n)| *n).sum::<u64>(), keys.len() as u64);
        drop_table(&store).await;
    });
}

#[test]
fn postgres_purge_removes_expired_records() {
    block_on(async {
        let Some(store) = postgres_store("purge").await else { return };
        let short = Duration::from_millis(50);
        let namespace = testing::fresh_key("admin-purge").namespace().to_owned();
        for i in 0..3 {
            let key = Key::new(&namespace, i.to_string()).unwrap();
            let Claim::Won { token, .. } = store.claim(&key, short, short, None).await.unwrap()
            else {
                panic!("fresh key")
            };
            let _ = store.complete(&key, token, short, None).await.unwrap();
        }
        let kept = Key::new(&namespace, "kept").unwrap();
        won(&store, &kept, LEASE, None).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let gone = Key::new(&namespace, "0").unwrap();
        assert_eq!(store.inspect(&gone).await.unwrap(), None, "an expired record is absent");
        assert_eq!(store.release_key(&gone, false).await.unwrap(), Released::NotFound);
        assert_eq!(store.purge().await.unwrap(), 2, "the other two expired records");
        assert_eq!(store.purge().await.unwrap(), 0);
        let left = list_all(&store, &Filter::default(), 10).await;
        assert_eq!(keys_of(&left), vec![kept.stored().into_owned()]);
        drop_table(&store).await;
    });
}

/// The whole store's listing (which must hold no key twice) against its counts: for
/// a store of the test's own.
async fn check_whole_listing<A: Admin>(store: &A) {
    for limit in [1, 4, 1000] {
        let all = list_all(store, &Filter::default(), limit).await;
        let keys = keys_of(&all);
        let unique: BTreeSet<Vec<u8>> = keys.iter().cloned().collect();
        assert_eq!(unique.len(), keys.len(), "a key listed twice with limit {limit}");
        let stats = store.stats(&Filter::default()).await.unwrap();
        assert_eq!(stats.iter().map(|(_, _, n)| *n).sum::<u64>(), keys.len() as u64);
    }
}

/// Three records that expire at once and one that does not, in a fresh namespace;
/// answers the namespace and the key that stays.
async fn make_expiring<S: Store>(store: &S) -> (String, Key) {
    let short = Duration::from_millis(50);
    let namespace = testing::fresh_key("admin-purge").namespace().to_owned();
    for i in 0..3 {
        let key = Key::new(&namespace, i.to_string()).unwrap();
        let token = won(store, &key, short, None).await;
        let _ = store.complete(&key, token, short, None).await.unwrap();
    }
    let kept = Key::new(&namespace, "kept").unwrap();
    won(store, &kept, LEASE, None).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    (namespace, kept)
}

/// A MySQL store on a table of the test's own (dropped by [`drop_mysql_table`]).
async fn mysql_store() -> Option<(MysqlStore, String)> {
    let pool = mysql::pool(5).await?;
    let table = mysql::table("idempotent_admin");
    let store = MysqlStore::from_pool(pool).with_table(&table).unwrap();
    store.migrate().await.expect("migration");
    Some((store, table))
}

async fn drop_mysql_table(store: &MysqlStore, table: &str) {
    mysql::drop_tables(store.pool(), &[table]).await;
}

#[test]
fn mysql_inspects_lists_counts_and_releases() {
    block_on(async {
        let Some((store, table)) = mysql_store().await else { return };
        scenario(&store).await;
        // The table is the test's own: an unfiltered listing holds both namespaces.
        check_whole_listing(&store).await;
        drop_mysql_table(&store, &table).await;
    });
}

#[test]
fn mysql_purge_removes_expired_records() {
    block_on(async {
        let Some((store, table)) = mysql_store().await else { return };
        let (namespace, kept) = make_expiring(&store).await;
        let gone = Key::new(&namespace, "0").unwrap();
        assert_eq!(store.inspect(&gone).await.unwrap(), None, "an expired record is absent");
        assert_eq!(store.release_key(&gone, false).await.unwrap(), Released::NotFound);
        assert_eq!(store.release_key(&gone, true).await.unwrap(), Released::NotFound);
        assert_eq!(store.purge().await.unwrap(), 2, "the other two expired records");
        assert_eq!(store.purge().await.unwrap(), 0);
        let left = list_all(&store, &Filter::default(), 10).await;
        assert_eq!(keys_of(&left), vec![kept.stored().into_owned()]);
        let stats = store.stats(&Filter::default()).await.unwrap();
        assert_eq!(stats, vec![(namespace, State::InProgress, 1)]);
        drop_mysql_table(&store, &table).await;
    });
}

/// Where the ZooKeeper tests run: the machine's server, or else one of the test's own
/// (kept alive by the guard). `None`, with a printed reason, when neither can be had
/// outside CI; under `CI` that fails the test.
async fn zookeeper_store(
    case: &str,
) -> Option<(ZooKeeperStore, Option<zookeeper::ZooKeeperServer>)> {
    let root = format!("/idempotent-admin-test/{}", testing::fresh_key(case).namespace());
    let session = Duration::from_secs(6);
    let hosts = std::env::var("ZOOKEEPER_HOSTS").unwrap_or_else(|_| "127.0.0.1:2181".into());
    match ZooKeeperStore::connect_with(&hosts, &root, session).await {
        Ok(store) => return Some((store, None)),
        Err(e) => eprintln!("no ZooKeeper at {hosts} ({e}): starting one"),
    }
    let server = zookeeper::ZooKeeperServer::start()?;
    let store = zookeeper::connect(&server.hosts(), &root, session).await;
    Some((store, Some(server)))
}

#[test]
fn zookeeper_inspects_lists_counts_and_releases() {
    block_on(async {
        let Some((store, _server)) = zookeeper_store("admin-zk").await else { return };
        scenario(&store).await;
        // The root is the test's own: an unfiltered listing holds both namespaces.
        check_whole_listing(&store).await;
        // What is left goes, so the root holds nothing after the test.
        for record in list_all(&store, &Filter::default(), 100).await {
            assert_eq!(
                store.release_record(&record.key, None, true).await.unwrap(),
                Released::Released
            );
        }
        assert_eq!(list_all(&store, &Filter::default(), 100).await, vec![]);
    });
}

#[test]
fn zookeeper_expired_records_are_absent_and_expire_by_themselves() {
    block_on(async {
        let Some((store, _server)) = zookeeper_store("admin-zk-purge").await else { return };
        let (namespace, kept) = make_expiring(&store).await;
        let gone = Key::new(&namespace, "0").unwrap();
        assert_eq!(store.inspect(&gone).await.unwrap(), None, "an expired record is absent");
        assert_eq!(store.release_key(&gone, false).await.unwrap(), Released::NotFound);
        assert_eq!(store.purge().await.unwrap(), 0, "ZooKeeper deletes TTL znodes itself");
        let left = list_all(&store, &Filter::default(), 10).await;
        assert_eq!(keys_of(&left), vec![kept.stored().into_owned()]);
        let stats = store.stats(&Filter::default()).await.unwrap();
        assert_eq!(stats, vec![(namespace, State::InProgress, 1)]);
        assert_eq!(store.release_key(&kept, true).await.unwrap(), Released::Released);
    });
}
