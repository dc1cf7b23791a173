//! `MysqlStore` and the transactional mode under the conditions users' servers have:
//! handlers longer than the dedupe window, REPEATABLE READ (both servers' default)
//! with its gap locks and snapshots, a pool smaller than the handlers in flight, and a
//! record row left locked by a dead consumer. Each test has its own tables.

use std::sync::Arc;
use std::time::Duration;

#[path = "support/mysql.rs"]
mod mysql;

use idempotent::{Claim, Classify, Error, Key, MysqlStore, Outcome, Store, idempotent};
use sqlx::{AssertSqlSafe, MySql, MySqlPool, Transaction};
use tokio::sync::Barrier;

#[derive(Debug, thiserror::Error, Classify)]
enum LedgerError {
    #[error("database: {0}")]
    #[idempotent(transparent)]
    Db(#[from] sqlx::Error),
}

/// A store with its own records table and a ledger table without unique constraint:
/// a message applied twice shows as two rows.
struct Ledger {
    store: MysqlStore,
    records: String,
    ledger: String,
}

impl Ledger {
    async fn open(pool: MySqlPool) -> Ledger {
        let records = mysql::table("records");
        let ledger = records.replacen("records", "ledger", 1);
        let store = MysqlStore::from_pool(pool).with_table(&records).unwrap();
        store.migrate().await.unwrap();
        let create =
            format!("CREATE TABLE {ledger} (message_id bigint NOT NULL, KEY (message_id))");
        sqlx::query(AssertSqlSafe(create)).execute(store.pool()).await.unwrap();
        Ledger { store, records, ledger }
    }

    /// The same tables through another pool: another consumer process.
    fn other_consumer(&self, pool: MySqlPool) -> Ledger {
        let store = MysqlStore::from_pool(pool).with_table(&self.records).unwrap();
        Ledger { store, records: self.records.clone(), ledger: self.ledger.clone() }
    }

    async fn rows(&self, id: i64) -> i64 {
        let sql = format!("SELECT count(*) FROM {} WHERE message_id = ?", self.ledger);
        sqlx::query_scalar(AssertSqlSafe(sql)).bind(id).fetch_one(self.store.pool()).await.unwrap()
    }

    async fn write(&self, id: i64, tx: &mut Transaction<'_, MySql>) -> Result<(), sqlx::Error> {
        let sql = format!("INSERT INTO {} (message_id) VALUES (?)", self.ledger);
        sqlx::query(AssertSqlSafe(sql)).bind(id).execute(&mut **tx).await.map(drop)
    }

    /// A consistent read of the records table: under REPEATABLE READ it fixes the
    /// transaction's snapshot.
    async fn read_records(&self, tx: &mut Transaction<'_, MySql>) -> Result<i64, sqlx::Error> {
        let sql = format!("SELECT count(*) FROM {}", self.records);
        sqlx::query_scalar(AssertSqlSafe(sql)).fetch_one(&mut **tx).await
    }

    async fn drop_tables(&self) {
        mysql::drop_tables(self.store.pool(), &[&self.records, &self.ledger]).await;
    }
}

/// Writes one ledger row, then takes `hold` (the handler's own work).
#[idempotent(key = "{id}", store = ledger.store, transactional, ttl = "1s", lease = "300ms", namespace = "slow")]
async fn slow_write(
    id: i64,
    hold: Duration,
    ledger: &Ledger,
    tx: &mut Transaction<'_, MySql>,
) -> Result<(), LedgerError> {
    ledger.read_records(tx).await?;
    ledger.write(id, tx).await?;
    tokio::time::sleep(hold).await;
    Ok(())
}

/// The session settings of a server that keeps REPEATABLE READ snapshots strictly:
/// MariaDB's `innodb_snapshot_isolation` (10.6.18+, on by default from 11.8) makes a
/// locking read of a row changed since the snapshot fail (error 1020). `None` for a
/// server without it.
async fn strict_snapshots() -> Option<Vec<&'static str>> {
    let pool = mysql::pool(1).await?;
    let known = sqlx::query("SELECT @@innodb_snapshot_isolation").execute(&pool).await.is_ok();
    let mut settings = vec!["SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ"];
    if known {
        settings.push("SET SESSION innodb_snapshot_isolation = ON");
    } else {
        eprintln!("no innodb_snapshot_isolation on this server: plain REPEATABLE READ");
    }
    Some(settings)
}

