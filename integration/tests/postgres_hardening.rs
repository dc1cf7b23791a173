//! `PostgresStore` and the transactional mode under the conditions users' databases
//! have: handlers longer than the dedupe window, a non-default isolation level, a pool
//! smaller than the handlers in flight, a record row left locked by a dead consumer,
//! keys too long for an index. Each test has its own tables.

use std::time::Duration;

#[path = "support/postgres.rs"]
mod postgres;

use idempotent::{Claim, Classify, Key, Outcome, PostgresStore, Store, idempotent};
use sqlx::{AssertSqlSafe, PgPool, Postgres, Transaction};

#[derive(Debug, thiserror::Error, Classify)]
enum LedgerError {
    #[error("database: {0}")]
    #[idempotent(transparent)]
    Db(#[from] sqlx::Error),
}

/// A store with its own records table and a ledger table without unique constraint:
/// a message applied twice shows as two rows.
struct Ledger {
    store: PostgresStore,
    ledger: String,
}

impl Ledger {
    async fn open(pool: PgPool) -> Ledger {
        let suffix = idempotent::testing::fresh_key("hard").namespace().replace('-', "_");
        let ledger = format!("ledger_{suffix}");
        let store =
            PostgresStore::from_pool(pool).with_table(&format!("records_{suffix}")).unwrap();
        store.migrate().await.unwrap();
        let create = format!("CREATE TABLE {ledger} (message_id bigint NOT NULL)");
        sqlx::query(AssertSqlSafe(create)).execute(store.pool()).await.unwrap();
        Ledger { store, ledger }
    }

    /// The same tables through another pool: another consumer process.
    fn other_consumer(&self, pool: PgPool) -> Ledger {
        let table = self.table();
        let store = PostgresStore::from_pool(pool).with_table(&table).unwrap();
        Ledger { store, ledger: self.ledger.clone() }
    }

    fn table(&self) -> String {
        self.ledger.replacen("ledger_", "records_", 1)
    }

    async fn rows(&self, id: i64) -> i64 {
        let sql = format!("SELECT count(*) FROM {} WHERE message_id = $1", self.ledger);
        sqlx::query_scalar(AssertSqlSafe(sql)).bind(id).fetch_one(self.store.pool()).await.unwrap()
    }

    async fn write(&self, id: i64, tx: &mut Transaction<'_, Postgres>) -> Result<(), sqlx::Error> {
        let sql = format!("INSERT INTO {} (message_id) VALUES ($1)", self.ledger);
        sqlx::query(AssertSqlSafe(sql)).bind(id).execute(&mut **tx).await.map(drop)
    }
}

/// Writes one ledger row, then takes `hold` (the handler's own work).
#[idempotent(key = "{id}", store = ledger.store, transactional, ttl = "1s", lease = "300ms", namespace = "slow")]
async fn slow_write(
    id: i64,
    hold: Duration,
    ledger: &Ledger,
    tx: &mut Transaction<'_, Postgres>,
) -> Result<(), LedgerError> {
    ledger.write(id, tx).await?;
    tokio::time::sleep(hold).await;
    Ok(())
}

/// A handler that runs longer than `ttl` commits a DONE record that is still alive:
/// its expiry is counted from the commit, not from the transaction's start.
#[tokio::test]
async fn done_is_kept_for_ttl_after_a_handler_longer_than_ttl() {
    let Some(pool) = postgres::pool(4).await else { return };
    let ledger = Ledger::open(pool).await;
    let ran = slow_write(1, Duration::from_millis(1500), &ledger).await.unwrap();
    assert_eq!(ran, Outcome::Processed(()));
    let again = slow_write(1, Duration::ZERO, &ledger).await.unwrap();
    assert_eq!(again, Outcome::Duplicate, "the DONE record was born expired");
    assert_eq!(ledger.rows(1).await, 1);
}

/// With REPEATABLE READ (or SERIALIZABLE) as the database's default, lease renewals
/// from other connections would make the DONE update fail with 40001 every time.
#[tokio::test]
async fn a_snapshot_isolation_default_does_not_refuse_done() {
    let settings = [("default_transaction_isolation", "repeatable read")];
    let Some(pool) = postgres::pool_with(4, &settings).await else { return };
    let ledger = Ledger::open(pool).await;
    // 700 ms with a 300 ms lease: renewed twice while the transaction's snapshot holds.
    let ran = slow_write(2, Duration::from_millis(700), &ledger).await;
    assert!(matches!(ran, Ok(Outcome::Processed(()))), "{ran:?}");
    assert_eq!(ledger.rows(2).await, 1);
}

/// A pool whose only connection is held by the handler's transaction: the lease is
/// still renewed, so another consumer finds the key in progress, not free.
#[tokio::test]
async fn a_full_pool_does_not_let_the_lease_lapse() {
    let (Some(one), Some(other)) = (postgres::pool(1).await, postgres::pool(2).await) else {
        return;
    };
    let ledger = Ledger::open(one).await;
    let rival = ledger.other_consumer(other);
    let running = slow_write(3, Duration::from_millis(1200), &ledger);
    let probe = async {
        // Four leases after the claim, without renewal it would have lapsed.
        tokio::time::sleep(Duration::from_millis(900)).await;
        slow_write(3, Duration::ZERO, &rival).await
    };
    let (ran, probed) = tokio::join!(running, probe);
    assert!(matches!(ran, Ok(Outcome::Processed(()))), "{ran:?}");
    assert!(matches!(probed, Ok(Outcome::InProgress { .. })), "the lease lapsed: {probed:?}");
    assert_eq!(ledger.rows(3).await, 1);
}

/// A record row locked by a consumer that died between its DONE update and COMMIT
/// (its backend holds the lock until TCP gives up): a duplicate's claim answers
/// InProgress after the store's lock timeout instead of blocking.
#[tokio::test]
async fn a_locked_record_answers_in_progress() {
    let Some(pool) = postgres::pool(4).await else { return };
    let ledger = Ledger::open(pool).await;
    let key = Key::new("locked", "7").unwrap();
    let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(60));
    let Claim::Won { .. } = ledger.store.claim(&key, lease, ttl, None).await.unwrap() else {
        panic!("fresh key");
    };
    let mut stuck = ledger.store.pool().begin().await.unwrap();
    let lock = format!("SELECT 1 FROM {} WHERE key = $1 FOR UPDATE", ledger.table());
    sqlx::query(AssertSqlSafe(lock)).bind(key.as_bytes()).execute(&mut *stuck).await.unwrap();
    // Expire the lease so the claim would take the row over if it could lock it.
    let started = std::time::Instant::now();
    let claim = tokio::time::timeout(
        Duration::from_secs(20),
        ledger.store.claim(&key, Duration::from_millis(50), ttl, None),
    )
    .await
    .expect("the claim blocked on the locked row");
    assert!(matches!(claim.unwrap(), Claim::InProgress { .. }));
    assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
    stuck.rollback().await.unwrap();
}

