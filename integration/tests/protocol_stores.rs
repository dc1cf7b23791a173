//! The reference protocol (`support/protocol.rs`, the one the model checker explores)
//! against every real store: random sequences of claims, completions, releases,
//! failures and renewals by three consumers on two keys, with some claims carrying
//! payload fingerprints and some completions caching a result, and leases lapsing
//! between steps. Each answer a store gives must be the one the reference gives, and
//! after each sequence each record, as `Admin::inspect` reads it, must hold the
//! reference's state, attempts and lease. Any difference fails, and proptest shrinks
//! the sequence to a short one.
//!
//! `MemoryStore` runs on paused Tokio time (a lapse is `advance`); the servers run on
//! their own clocks with a short real lease (a lapse is a sleep past it). Every
//! sequence works in a fresh namespace. `PROTOCOL_CASES` sets the sequences per
//! store (default 256 in memory, 16 on a server). One key's id holds the bytes a
//! hostile producer might send (NUL, invalid UTF-8, separators, pattern characters);
//! the other is longer than stores keep whole.

mod support;

#[path = "support/mysql.rs"]
mod mysql;
#[path = "support/postgres.rs"]
mod postgres;
#[path = "support/protocol.rs"]
mod protocol;
#[path = "support/zookeeper.rs"]
mod zookeeper;

use std::time::{Duration, Instant};

use idempotent::admin::{self, Admin};
use idempotent::{
    Claim, Fingerprint, Key, MemoryStore, MysqlStore, PostgresStore, RedisStore, Store, Token,
    Transition, ZooKeeperStore, testing,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestError, TestRunner};
use protocol::{Answer, Fences, ModelToken, RefStore, State, Verdict};

const CONSUMERS: usize = 3;
const KEYS: u8 = 2;
/// The model's lease, in ticks; a lapse moves its clock one lease and a tick on.
const LEASE_TICKS: u32 = 10;
const TTL: Duration = Duration::from_secs(3600);

#[derive(Clone, Debug)]
enum Op {
    Claim {
        c: usize,
        k: u8,
        fingerprint: Option<u8>,
    },
    Complete {
        c: usize,
        k: u8,
        cached: Option<u8>,
    },
    Release {
        c: usize,
        k: u8,
    },
    Fail {
        c: usize,
        k: u8,
    },
    Renew {
        c: usize,
        k: u8,
    },
    /// Every lease held now lapses.
    Lapse,
}

fn op() -> impl Strategy<Value = Op> {
    let c = 0..CONSUMERS;
    let k = 0..KEYS;
    prop_oneof![
        6 => (c.clone(), k.clone(), prop::option::weighted(0.3, 0..2u8))
            .prop_map(|(c, k, fingerprint)| Op::Claim { c, k, fingerprint }),
        3 => (c.clone(), k.clone(), prop::option::weighted(0.3, any::<u8>()))
            .prop_map(|(c, k, cached)| Op::Complete { c, k, cached }),
        2 => (c.clone(), k.clone()).prop_map(|(c, k)| Op::Release { c, k }),
        2 => (c.clone(), k.clone()).prop_map(|(c, k)| Op::Fail { c, k }),
        2 => (c, k).prop_map(|(c, k)| Op::Renew { c, k }),
        1 => Just(Op::Lapse),
    ]
}

/// How a store's leases are made to lapse.
#[derive(Clone, Copy)]
enum Clock {
    /// Paused Tokio time: a lapse is `tokio::time::advance`.
    Paused,
    /// The server's clock: a lapse is a sleep of the lease and a margin. A lease the
    /// reference holds live must be younger than `LIVE_FOR` of it, or the sequence is
    /// too slow to judge (rejected, not failed).
    Real,
}

impl Clock {
    fn lease(self) -> Duration {
        match self {
            Clock::Paused => Duration::from_secs(10),
            Clock::Real => Duration::from_millis(1000),
        }
    }

    async fn lapse(self) {
        match self {
            Clock::Paused => tokio::time::advance(self.lease() + Duration::from_secs(1)).await,
            Clock::Real => tokio::time::sleep(self.lease() + Duration::from_millis(250)).await,
        }
    }
}

/// The share of a real lease within which the reference's "live" is trusted.
const LIVE_FOR: f64 = 0.6;