/// A handler that runs longer than `ttl` commits a DONE record that is still alive:
/// its expiry is counted from the DONE statement, not from the transaction's start.
#[tokio::test]
async fn done_is_kept_for_ttl_after_a_handler_longer_than_ttl() {
    let Some(pool) = mysql::pool(4).await else { return };
    let ledger = Ledger::open(pool).await;
    let ran = slow_write(1, Duration::from_millis(1500), &ledger).await.unwrap();
    assert_eq!(ran, Outcome::Processed(()));
    let again = slow_write(1, Duration::ZERO, &ledger).await.unwrap();
    assert_eq!(again, Outcome::Duplicate, "the DONE record was born expired");
    assert_eq!(ledger.rows(1).await, 1);
    ledger.drop_tables().await;
}

/// Under REPEATABLE READ with strict snapshots, lease renewals from other connections
/// change the record after the handler's snapshot: the DONE update must still see it
/// as it is (the handler's transaction runs at READ COMMITTED).
#[tokio::test]
async fn renewals_after_the_handlers_snapshot_do_not_refuse_done() {
    let Some(settings) = strict_snapshots().await else { return };
    let Some(pool) = mysql::pool_with(4, &settings).await else { return };
    let ledger = Ledger::open(pool).await;
    // 700 ms with a 300 ms lease: renewed twice after the snapshot was taken.
    let ran = slow_write(2, Duration::from_millis(700), &ledger).await;
    assert!(matches!(ran, Ok(Outcome::Processed(()))), "{ran:?}");
    assert_eq!(ledger.rows(2).await, 1);
    ledger.drop_tables().await;
}

/// Reads the records table (fixing a REPEATABLE READ snapshot), writes one ledger
/// row, then hands the record's claim to another token from another connection, as a
/// consumer that took over an expired lease would. The lease is long: no renewal
/// notices the takeover before the DONE update does.
#[idempotent(key = "{id}", store = ledger.store, transactional, namespace = "taken")]
async fn taken_over_write(
    id: i64,
    ledger: &Ledger,
    tx: &mut Transaction<'_, MySql>,
) -> Result<(), LedgerError> {
    ledger.read_records(tx).await?;
    ledger.write(id, tx).await?;
    let key = Key::new("taken", id.to_string()).unwrap();
    let sql = format!("UPDATE {} SET token = X'01' WHERE `key` = ?", ledger.records);
    sqlx::query(AssertSqlSafe(sql)).bind(key.as_bytes()).execute(ledger.store.pool()).await?;
    Ok(())
}

/// A consumer that took the key over after the handler's snapshot was taken is seen
/// by the DONE update, which finds the token changed: the call is `LeaseLost` and the
/// business row rolls back, with REPEATABLE READ and strict snapshots as the
/// session's default.
#[tokio::test]
async fn a_takeover_after_the_handlers_snapshot_is_seen_by_done() {
    let Some(settings) = strict_snapshots().await else { return };
    let Some(pool) = mysql::pool_with(4, &settings).await else { return };
    let ledger = Ledger::open(pool).await;
    let ran = taken_over_write(3, &ledger).await;
    assert!(matches!(ran, Err(Error::LeaseLost { attempt: 1, .. })), "{ran:?}");
    assert_eq!(ledger.rows(3).await, 0);
    ledger.drop_tables().await;
}

/// Writes the message's ledger row unless a locking read finds it, the usual
/// hand-written guard; `meet` holds both handlers between the read and the write.
#[idempotent(key = "{id}", store = ledger.store, transactional, namespace = "guard")]
async fn guarded_write(
    id: i64,
    meet: Arc<Barrier>,
    ledger: &Ledger,
    tx: &mut Transaction<'_, MySql>,
) -> Result<(), LedgerError> {
    let sql = format!("SELECT message_id FROM {} WHERE message_id = ? FOR UPDATE", ledger.ledger);
    let found: Option<i64> =
        sqlx::query_scalar(AssertSqlSafe(sql)).bind(id).fetch_optional(&mut **tx).await?;
    meet.wait().await;
    if found.is_none() {
        ledger.write(id, tx).await?;
    }
    Ok(())
}

