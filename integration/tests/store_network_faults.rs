//! The behaviour suite's failure cases, on the real stores, with the faults made on the
//! network rather than in a wrapper around the store: a proxy between the store and
//! its server cuts every connection, loses the reply of a command the server applied,
//! holds replies back past the lease, or stops delivering. Each case reads the record
//! back through a connection the proxy does not touch, and counts the handler's
//! effects itself: no message is lost, none is marked done without its handler
//! succeeding, none takes effect twice. Run on standalone Redis (a server of the
//! test's own) and on the machine's ZooKeeper, PostgreSQL and MariaDB.

#[path = "support/mysql.rs"]
mod mysql;
mod support;
#[path = "support/zookeeper.rs"]
mod zookeeper;

use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use idempotent::testing::block_on;
use idempotent::{
    Claim, Error, Key, MysqlStore, Outcome, PostgresStore, RedisStore, Store, Token, idempotent,
};
use support::{FaultProxy, RedisServer};
use tokio::sync::Notify;

const NAMESPACE: &str = "network-faults";
const LEASE: Duration = Duration::from_secs(1);
/// The latency each way of a link slower than the lease.
const ONE_WAY: Duration = Duration::from_millis(1200);

struct Order {
    id: String,
    /// How long the handler works before its effect.
    hold: Duration,
}

#[derive(Debug, thiserror::Error, idempotent::Classify)]
#[error("never")]
#[idempotent(retryable)]
struct Never;

/// Effects by order id, counted by the test, not by the system under test.
#[derive(Default)]
struct Ledger {
    applied: Mutex<HashMap<String, u32>>,
}

impl Ledger {
    fn count(&self, id: &str) -> u32 {
        self.applied.lock().unwrap().get(id).copied().unwrap_or(0)
    }
}

/// Calls `started` once the key is claimed, works for `hold`, then takes effect.
#[idempotent(key = "{id}", namespace = "network-faults", lease = 1, ttl = 120, store = store)]
async fn apply(
    order: Order,
    store: &dyn Store,
    ledger: &Ledger,
    started: &(dyn Fn() + Sync),
) -> Result<(), Never> {
    started();
    tokio::time::sleep(order.hold).await;
    *ledger.applied.lock().unwrap().entry(order.id.clone()).or_default() += 1;
    Ok(())
}

fn order(id: &str, hold: Duration) -> Order {
    Order { id: id.to_owned(), hold }
}

fn fresh_id() -> String {
    format!("order-{:x}", Token::random().as_u128())
}

fn nothing() {}

/// A store reached through a [`FaultProxy`], and one on the same server that is not.
struct Target {
    proxy: FaultProxy,
    proxied: Box<dyn Store>,
    direct: Box<dyn Store>,
}

impl Target {
    /// The key's record, read through the connection the proxy does not touch.
    async fn record(&self, id: &str) -> Claim {
        let key = Key::new(NAMESPACE, id).unwrap();
        self.direct.claim(&key, LEASE, Duration::from_secs(120), None).await.expect("direct store")
    }
}

/// Delivers `id` through `store` until a call settles it, as a broker redelivers.
async fn deliver(store: &dyn Store, id: &str, ledger: &Ledger) -> Outcome<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        assert!(Instant::now() < deadline, "{id} never settled");
        match apply(order(id, Duration::ZERO), store, ledger, &nothing).await {
            Ok(Outcome::InProgress { .. }) | Err(Error::Store { handler_ran: false, .. }) => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Ok(settled) => return settled,
            Err(e) => panic!("{id}: {e:?}"),
        }
    }
}

/// Every connection is cut and new ones refused: the call ends with a retryable store
/// error, the handler not run; once the network is back, the redelivery runs it once.
async fn unreachable_at_claim(t: Target) {
    let (id, ledger) = (fresh_id(), Ledger::default());
    t.proxy.cut();
    let call = apply(order(&id, Duration::ZERO), &*t.proxied, &ledger, &nothing);
    let out = tokio::time::timeout(Duration::from_secs(30), call)
        .await
        .expect("a call on an unreachable store ends");
    let err = out.expect_err("an unreachable store processes nothing");
    assert!(matches!(err, Error::Store { handler_ran: false, .. }), "{err:?}");
    assert!(err.is_retryable(), "{err:?}");
    assert_eq!(ledger.count(&id), 0);
    t.proxy.restore();
    assert_eq!(deliver(&*t.proxied, &id, &ledger).await, Outcome::Processed(()));
    assert_eq!(ledger.count(&id), 1);
    assert_eq!(t.record(&id).await, Claim::Done);
}