/// One sequence on one store, in namespace `namespace`.
struct Replay<'a, S> {
    store: &'a S,
    clock: Clock,
    model: RefStore<u8>,
    now: u32,
    keys: Vec<Key>,
    /// Each consumer's last won claim on each key: the model's token and the store's.
    held: [[Option<(ModelToken, Token)>; KEYS as usize]; CONSUMERS],
    /// When each key's lease, as the reference has it, was last granted.
    granted: [Option<Instant>; KEYS as usize],
}

fn fingerprint(value: u8) -> Fingerprint {
    Fingerprint::of([b'f', value].as_slice())
}

impl<S: Store + Admin> Replay<'_, S> {
    /// Rejects the sequence when a lease the reference holds live may have run out on
    /// the server's clock: only a stall of the test (not the store) gets here.
    fn check_timing(&self, k: u8) -> Result<(), TestCaseError> {
        let live = matches!(self.model.state(&k), Some(State::InProgress { lease_until, .. }) if lease_until > self.now);
        if let (Clock::Real, true, Some(at)) = (self.clock, live, self.granted[k as usize])
            && at.elapsed().as_secs_f64() > self.clock.lease().as_secs_f64() * LIVE_FOR
        {
            return Err(TestCaseError::reject("the test stalled past a lease"));
        }
        Ok(())
    }

    /// Whether `left`, a store's answer for how long `k`'s live lease has left, is the
    /// reference's: exactly, on paused time (nothing moves the clock but a lapse, which
    /// ends every lease); on a server, no more than the lease and no less than what
    /// is left of it since the grant was sent, with 250 ms for the answer's way back.
    fn lease_left_agrees(&self, k: u8, left: Option<Duration>) -> bool {
        let lease = self.clock.lease();
        match (self.clock, left, self.granted[k as usize]) {
            (Clock::Paused, Some(left), _) => left == lease,
            (Clock::Real, Some(left), Some(granted)) => {
                let least = lease.saturating_sub(granted.elapsed() + Duration::from_millis(250));
                (least..=lease).contains(&left)
            }
            _ => false,
        }
    }

    async fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
        let lease = self.clock.lease();
        match *op {
            Op::Claim { c, k, fingerprint: fp } => {
                self.check_timing(k)?;
                let key = &self.keys[k as usize];
                let fp_real = fp.map(fingerprint);
                // The server's lease starts after this, at the latest.
                let sent = Instant::now();
                let real = self.store.claim(key, lease, TTL, fp_real.as_ref()).await;
                let real = real.map_err(|e| TestCaseError::fail(format!("claim: {e}")))?;
                let expected = self.model.claim(&k, self.now, LEASE_TICKS, fp);
                match (expected, &real) {
                    (
                        Answer::Won { token, attempt },
                        Claim::Won { token: real_token, attempt: a, .. },
                    ) if attempt == *a => {
                        self.held[c][k as usize] = Some((token, *real_token));
                        self.granted[k as usize] = Some(sent);
                    }
                    (Answer::Done, Claim::Done) | (Answer::Mismatch, Claim::Mismatch) => {}
                    (Answer::Cached(b), Claim::Cached(bytes)) if bytes[..] == [b] => {}
                    (Answer::Failed { attempts }, Claim::Failed { attempts: a })
                        if attempts == *a => {}
                    (Answer::InProgress, Claim::InProgress { lease_left })
                        if self.lease_left_agrees(k, *lease_left) => {}
                    _ => {
                        return Err(TestCaseError::fail(format!(
                            "{op:?}: the store answered {real:?}, the reference {expected:?}"
                        )));
                    }
                }
            }
            Op::Complete { c, k, .. }
            | Op::Release { c, k }
            | Op::Fail { c, k }
            | Op::Renew { c, k } => {
                self.check_timing(k)?;
                let key = &self.keys[k as usize];
                // A consumer that never won this key uses a token nobody was given.
                let (token, real_token) = self.held[c][k as usize].unwrap_or((0, Token::random()));
                let sent = Instant::now();
                let real = match *op {
                    Op::Complete { cached, .. } => {
                        let result = cached.map(|b| [b]);
                        self.store
                            .complete(key, real_token, TTL, result.as_ref().map(|r| &r[..]))
                            .await
                    }
                    Op::Release { .. } => self.store.release(key, real_token).await,
                    Op::Fail { .. } => self.store.fail(key, real_token, TTL).await,
                    _ => self.store.renew(key, real_token, lease, TTL).await,
                };
                let real = real.map_err(|e| TestCaseError::fail(format!("{op:?}: {e}")))?;
                let applied = |done| if done { Verdict::Applied } else { Verdict::LeaseLost };
                let expected = match *op {
                    Op::Complete { cached, .. } => self.model.complete(&k, token, cached),
                    Op::Release { .. } => self.model.release(&k, token),
                    Op::Fail { .. } => self.model.fail(&k, token),
                    _ => {
                        let renewed = self.model.renew(&k, token, self.now, LEASE_TICKS);
                        if renewed {
                            self.granted[k as usize] = Some(sent);
                        }
                        applied(renewed)
                    }
                };
                let agrees = match expected {
                    Verdict::Applied => real == Transition::Applied,
                    Verdict::LeaseLost => real == Transition::LeaseLost,
                    Verdict::Either => true,
                };
                prop_assert!(
                    agrees,
                    "{:?}: the store answered {:?}, the reference {:?}",
                    op,
                    real,
                    expected
                );
            }
            Op::Lapse => {
                self.clock.lapse().await;
                self.now += LEASE_TICKS + 1;
            }
        }
        Ok(())
    }

    /// Each record as the store holds it against the reference's.
    async fn compare_records(&self) -> Result<(), TestCaseError> {
        for k in 0..KEYS {
            self.check_timing(k)?;
            let key = &self.keys[k as usize];
            let real =
                self.store.inspect(key).await.map_err(|e| TestCaseError::fail(e.to_string()))?;
            let expected = self.model.records.get(&k);
            match (expected, real) {
                (None, None) => {}
                (Some(expected), Some(real)) => {
                    let (state, live) = match expected.state {
                        State::InProgress { lease_until, .. } => {
                            (admin::State::InProgress, lease_until > self.now)
                        }
                        State::Released { .. } => (admin::State::Released, false),
                        State::Done { .. } => (admin::State::Done, false),
                        State::Failed { .. } => (admin::State::Failed, false),
                    };
                    prop_assert_eq!(real.state, state, "{}", key);
                    prop_assert_eq!(real.attempts, expected.attempts, "{}", key);
                    if live {
                        prop_assert!(
                            self.lease_left_agrees(k, real.lease_left),
                            "{}: {:?} of the lease left",
                            key,
                            real.lease_left
                        );
                    } else {
                        prop_assert_eq!(real.lease_left, None, "{}: a lapsed lease", key);
                    }
                    prop_assert_eq!(
                        real.fingerprint.is_some(),
                        expected.fingerprint.is_some(),
                        "{}",
                        key
                    );
                    let cached = matches!(expected.state, State::Done { cached: Some(_), .. });
                    prop_assert_eq!(real.result_len, cached.then_some(1), "{}: cached result", key);
                }
                (expected, real) => {
                    return Err(TestCaseError::fail(format!(
                        "{key}: the store holds {real:?}, the reference {expected:?}"
                    )));
                }
            }
        }
        Ok(())
    }
}

