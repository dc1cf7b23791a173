//! A `transactional` handler whose transaction ends before its DONE record: a
//! `COMMIT` or `ROLLBACK` it sends itself, DDL (which commits implicitly on MySQL and
//! MariaDB), or a rollback by the server. Its later statements then run on their
//! own, so recording DONE in "the transaction", or releasing the key for a retry,
//! would commit an effect without its record or run it again over the effects that
//! stand. Each case on PostgreSQL and MariaDB, with the claim committed first and
//! taken inside the transaction: the call is dead-lettered with an alert, the key is
//! FAILED, and a redelivery writes nothing more. The ledger is read back from another
//! connection.

#[path = "support/mysql.rs"]
mod mysql;
#[path = "support/postgres.rs"]
mod postgres;

use std::sync::Mutex;
use std::time::Duration;

use idempotent::mysql_store::TransactionalClaim;
use idempotent::{Classify, Error, MysqlStore, Outcome, PostgresStore, TerminalEvent, idempotent};
use sqlx::{AssertSqlSafe, MySql, Postgres, Transaction};

#[derive(Debug, thiserror::Error, Classify)]
enum LedgerError {
    #[error("database: {0}")]
    #[idempotent(transparent)]
    Db(#[from] sqlx::Error),
    #[error("the payment provider timed out")]
    #[idempotent(retryable)]
    Timeout,
}

/// How the handler ends its transaction between its two writes.
#[derive(Clone, Copy, Debug)]
enum Ending {
    /// It sends `COMMIT`.
    Commit,
    /// It sends `ROLLBACK` (as the server does for a deadlock).
    Rollback,
    /// It runs DDL (MySQL and MariaDB commit implicitly).
    Ddl,
    /// It sends `COMMIT AND CHAIN`: the first write commits, the second goes into a
    /// new transaction.
    CommitAndChain,
    /// It sends `ROLLBACK AND CHAIN`: the first write is undone, the second goes into
    /// a new transaction.
    RollbackAndChain,
    /// It sends `START TRANSACTION`, which MySQL and MariaDB take as a `COMMIT` first.
    StartTransaction,
}

impl Ending {
    fn statement(self, ledger: &str, id: i64) -> String {
        match self {
            Ending::Commit => "COMMIT".to_owned(),
            Ending::Rollback => "ROLLBACK".to_owned(),
            Ending::Ddl => format!("CREATE TABLE {ledger}_ddl_{id} (x int)"),
            Ending::CommitAndChain => "COMMIT AND CHAIN".to_owned(),
            Ending::RollbackAndChain => "ROLLBACK AND CHAIN".to_owned(),
            Ending::StartTransaction => "START TRANSACTION".to_owned(),
        }
    }
}

struct Payment {
    id: i64,
    ending: Ending,
    /// Whether the handler fails (retryable) after its second write.
    fails: bool,
}

static ALERTS: Mutex<Vec<TerminalEvent>> = Mutex::new(Vec::new());

async fn alert(event: TerminalEvent) {
    ALERTS.lock().unwrap().push(event);
}

fn alerted(id: i64) -> bool {
    ALERTS.lock().unwrap().iter().any(|event| event.key == id.to_string())
}

#[idempotent(key = "{id}", namespace = "ended-pg", store = store, transactional, on_terminal = alert)]
async fn pay_pg(
    payment: Payment,
    store: &PostgresStore,
    ledger: &str,
    tx: &mut Transaction<'_, Postgres>,
) -> Result<(), LedgerError> {
    let insert = format!("INSERT INTO {ledger} (payment_id) VALUES ($1)");
    sqlx::query(AssertSqlSafe(insert.clone())).bind(payment.id).execute(&mut **tx).await?;
    let end = payment.ending.statement(ledger, payment.id);
    sqlx::query(AssertSqlSafe(end)).execute(&mut **tx).await?;
    sqlx::query(AssertSqlSafe(insert)).bind(payment.id).execute(&mut **tx).await?;
    if payment.fails { Err(LedgerError::Timeout) } else { Ok(()) }
}

#[idempotent(key = "{id}", namespace = "ended-my", store = store, transactional, on_terminal = alert)]
async fn pay_mysql(
    payment: Payment,
    store: &MysqlStore,
    ledger: &str,
    tx: &mut Transaction<'_, MySql>,
) -> Result<(), LedgerError> {
    let insert = format!("INSERT INTO {ledger} (payment_id) VALUES (?)");
    sqlx::query(AssertSqlSafe(insert.clone())).bind(payment.id).execute(&mut **tx).await?;
    let end = payment.ending.statement(ledger, payment.id);
    sqlx::query(AssertSqlSafe(end)).execute(&mut **tx).await?;
    sqlx::query(AssertSqlSafe(insert)).bind(payment.id).execute(&mut **tx).await?;
    if payment.fails { Err(LedgerError::Timeout) } else { Ok(()) }
}

/// The rows a dead-lettered first call left: the first write unless the ending
/// rolled it back, and the second unless it went into a transaction of its own that
/// was rolled back.
fn rows_left(ending: Ending) -> i64 {
    match ending {
        Ending::Rollback => 1,
        Ending::Commit | Ending::Ddl => 2,
        Ending::CommitAndChain | Ending::StartTransaction => 1,
        Ending::RollbackAndChain => 0,
    }
}

/// What every case checks of the first call and of its redelivery.
fn assert_dead_lettered<T: std::fmt::Debug, E: std::fmt::Debug>(
    case: &str,
    first: Result<T, Error<E>>,
    again: Result<T, Error<E>>,
) {
    let err = first.expect_err(case);
    assert!(
        matches!(&err, Error::Store { handler_ran: true, error, .. }
            if error.is_permanent() && error.to_string().contains("transaction ended")),
        "{case}: {err:?}"
    );
    assert!(matches!(again, Err(Error::PreviouslyFailed { .. })), "{case}: redelivery {again:?}");
}

#[tokio::test]
async fn postgres_a_transaction_ended_by_the_handler_is_failed_not_retried_or_done() {
    let Some(pool) = postgres::pool(4).await else { return };
    let suffix = idempotent::testing::fresh_key("ended").namespace().replace('-', "_");
    let ledger = format!("ledger_{suffix}");
    let create = format!("CREATE TABLE {ledger} (payment_id bigint NOT NULL)");
    sqlx::query(AssertSqlSafe(create)).execute(&pool).await.unwrap();
    let mut id = 0;
    for claim in [TransactionalClaim::Committed, TransactionalClaim::InTransaction] {
        let store = PostgresStore::from_pool(pool.clone())
            .with_table(&format!("records_{suffix}"))
            .unwrap()
            .with_transactional_claim(claim);
        store.migrate().await.unwrap();
        for ending in
            [Ending::Commit, Ending::Rollback, Ending::CommitAndChain, Ending::RollbackAndChain]
        {
            for fails in [true, false] {
                id += 1;
                let case = format!("{claim:?} {ending:?} fails={fails}");
                let first = pay_pg(Payment { id, ending, fails }, &store, &ledger).await;
                let again = pay_pg(Payment { id, ending, fails: false }, &store, &ledger).await;
                assert_dead_lettered(&case, first, again);
                assert!(alerted(id), "{case}: no alert");
                let count = format!("SELECT count(*) FROM {ledger} WHERE payment_id = $1");
                let rows: i64 = sqlx::query_scalar(AssertSqlSafe(count))
                    .bind(id)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
                assert_eq!(rows, rows_left(ending), "{case}: rows");
            }
        }
    }
}

#[tokio::test]
async fn mariadb_a_transaction_ended_by_the_handler_or_by_ddl_is_failed_not_retried_or_done() {
    let Some(pool) = mysql::pool(4).await else { return };
    let ledger = mysql::table("ledger");
    let records = ledger.replacen("ledger", "records", 1);
    let create = format!("CREATE TABLE {ledger} (payment_id bigint NOT NULL)");
    sqlx::query(AssertSqlSafe(create)).execute(&pool).await.unwrap();
    let mut id = 1000;
    let mut made = vec![ledger.clone(), records.clone()];
    for claim in [TransactionalClaim::Committed, TransactionalClaim::InTransaction] {
        let store = MysqlStore::from_pool(pool.clone())
            .with_table(&records)
            .unwrap()
            .with_transactional_claim(claim);
        store.migrate().await.unwrap();
        for ending in [
            Ending::Commit,
            Ending::Rollback,
            Ending::Ddl,
            Ending::CommitAndChain,
            Ending::RollbackAndChain,
            Ending::StartTransaction,
        ] {
            for fails in [true, false] {
                id += 1;
                if let Ending::Ddl = ending {
                    made.push(format!("{ledger}_ddl_{id}"));
                }
                let case = format!("{claim:?} {ending:?} fails={fails}");
                let first = pay_mysql(Payment { id, ending, fails }, &store, &ledger).await;
                let again = pay_mysql(Payment { id, ending, fails: false }, &store, &ledger).await;
                let count = format!("SELECT count(*) FROM {ledger} WHERE payment_id = ?");
                let rows: i64 = sqlx::query_scalar(AssertSqlSafe(count))
                    .bind(id)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
                let chained = matches!(
                    ending,
                    Ending::CommitAndChain | Ending::RollbackAndChain | Ending::StartTransaction
                );
                if chained && !fails && claim == TransactionalClaim::Committed {
                    // DONE is written in the transaction the handler began and commits
                    // with its second write, which it asked for; the first write was
                    // committed (or undone) by the handler itself.
                    assert!(matches!(first, Ok(Outcome::Processed(()))), "{case}: {first:?}");
                    assert!(matches!(again, Ok(Outcome::Duplicate)), "{case}: {again:?}");
                    let expected = if let Ending::RollbackAndChain = ending { 1 } else { 2 };
                    assert_eq!(rows, expected, "{case}: rows");
                    continue;
                }
                assert_dead_lettered(&case, first, again);
                assert!(alerted(id), "{case}: no alert");
                assert_eq!(rows, rows_left(ending), "{case}: rows");
            }
        }
    }
    let made: Vec<&str> = made.iter().map(String::as_str).collect();
    mysql::drop_tables(&pool, &made).await;
}

/// A handler that takes part in a deadlock when `deadlocks`: it locks row 1 of
/// `locks`, waits until a heavier transaction on another connection has locked rows
/// 2 to 20, and asks for row 2 while that one asks for row 1. The handler's
/// transaction is made the victim (on MariaDB the lighter one is, on PostgreSQL the
/// one that waited first) and rolled back; the handler returns the error with `?`,
/// as handlers do.
struct Contended {
    id: i64,
    deadlocks: bool,
}

/// Runs the heavier side of the deadlock on `pool`: locks rows 2 to 20, says so on
/// `locked`, then after `wait` asks for row 1 (which the handler holds) and commits
/// once given it.
async fn heavier_side<DB: sqlx::Database>(
    pool: sqlx::Pool<DB>,
    locks: String,
    placeholder: &'static str,
    wait: std::time::Duration,
    locked: tokio::sync::oneshot::Sender<()>,
) where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
{
    let mut side = pool.begin().await.unwrap();
    let heavy = format!("UPDATE {locks} SET n = n + 1 WHERE id >= 2");
    sqlx::query(AssertSqlSafe(heavy)).execute(&mut *side).await.unwrap();
    locked.send(()).unwrap();
    tokio::time::sleep(wait).await;
    let one = format!("UPDATE {locks} SET n = n + 1 WHERE id = {placeholder}");
    sqlx::query(AssertSqlSafe(one)).bind(1_i64).execute(&mut *side).await.unwrap();
    side.commit().await.unwrap();
}

/// The handler's body on either database: `placeholder` is its bind parameter, and
/// `side_waits` whether the side asks for row 1 after the handler asked for row 2
/// (PostgreSQL: the one that waited first runs the deadlock check and is picked)
/// rather than before (MariaDB: the lighter transaction is picked).
async fn contend<DB: sqlx::Database>(
    c: &Contended,
    tx: &mut DB::Connection,
    (ledger, locks): &(String, String),
    pool: &sqlx::Pool<DB>,
    placeholder: &'static str,
    side_waits: bool,
) -> Result<(), LedgerError>
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
{
    let insert = format!("INSERT INTO {ledger} (payment_id) VALUES ({placeholder})");
    sqlx::query(AssertSqlSafe(insert)).bind(c.id).execute(&mut *tx).await?;
    if c.deadlocks {
        let one = format!("UPDATE {locks} SET n = n + 1 WHERE id = 1");
        sqlx::query(AssertSqlSafe(one)).execute(&mut *tx).await?;
        let (locked, side_locked) = tokio::sync::oneshot::channel();
        let wait = Duration::from_millis(300);
        let side_wait = if side_waits { wait } else { Duration::ZERO };
        tokio::spawn(heavier_side(pool.clone(), locks.clone(), placeholder, side_wait, locked));
        side_locked.await.unwrap();
        if !side_waits {
            tokio::time::sleep(wait).await;
        }
        let two = format!("UPDATE {locks} SET n = n + 1 WHERE id = 2");
        sqlx::query(AssertSqlSafe(two)).execute(&mut *tx).await?;
    }
    Ok(())
}

#[idempotent(key = "{id}", namespace = "deadlock-my", store = store, transactional, on_terminal = alert)]
async fn contend_mysql(
    c: Contended,
    store: &MysqlStore,
    tables: &(String, String),
    pool: &sqlx::MySqlPool,
    tx: &mut Transaction<'_, MySql>,
) -> Result<(), LedgerError> {
    contend(&c, &mut **tx, tables, pool, "?", false).await
}

#[idempotent(key = "{id}", namespace = "deadlock-pg", store = store, transactional, on_terminal = alert)]
async fn contend_pg(
    c: Contended,
    store: &PostgresStore,
    tables: &(String, String),
    pool: &sqlx::PgPool,
    tx: &mut Transaction<'_, Postgres>,
) -> Result<(), LedgerError> {
    contend(&c, &mut **tx, tables, pool, "$1", true).await
}

/// What both databases check of a deadlock victim: the first call is retried (the
/// server rolled everything back, so nothing stands), the redelivery is processed,
/// and one ledger row stands.
fn assert_retried<T: std::fmt::Debug, E: std::fmt::Debug>(
    case: &str,
    first: Result<Outcome<T>, Error<E>>,
    again: Result<Outcome<T>, Error<E>>,
    rows: i64,
) {
    assert!(matches!(first, Err(Error::Retryable { .. })), "{case}: {first:?}");
    assert!(matches!(again, Ok(Outcome::Processed(_))), "{case}: redelivery {again:?}");
    assert_eq!(rows, 1, "{case}: rows");
}

/// A deadlock test for one database: `$store` its store type, `$contend` the
/// handler, `$rows` the statement counting a payment's ledger rows; the tables exist.
macro_rules! deadlock_cases {
    ($pool:expr, $store:ident, $records:expr, $tables:expr, $contend:ident, $rows:expr) => {
        let (pool, tables) = ($pool, $tables);
        for (id, claim) in
            [(3001, TransactionalClaim::Committed), (3002, TransactionalClaim::InTransaction)]
        {
            let store = $store::from_pool(pool.clone())
                .with_table($records)
                .unwrap()
                .with_transactional_claim(claim);
            store.migrate().await.unwrap();
            let case = format!("{claim:?}");
            let first = $contend(Contended { id, deadlocks: true }, &store, tables, pool).await;
            let again = $contend(Contended { id, deadlocks: false }, &store, tables, pool).await;
            let rows: i64 =
                sqlx::query_scalar(AssertSqlSafe($rows)).bind(id).fetch_one(pool).await.unwrap();
            assert_retried(&case, first, again, rows);
            assert!(!alerted(id), "{case}: alerted");
        }
    };
}

#[tokio::test]
async fn mariadb_a_deadlock_victim_is_retried_not_dead_lettered() {
    let Some(pool) = mysql::pool(6).await else { return };
    let (ledger, locks) = (mysql::table("ledger"), mysql::table("locks"));
    let records = ledger.replacen("ledger", "records", 1);
    for create in [
        format!("CREATE TABLE {ledger} (payment_id bigint NOT NULL)"),
        format!("CREATE TABLE {locks} (id bigint PRIMARY KEY, n bigint NOT NULL)"),
        format!("INSERT INTO {locks} (id, n) SELECT seq, 0 FROM seq_1_to_20"),
    ] {
        sqlx::query(AssertSqlSafe(create)).execute(&pool).await.unwrap();
    }
    let count = format!("SELECT count(*) FROM {ledger} WHERE payment_id = ?");
    let tables = (ledger.clone(), locks.clone());
    deadlock_cases!(&pool, MysqlStore, &records, &tables, contend_mysql, count.clone());
    mysql::drop_tables(&pool, &[&ledger, &locks, &records]).await;
}

#[tokio::test]
async fn postgres_a_deadlock_victim_is_retried_not_dead_lettered() {
    let Some(pool) = postgres::pool(6).await else { return };
    let suffix = idempotent::testing::fresh_key("deadlock").namespace().replace('-', "_");
    let (ledger, locks) = (format!("ledger_{suffix}"), format!("locks_{suffix}"));
    for create in [
        format!("CREATE TABLE {ledger} (payment_id bigint NOT NULL)"),
        format!("CREATE TABLE {locks} (id bigint PRIMARY KEY, n bigint NOT NULL)"),
        format!("INSERT INTO {locks} (id, n) SELECT i, 0 FROM generate_series(1, 20) i"),
    ] {
        sqlx::query(AssertSqlSafe(create)).execute(&pool).await.unwrap();
    }
    let count = format!("SELECT count(*) FROM {ledger} WHERE payment_id = $1");
    let records = format!("records_{suffix}");
    deadlock_cases!(&pool, PostgresStore, &records, &(ledger, locks), contend_pg, count.clone());
}

/// A handler that changes its transaction's session settings between its writes
/// without ending it: `RESET ALL`, or `SET LOCAL search_path` to a tenant's schema
/// (which has no records table), as multi-tenant handlers do.
#[derive(Clone, Copy, Debug)]
enum SessionChange {
    ResetAll,
    TenantSearchPath,
}

struct Tenanted {
    id: i64,
    change: SessionChange,
}

#[idempotent(key = "{id}", namespace = "session-pg", store = store, transactional, on_terminal = alert)]
async fn tenanted_pg(
    t: Tenanted,
    store: &PostgresStore,
    tables: &(String, String),
    tx: &mut Transaction<'_, Postgres>,
) -> Result<(), LedgerError> {
    let (ledger, tenant) = tables;
    let insert = format!("INSERT INTO public.{ledger} (payment_id) VALUES ($1)");
    sqlx::query(AssertSqlSafe(insert.clone())).bind(t.id).execute(&mut **tx).await?;
    let change = match t.change {
        SessionChange::ResetAll => "RESET ALL".to_owned(),
        SessionChange::TenantSearchPath => format!("SET LOCAL search_path TO {tenant}"),
    };
    sqlx::query(AssertSqlSafe(change)).execute(&mut **tx).await?;
    sqlx::query(AssertSqlSafe(insert)).bind(t.id).execute(&mut **tx).await?;
    Ok(())
}

#[tokio::test]
async fn postgres_a_handler_that_resets_its_session_or_moves_its_search_path_is_processed() {
    let Some(pool) = postgres::pool(4).await else { return };
    let suffix = idempotent::testing::fresh_key("session").namespace().replace('-', "_");
    let (ledger, tenant) = (format!("ledger_{suffix}"), format!("tenant_{suffix}"));
    for create in [
        format!("CREATE TABLE {ledger} (payment_id bigint NOT NULL)"),
        format!("CREATE SCHEMA {tenant}"),
    ] {
        sqlx::query(AssertSqlSafe(create)).execute(&pool).await.unwrap();
    }
    let tables = (ledger.clone(), tenant.clone());
    let mut id = 4000;
    for claim in [TransactionalClaim::Committed, TransactionalClaim::InTransaction] {
        let store = PostgresStore::from_pool(pool.clone())
            .with_table(&format!("records_{suffix}"))
            .unwrap()
            .with_transactional_claim(claim);
        store.migrate().await.unwrap();
        for change in [SessionChange::ResetAll, SessionChange::TenantSearchPath] {
            id += 1;
            let case = format!("{claim:?} {change:?}");
            let first = tenanted_pg(Tenanted { id, change }, &store, &tables).await;
            let again = tenanted_pg(Tenanted { id, change }, &store, &tables).await;
            assert!(matches!(first, Ok(Outcome::Processed(()))), "{case}: {first:?}");
            assert!(matches!(again, Ok(Outcome::Duplicate)), "{case}: redelivery {again:?}");
            let count = format!("SELECT count(*) FROM {ledger} WHERE payment_id = $1");
            let rows: i64 =
                sqlx::query_scalar(AssertSqlSafe(count)).bind(id).fetch_one(&pool).await.unwrap();
            assert_eq!(rows, 2, "{case}: rows");
            assert!(!alerted(id), "{case}: alerted");
        }
    }
    let drop = format!("DROP SCHEMA {tenant}");
    sqlx::query(AssertSqlSafe(drop)).execute(&pool).await.unwrap();
}