/// The server records DONE but its reply is lost with the connection: the runtime
/// sends the completion again within the lease, the second answers as the first, and
/// the call is processed; a redelivery is a duplicate.
async fn done_reply_lost(t: Target) {
    let (id, ledger) = (fresh_id(), Ledger::default());
    // Work long enough for the claim's reply to be in, short of the first renewal.
    let hold = Duration::from_millis(100);
    let lose = || t.proxy.lose_next_reply();
    let out = apply(order(&id, hold), &*t.proxied, &ledger, &lose).await;
    assert_eq!(t.proxy.lost(), 1, "a reply was lost");
    assert!(matches!(out, Ok(Outcome::Processed(()))), "{out:?}");
    assert_eq!(t.record(&id).await, Claim::Done);
    assert_eq!(deliver(&*t.proxied, &id, &ledger).await, Outcome::Duplicate);
    assert_eq!(ledger.count(&id), 1);
}

/// Once the handler runs, every request and every reply takes [`ONE_WAY`] (more than
/// the lease) each way: the first renewal reaches the server after the lease ran out
/// and another consumer took the key over, and its answer, back later still, stops
/// the late consumer's body before the effect. One effect, the other consumer's; the
/// record is its DONE. (A round trip of 2.4 s is as slow as ZooKeeper's client, with
/// a 9 s session, takes for a link that still works.)
async fn replies_late_past_the_lease(t: Target) {
    let (id, ledger) = (fresh_id(), Ledger::default());
    // A message first, long enough to be renewed: the store's connections, its
    // renewals' own among them, are open before the link slows down, as in a
    // consumer that has been running.
    let warm = apply(order(&fresh_id(), LEASE), &*t.proxied, &ledger, &nothing).await;
    assert!(matches!(warm, Ok(Outcome::Processed(()))), "{warm:?}");
    let late = || {
        t.proxy.delay_requests(ONE_WAY);
        t.proxy.delay_replies(ONE_WAY);
    };
    let slow = async {
        let call = apply(order(&id, Duration::from_secs(8)), &*t.proxied, &ledger, &late);
        tokio::time::timeout(Duration::from_secs(20), call).await.expect("the late call ends")
    };
    let takeover = async {
        tokio::time::sleep(LEASE + Duration::from_millis(150)).await;
        deliver(&*t.direct, &id, &ledger).await
    };
    let (slow, takeover) = tokio::join!(slow, takeover);
    t.proxy.delay_requests(Duration::ZERO);
    t.proxy.delay_replies(Duration::ZERO);
    assert_eq!(takeover, Outcome::Processed(()));
    assert!(matches!(slow, Err(Error::LeaseLost { attempt: 1, .. })), "{slow:?}");
    assert_eq!(ledger.count(&id), 1, "the late consumer's body went on beside the new owner");
    assert_eq!(t.record(&id).await, Claim::Done);
}

/// Every connection is cut while the handler runs and the network comes back 300 ms
/// later, within the lease: the store reconnects, the lease holds, one effect, DONE.
async fn connections_cut_mid_handler(t: Target) {
    let (id, ledger, cut) = (fresh_id(), Ledger::default(), Notify::new());
    let fault = || {
        t.proxy.cut();
        cut.notify_one();
    };
    let call = apply(order(&id, LEASE * 5 / 2), &*t.proxied, &ledger, &fault);
    let heal = async {
        cut.notified().await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        t.proxy.restore();
    };
    let (out, ()) = tokio::join!(call, heal);
    assert!(matches!(out, Ok(Outcome::Processed(()))), "{out:?}");
    assert_eq!(ledger.count(&id), 1);
    assert_eq!(t.record(&id).await, Claim::Done);
}

/// The link stops delivering (connections open, nothing arrives) for 400 ms while the
/// handler runs, then the stalled connections are closed: the store reconnects, one
/// effect, DONE.
async fn link_stalls_mid_handler(t: Target) {
    let (id, ledger, stalled) = (fresh_id(), Ledger::default(), Notify::new());
    let fault = || {
        t.proxy.swallow();
        stalled.notify_one();
    };
    let call = apply(order(&id, LEASE * 5 / 2), &*t.proxied, &ledger, &fault);
    let heal = async {
        stalled.notified().await;
        tokio::time::sleep(Duration::from_millis(400)).await;
        t.proxy.release();
    };
    let (out, ()) = tokio::join!(call, heal);
    assert!(matches!(out, Ok(Outcome::Processed(()))), "{out:?}");
    assert_eq!(ledger.count(&id), 1);
    assert_eq!(t.record(&id).await, Claim::Done);
}

/// Runs `case` on a `redis-server` of its own behind a proxy.
fn on_redis<F: Future<Output = ()>>(case: impl FnOnce(Target) -> F) {
    if !support::have_redis_server() {
        return;
    }
    let server = RedisServer::start();
    block_on(async {
        let proxy = FaultProxy::start(server.port).await;
        let proxied = RedisStore::connect(proxy.url()).await.expect("Redis through the proxy");
        let direct =
            RedisStore::connect(format!("redis://127.0.0.1:{}", server.port)).await.expect("Redis");
        case(Target { proxy, proxied: Box::new(proxied), direct: Box::new(direct) }).await
    });
}