/// Two handlers for neighbouring messages, each reading its (missing) ledger row with
/// a locking read before writing it: at REPEATABLE READ each read locks the same gap
/// and each insert waits on the other's, a deadlock; at READ COMMITTED, where the
/// handlers' transactions run, there are no gap locks and both go through.
#[tokio::test]
async fn gap_locks_do_not_deadlock_neighbouring_handlers() {
    let settings = ["SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ"];
    let Some(pool) = mysql::pool_with(6, &settings).await else { return };
    let ledger = Ledger::open(pool).await;
    // Rows on either side, so that both ids fall into one gap.
    for id in [10, 20] {
        let sql = format!("INSERT INTO {} (message_id) VALUES (?)", ledger.ledger);
        sqlx::query(AssertSqlSafe(sql)).bind(id).execute(ledger.store.pool()).await.unwrap();
    }
    let meet = Arc::new(Barrier::new(2));
    let (a, b) = tokio::join!(
        guarded_write(14, meet.clone(), &ledger),
        guarded_write(16, meet.clone(), &ledger)
    );
    assert!(matches!(a, Ok(Outcome::Processed(()))), "{a:?}");
    assert!(matches!(b, Ok(Outcome::Processed(()))), "{b:?}");
    assert_eq!((ledger.rows(14).await, ledger.rows(16).await), (1, 1));
    ledger.drop_tables().await;
}

/// A pool whose only connection is held by the handler's transaction: the lease is
/// still renewed, so another consumer finds the key in progress, not free.
#[tokio::test]
async fn a_full_pool_does_not_let_the_lease_lapse() {
    let (Some(one), Some(other)) = (mysql::pool(1).await, mysql::pool(2).await) else {
        return;
    };
    let ledger = Ledger::open(one).await;
    let rival = ledger.other_consumer(other);
    let running = slow_write(4, Duration::from_millis(1200), &ledger);
    let probe = async {
        // Three leases after the claim, without renewal it would have lapsed.
        tokio::time::sleep(Duration::from_millis(900)).await;
        slow_write(4, Duration::ZERO, &rival).await
    };
    let (ran, probed) = tokio::join!(running, probe);
    assert!(matches!(ran, Ok(Outcome::Processed(()))), "{ran:?}");
    assert!(matches!(probed, Ok(Outcome::InProgress { .. })), "the lease lapsed: {probed:?}");
    assert_eq!(ledger.rows(4).await, 1);
    rival.drop_tables().await;
}

/// A record row locked by a consumer that died between its DONE update and COMMIT: a
/// duplicate's claim answers InProgress after the store's lock timeout (MariaDB)
/// instead of blocking for the server's default 50 s.
#[tokio::test]
async fn a_locked_record_answers_in_progress() {
    let Some(pool) = mysql::pool(4).await else { return };
    let ledger = Ledger::open(pool).await;
    let version: String =
        sqlx::query_scalar("SELECT VERSION()").fetch_one(ledger.store.pool()).await.unwrap();
    if !version.contains("MariaDB") {
        eprintln!("skipped: MySQL {version} can't bound a lock wait per statement");
        return ledger.drop_tables().await;
    }
    let key = Key::new("locked", "7").unwrap();
    let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(60));
    let Claim::Won { .. } = ledger.store.claim(&key, lease, ttl, None).await.unwrap() else {
        panic!("fresh key");
    };
    let mut stuck = ledger.store.pool().begin().await.unwrap();
    let lock = format!("SELECT 1 FROM {} WHERE `key` = ? FOR UPDATE", ledger.records);
    sqlx::query(AssertSqlSafe(lock)).bind(key.as_bytes()).execute(&mut *stuck).await.unwrap();
    let started = std::time::Instant::now();
    let claim = tokio::time::timeout(
        Duration::from_secs(20),
        ledger.store.claim(&key, Duration::from_millis(50), ttl, None),
    )
    .await
    .expect("the claim blocked on the locked row");
    assert!(matches!(claim.unwrap(), Claim::InProgress { .. }));
    let waited = started.elapsed();
    assert!(waited >= idempotent::mysql_store::LOCK_TIMEOUT / 2, "{waited:?}");
    assert!(waited < Duration::from_secs(10), "{waited:?}");
    stuck.rollback().await.unwrap();
    ledger.drop_tables().await;
}

