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

use idempotent::{Classify, Error, MysqlStore, PostgresStore, TerminalEvent, idempotent};
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
    let end = match payment.ending {
        Ending::Commit => "COMMIT".to_owned(),
        Ending::Rollback => "ROLLBACK".to_owned(),
        Ending::Ddl => format!("CREATE TABLE {ledger}_ddl_{} (x int)", payment.id),
    };
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
    let end = match payment.ending {
        Ending::Commit => "COMMIT".to_owned(),
        Ending::Rollback => "ROLLBACK".to_owned(),
        Ending::Ddl => format!("CREATE TABLE {ledger}_ddl_{} (x int)", payment.id),
    };
    sqlx::query(AssertSqlSafe(end)).execute(&mut **tx).await?;
    sqlx::query(AssertSqlSafe(insert)).bind(payment.id).execute(&mut **tx).await?;
    if payment.fails { Err(LedgerError::Timeout) } else { Ok(()) }
}

/// The rows the first call left: both writes, unless the ending rolled the first
/// back.
fn rows_left(ending: Ending) -> i64 {
    match ending {
        Ending::Rollback => 1,
        Ending::Commit | Ending::Ddl => 2,
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
    for claim in [
        idempotent::mysql_store::TransactionalClaim::Committed,
        idempotent::mysql_store::TransactionalClaim::InTransaction,
    ] {
        let store = PostgresStore::from_pool(pool.clone())
            .with_table(&format!("records_{suffix}"))
            .unwrap()
            .with_transactional_claim(claim);
        store.migrate().await.unwrap();
        for ending in [Ending::Commit, Ending::Rollback] {
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
    for claim in [
        idempotent::mysql_store::TransactionalClaim::Committed,
        idempotent::mysql_store::TransactionalClaim::InTransaction,
    ] {
        let store = MysqlStore::from_pool(pool.clone())
            .with_table(&records)
            .unwrap()
            .with_transactional_claim(claim);
        store.migrate().await.unwrap();
        for ending in [Ending::Commit, Ending::Rollback, Ending::Ddl] {
            for fails in [true, false] {
                id += 1;
                if let Ending::Ddl = ending {
                    made.push(format!("{ledger}_ddl_{id}"));
                }
                let case = format!("{claim:?} {ending:?} fails={fails}");
                let first = pay_mysql(Payment { id, ending, fails }, &store, &ledger).await;
                let again = pay_mysql(Payment { id, ending, fails: false }, &store, &ledger).await;
                assert_dead_lettered(&case, first, again);
                assert!(alerted(id), "{case}: no alert");
                let count = format!("SELECT count(*) FROM {ledger} WHERE payment_id = ?");
                let rows: i64 = sqlx::query_scalar(AssertSqlSafe(count))
                    .bind(id)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
                assert_eq!(rows, rows_left(ending), "{case}: rows");
            }
        }
    }
    let made: Vec<&str> = made.iter().map(String::as_str).collect();
    mysql::drop_tables(&pool, &made).await;
}