/// A key too long for a btree index entry, which a producer can send on purpose, is
/// stored under its hash, and is deduplicated like any other.
#[tokio::test]
async fn keys_too_long_for_an_index_are_stored_hashed() {
    let Some(pool) = postgres::pool(4).await else { return };
    let ledger = Ledger::open(pool).await;
    // 10 KB that do not compress.
    let mut state = 0x9E37_79B9_7F4A_7C15_u64;
    let noise: String = (0..10_000)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut x = state;
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            char::from(b'!' + ((x ^ (x >> 31)) % 90) as u8)
        })
        .collect();
    let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(60));
    let key = Key::new("long", &noise).unwrap();
    let Claim::Won { token, .. } = ledger.store.claim(&key, lease, ttl, None).await.unwrap() else {
        panic!("fresh key");
    };
    let done = ledger.store.complete(&key, token, ttl, None).await.unwrap();
    assert_eq!(done, idempotent::Transition::Applied);
    assert_eq!(ledger.store.claim(&key, lease, ttl, None).await.unwrap(), Claim::Done);
    let sibling = Key::new("long", format!("{noise}!")).unwrap();
    assert!(matches!(ledger.store.claim(&sibling, lease, ttl, None).await, Ok(Claim::Won { .. })));
}

/// A pool whose `after_connect` sets the `search_path` (sqlx's own example of the
/// hook) to the schema the records table is in, named without its schema: lease
/// renewals run on connections of their own, which must get the same session, or
/// every renewal misses the table, the lease lapses mid-handler and another consumer
/// runs the message again.
#[tokio::test]
async fn renewals_get_the_session_after_connect_sets() {
    use sqlx::Executor;
    let Some(admin) = postgres::pool(2).await else { return };
    let suffix = idempotent::testing::fresh_key("path").namespace().replace('-', "_");
    let schema = format!("sp_{suffix}");
    sqlx::query(AssertSqlSafe(format!("CREATE SCHEMA {schema}"))).execute(&admin).await.unwrap();
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let pool = |connections| {
        let set = format!("SET search_path TO {schema}");
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(connections)
            .after_connect(move |conn, _| {
                let set = set.clone();
                Box::pin(async move { conn.execute(AssertSqlSafe(set)).await.map(drop) })
            })
            .connect(&url)
    };
    let (one, other) = (pool(1).await.unwrap(), pool(2).await.unwrap());
    let store = PostgresStore::from_pool(one).with_table("records").unwrap();
    store.migrate().await.unwrap();
    let create = "CREATE TABLE ledger (message_id bigint NOT NULL)";
    sqlx::query(create).execute(store.pool()).await.unwrap();
    let ledger = Ledger { store, ledger: format!("{schema}.ledger") };
    let rival = Ledger {
        store: PostgresStore::from_pool(other).with_table("records").unwrap(),
        ledger: ledger.ledger.clone(),
    };
    let running = slow_write(4, Duration::from_millis(1200), &ledger);
    let probe = async {
        tokio::time::sleep(Duration::from_millis(900)).await;
        slow_write(4, Duration::ZERO, &rival).await
    };
    let (ran, probed) = tokio::join!(running, probe);
    assert!(matches!(ran, Ok(Outcome::Processed(()))), "{ran:?}");
    assert!(matches!(probed, Ok(Outcome::InProgress { .. })), "the lease lapsed: {probed:?}");
    assert_eq!(ledger.rows(4).await, 1);
    sqlx::query(AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&admin)
        .await
        .unwrap();
}