/// A claim that waits for another transaction's uncommitted DONE answers from the
/// committed record, under REPEATABLE READ with strict snapshots: `Done`, not a
/// stale `InProgress` nor a second win.
#[tokio::test]
async fn a_claim_waiting_on_a_commit_reads_the_committed_record() {
    let Some(settings) = strict_snapshots().await else { return };
    let Some(pool) = mysql::pool_with(4, &settings).await else { return };
    let ledger = Ledger::open(pool).await;
    let key = Key::new("waiting", "9").unwrap();
    let (lease, ttl) = (Duration::from_millis(200), Duration::from_secs(60));
    let Claim::Won { token, .. } = ledger.store.claim(&key, lease, ttl, None).await.unwrap() else {
        panic!("fresh key");
    };
    // The lease lapses: a claim that read a stale record would take the key over.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut done = ledger.store.pool().begin().await.unwrap();
    let sql = format!(
        "UPDATE {} SET state = 'D', token = NULL, expires_at = UTC_TIMESTAMP(6) + INTERVAL 60 SECOND \
         WHERE `key` = ? AND token = ?",
        ledger.records
    );
    let updated = sqlx::query(AssertSqlSafe(sql))
        .bind(key.as_bytes())
        .bind(token.as_u128().to_be_bytes().as_slice())
        .execute(&mut *done)
        .await
        .unwrap();
    assert_eq!(updated.rows_affected(), 1);
    let commit = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        done.commit().await.unwrap();
    };
    let (claim, ()) = tokio::join!(ledger.store.claim(&key, lease, ttl, None), commit);
    assert_eq!(claim.unwrap(), Claim::Done);
    ledger.drop_tables().await;
}

/// A records table nobody made (`migrate()` forgotten, `with_table` mistyped): `check`
/// and every claim answer `Misconfigured`, naming `migrate()`, so the call is retried,
/// never dead-lettered, and says what to do instead of "store unavailable".
#[tokio::test]
async fn a_missing_records_table_says_to_run_migrate() {
    let Some(pool) = mysql::pool(2).await else { return };
    let store = MysqlStore::from_pool(pool).with_table(&mysql::table("never_made")).unwrap();
    store.check_server().await.unwrap();
    let checked = store.check().await.unwrap_err();
    assert!(
        matches!(&checked, idempotent::StoreError::Misconfigured(why) if why.contains("migrate()")),
        "{checked}"
    );
    let key = Key::new("missing", "1").unwrap();
    let claimed = store.claim(&key, Duration::from_secs(5), Duration::from_secs(60), None).await;
    let err = claimed.unwrap_err();
    assert!(
        matches!(&err, idempotent::StoreError::Misconfigured(why) if why.contains("migrate()")),
        "{err}"
    );
}

/// A pool whose `after_connect` chooses the database (`USE`) the records table is in,
/// named without its database: lease renewals run on connections of their own,
/// which must get the same session, or every renewal misses the table, the lease
/// lapses mid-handler and another consumer runs the message again.
#[tokio::test]
async fn renewals_get_the_session_after_connect_sets() {
    let Some(admin) = mysql::pool(1).await else { return };
    let database = mysql::table("sv");
    sqlx::query(AssertSqlSafe(format!("CREATE DATABASE {database}")))
        .execute(&admin)
        .await
        .unwrap();
    let session: &'static str = Box::leak(format!("USE {database}").into_boxed_str());
    let (one, other) = (
        mysql::pool_with(1, &[session]).await.unwrap(),
        mysql::pool_with(2, &[session]).await.unwrap(),
    );
    let store = MysqlStore::from_pool(one).with_table("records").unwrap();
    store.migrate().await.unwrap();
    let create = "CREATE TABLE ledger (message_id bigint NOT NULL, KEY (message_id))";
    sqlx::query(create).execute(store.pool()).await.unwrap();
    let ledger = Ledger { store, records: "records".into(), ledger: "ledger".into() };
    let rival = ledger.other_consumer(other);
    let running = slow_write(4, Duration::from_millis(1200), &ledger);
    let probe = async {
        tokio::time::sleep(Duration::from_millis(900)).await;
        slow_write(4, Duration::ZERO, &rival).await
    };
    let (ran, probed) = tokio::join!(running, probe);
    assert!(matches!(ran, Ok(Outcome::Processed(()))), "{ran:?}");
    assert!(matches!(probed, Ok(Outcome::InProgress { .. })), "the lease lapsed: {probed:?}");
    assert_eq!(ledger.rows(4).await, 1);
    sqlx::query(AssertSqlSafe(format!("DROP DATABASE {database}"))).execute(&admin).await.unwrap();
}