/// Runs `case` on the machine's ZooKeeper (`ZOOKEEPER_HOSTS`, its first host) behind a
/// proxy; outside CI, skipped when no server answers.
fn on_zookeeper<F: Future<Output = ()>>(case: impl FnOnce(Target) -> F) {
    let hosts = std::env::var("ZOOKEEPER_HOSTS").unwrap_or_else(|_| "127.0.0.1:2181".into());
    let first = hosts.split(',').next().unwrap_or_default().to_owned();
    let port: u16 = first.rsplit(':').next().and_then(|p| p.parse().ok()).expect("a port");
    if std::net::TcpStream::connect(&first).is_err() {
        assert!(std::env::var_os("CI").is_none(), "CI needs ZooKeeper at {first}");
        eprintln!("skipped: no ZooKeeper at {first}");
        return;
    }
    block_on(async {
        let (root, session) = ("/idempotent-test-network", Duration::from_secs(9));
        let proxy = FaultProxy::start(port).await;
        let proxied = zookeeper::connect(&proxy.address(), root, session).await;
        let direct = zookeeper::connect(&first, root, session).await;
        case(Target { proxy, proxied: Box::new(proxied), direct: Box::new(direct) }).await
    });
}

/// The port of the first host of a database URL.
fn url_port(url: &str, default: u16) -> u16 {
    let host = url.split('@').next_back().unwrap_or(url);
    let host = host.split('/').next().unwrap_or(host);
    host.rsplit_once(':').and_then(|(_, port)| port.parse().ok()).unwrap_or(default)
}

/// `url` with its host and port replaced by the proxy's.
fn through(url: &str, proxy: &FaultProxy) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let (auth, rest) = match rest.rsplit_once('@') {
        Some((auth, rest)) => (format!("{auth}@"), rest),
        None => (String::new(), rest),
    };
    let path = rest.split_once('/').map_or("", |(_, path)| path);
    format!("{scheme}://{auth}{}/{path}", proxy.address())
}

/// Runs `case` on the machine's PostgreSQL (`DATABASE_URL`) behind a proxy, on a
/// records table of its own.
fn on_postgres<F: Future<Output = ()>>(case: impl FnOnce(Target) -> F) {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    block_on(async {
        let direct = match PostgresStore::connect(&url).await {
            Ok(store) => store,
            Err(e) => {
                assert!(std::env::var_os("CI").is_none(), "CI needs PostgreSQL at {url}: {e}");
                return eprintln!("skipped: no PostgreSQL at {url}");
            }
        };
        let table = format!("net_faults_{:x}", Token::random().as_u128() as u64);
        let direct = direct.with_table(&table).unwrap();
        direct.migrate().await.unwrap();
        let proxy = FaultProxy::start(url_port(&url, 5432)).await;
        let proxied = PostgresStore::connect(&through(&url, &proxy)).await.unwrap();
        let proxied = proxied.with_table(&table).unwrap();
        case(Target { proxy, proxied: Box::new(proxied), direct: Box::new(direct.clone()) }).await;
        let drop = format!("DROP TABLE {table}");
        sqlx::query(sqlx::AssertSqlSafe(drop)).execute(direct.pool()).await.unwrap();
    });
}

/// Runs `case` on the machine's MySQL or MariaDB (`MYSQL_URL`) behind a proxy, on a
/// records table of its own.
fn on_mysql<F: Future<Output = ()>>(case: impl FnOnce(Target) -> F) {
    let url = mysql::url();
    block_on(async {
        let Some(pool) = mysql::pool(4).await else { return };
        let table = mysql::table("net_faults");
        let direct = MysqlStore::from_pool(pool.clone()).with_table(&table).unwrap();
        direct.migrate().await.unwrap();
        let proxy = FaultProxy::start(url_port(&url, 3306)).await;
        let proxied = MysqlStore::connect(&through(&url, &proxy)).await.unwrap();
        let proxied = proxied.with_table(&table).unwrap();
        case(Target { proxy, proxied: Box::new(proxied), direct: Box::new(direct) }).await;
        mysql::drop_tables(&pool, &[&table]).await;
    });
}

macro_rules! cases {
    ($($case:ident),* $(,)?) => {
        mod redis {$(
            #[test]
            fn $case() {
                super::on_redis(super::$case)
            }
        )*}
        mod zookeeper_store {$(
            #[test]
            fn $case() {
                super::on_zookeeper(super::$case)
            }
        )*}
        mod postgres {$(
            #[test]
            fn $case() {
                super::on_postgres(super::$case)
            }
        )*}
        mod mysql_store {$(
            #[test]
            fn $case() {
                super::on_mysql(super::$case)
            }
        )*}
    };
}

cases!(
    unreachable_at_claim,
    done_reply_lost,
    replies_late_past_the_lease,
    connections_cut_mid_handler,
    link_stalls_mid_handler,
);