/// `migrate()` dropped at any moment (a start-up `timeout`, a `select!`), on a pool
/// of one connection: that connection is never pooled inside a transaction, so every
/// claim made on it afterwards is committed and seen by another connection.
#[tokio::test]
async fn migrate_dropped_midway_leaves_no_connection_inside_a_transaction() {
    let (Some(one), Some(other)) = (postgres::pool(1).await, postgres::pool(1).await) else {
        return;
    };
    let ledger = Ledger::open(one).await;
    let store = &ledger.store;
    let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(60));
    let namespace = idempotent::testing::fresh_key("migrate").namespace().to_owned();
    for i in 0..200u64 {
        // Polled a few times, a millisecond apart, then dropped: at one of them its
        // BEGIN has been sent and its answer not read yet.
        poll_then_drop(store.migrate(), 1 + i as usize % 12).await;
        let key = Key::new(&namespace, i.to_string()).unwrap();
        assert!(matches!(store.claim(&key, lease, ttl, None).await.unwrap(), Claim::Won { .. }));
    }
    let sql = format!("SELECT count(*) FROM {} WHERE state = 'P'", ledger.table());
    let seen: i64 = sqlx::query_scalar(AssertSqlSafe(sql)).fetch_one(&other).await.unwrap();
    assert_eq!(seen, 200, "claims made on a connection left inside a transaction");
}

/// Polls `call` up to `times` times, a millisecond apart, then drops it.
async fn poll_then_drop<F: std::future::Future>(call: F, times: usize) {
    let mut call = std::pin::pin!(call);
    for _ in 0..times {
        if futures_util::poll!(call.as_mut()).is_ready() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// A records table nobody made (`migrate()` forgotten, `with_table` mistyped): `check`
/// and every claim answer `Misconfigured`, naming `migrate()`, so the call is retried,
/// never dead-lettered, and says what to do instead of "store unavailable".
#[tokio::test]
async fn a_missing_records_table_says_to_run_migrate() {
    let Some(pool) = postgres::pool(2).await else { return };
    let suffix = idempotent::testing::fresh_key("none").namespace().replace('-', "_");
    let store = PostgresStore::from_pool(pool).with_table(&format!("never_made_{suffix}")).unwrap();
    let checked = store.check().await.unwrap_err();
    let misconfigured = |e: &idempotent::StoreError| matches!(e, idempotent::StoreError::Misconfigured(why) if why.contains("migrate()"));
    assert!(misconfigured(&checked), "{checked}");
    let key = Key::new("missing", "1").unwrap();
    let claimed = store.claim(&key, Duration::from_secs(5), Duration::from_secs(60), None).await;
    let err = claimed.unwrap_err();
    assert!(misconfigured(&err), "{err}");
}

/// A transactional handler that idles inside its transaction past the database's
/// `idle_in_transaction_session_timeout` (which the README recommends) has its session
/// ended by the server (25P03): retried, not dead-lettered on its first attempt, and
/// the redelivery writes once.
#[tokio::test]
async fn a_session_ended_for_idling_in_its_transaction_is_retried() {
    let settings = [("idle_in_transaction_session_timeout", "300ms")];
    let Some(pool) = postgres::pool_with(4, &settings).await else { return };
    let ledger = Ledger::open(pool).await;
    #[idempotent(key = "{id}", store = ledger.store, transactional, lease = "2s", namespace = "idle")]
    async fn idle_then_write(
        id: i64,
        idle: Duration,
        ledger: &Ledger,
        tx: &mut Transaction<'_, Postgres>,
    ) -> Result<(), LedgerError> {
        ledger.write(id, tx).await?;
        tokio::time::sleep(idle).await;
        ledger.write(id, tx).await?;
        Ok(())
    }
    let first = idle_then_write(5, Duration::from_millis(800), &ledger).await;
    let err = first.unwrap_err();
    assert!(err.is_retryable(), "dead-lettered: {err:?}");
    let again = idle_then_write(5, Duration::ZERO, &ledger).await;
    assert!(matches!(again, Ok(Outcome::Processed(()))), "{again:?}");
    assert_eq!(ledger.rows(5).await, 2, "the redelivery's two rows, none of the first");
}