async fn replay<S: Store + Admin>(
    store: &S,
    clock: Clock,
    ops: &[Op],
) -> Result<(), TestCaseError> {
    let namespace = testing::fresh_key("protocol").namespace().to_owned();
    let mut replay = Replay {
        store,
        clock,
        model: RefStore::new(Fences::ALL),
        now: 0,
        keys: vec![
            // Bytes a hostile producer may put in an id: NUL, invalid UTF-8, line
            // breaks, the separator, glob and Lua pattern characters.
            Key::new(&namespace, b"k\0\xff\n\r:*?[%]{}'\"").unwrap(),
            // An id longer than stores keep whole (kept under its hash).
            Key::new(&namespace, vec![b'k'; idempotent::MAX_STORED_ID_LEN + 1]).unwrap(),
        ],
        held: [[None; KEYS as usize]; CONSUMERS],
        granted: [None; KEYS as usize],
    };
    for op in ops {
        replay.step(op).await?;
    }
    replay.compare_records().await
}

fn cases(default: u32) -> u32 {
    std::env::var("PROTOCOL_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(default)
}

/// Replays `cases` random sequences of up to `len` operations on `store` and the
/// reference, on `rt`.
fn follow<S: Store + Admin>(
    rt: &tokio::runtime::Runtime,
    store: &S,
    clock: Clock,
    cases: u32,
    len: usize,
) {
    let config = Config {
        cases,
        max_global_rejects: cases * 4,
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let sequences = prop::collection::vec(op(), 1..len);
    match runner.run(&sequences, |ops| rt.block_on(replay(store, clock, &ops))) {
        Ok(()) => {}
        Err(TestError::Fail(why, ops)) => panic!("{why}\nminimal sequence: {ops:#?}"),
        Err(e) => panic!("{e}"),
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

#[test]
fn memory_store_follows_the_reference() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    let store = MemoryStore::new();
    follow(&rt, &store, Clock::Paused, cases(256), 40);
}

#[test]
fn redis_store_follows_the_reference() {
    let rt = runtime();
    let Some(store) = rt.block_on(support::shared_store()) else { return };
    follow(&rt, &store, Clock::Real, cases(16), 24);
}

/// Claims by the Lua script alone, as before Redis 7 (no `SET NX GET`).
#[test]
fn redis_store_with_claims_by_script_follows_the_reference() {
    let rt = runtime();
    let Some(store) = rt.block_on(support::shared_store()) else { return };
    let store = store.with_claims_by_script();
    follow(&rt, &store, Clock::Real, cases(16), 24);
}

/// Through a 3-master Cluster of the test's own, each call routed by its key's slot.
#[test]
fn redis_cluster_store_follows_the_reference() {
    if !support::have_redis_server() {
        return;
    }
    let cluster = support::RedisCluster::start();
    let rt = runtime();
    let store = rt.block_on(RedisStore::cluster(cluster.urls())).expect("cluster reachable");
    follow(&rt, &store, Clock::Real, cases(16), 24);
}

#[test]
fn postgres_store_follows_the_reference() {
    let rt = runtime();
    let table =
        format!("idempotent_protocol_{}", testing::fresh_key("t").namespace().replace('-', "_"));
    let Some(store) = rt.block_on(async {
        let store = PostgresStore::from_pool(postgres::pool(4).await?).with_table(&table).unwrap();
        store.migrate().await.expect("migration");
        Some(store)
    }) else {
        return;
    };
    follow(&rt, &store, Clock::Real, cases(16), 24);
    rt.block_on(async {
        let drop = format!("DROP TABLE {table}");
        sqlx::query(sqlx::AssertSqlSafe(drop)).execute(store.pool()).await.unwrap();
    });
}

#[test]
fn mysql_store_follows_the_reference() {
    let rt = runtime();
    let table = mysql::table("idempotent_protocol");
    let Some(store) = rt.block_on(async {
        let store = MysqlStore::from_pool(mysql::pool(4).await?).with_table(&table).unwrap();
        store.migrate().await.expect("migration");
        Some(store)
    }) else {
        return;
    };
    follow(&rt, &store, Clock::Real, cases(16), 24);
    rt.block_on(mysql::drop_tables(store.pool(), &[&table]));
}

#[test]
fn zookeeper_store_follows_the_reference() {
    let rt = runtime();
    let root = format!("/idempotent-protocol-test/{}", testing::fresh_key("zk").namespace());
    let session = Duration::from_secs(6);
    let (store, _server) = rt
        .block_on(async {
            let hosts =
                std::env::var("ZOOKEEPER_HOSTS").unwrap_or_else(|_| "127.0.0.1:2181".into());
            match ZooKeeperStore::connect_with(&hosts, &root, session).await {
                Ok(store) => return Some((store, None)),
                Err(e) => eprintln!("no ZooKeeper at {hosts} ({e}): starting one"),
            }
            let server = zookeeper::ZooKeeperServer::start()?;
            let store = zookeeper::connect(&server.hosts(), &root, session).await;
            Some((store, Some(server)))
        })
        .unzip();
    let Some(store) = store else { return };
    follow(&rt, &store, Clock::Real, cases(16), 24);
}
