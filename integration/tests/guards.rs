//! The business-state guards (`idempotent::guard`) against the machine's PostgreSQL
//! (`DATABASE_URL`) and MySQL or MariaDB (`MYSQL_URL`): every answer, inside and
//! outside transactions, concurrent deliveries of one change, optimistic increments
//! from several writers, and names and values a producer or a careless caller might
//! pass. The same cases run on both databases.

#[path = "support/mysql.rs"]
mod mysql;
#[path = "support/postgres.rs"]
mod postgres;

use std::sync::Arc;
use std::time::Duration;

use idempotent::guard::{
    InvalidGuard, StateChange, StateGuard, StateRefused, Table, VersionChange, VersionRefused,
};
use idempotent::{Classify, Disposition, DispositionExt, ErrorClass, NoStore, Outcome, idempotent};

/// A handler error as users write it: the guards' refusals and sqlx's errors keep
/// their own classes.
#[derive(Debug, thiserror::Error, Classify)]
enum PayError {
    #[error(transparent)]
    #[idempotent(transparent)]
    Db(#[from] sqlx::Error),
    #[error(transparent)]
    #[idempotent(transparent)]
    Refused(#[from] StateRefused<String>),
}

#[test]
fn names_that_are_not_plain_identifiers_are_refused() {
    for bad in ["", "1orders", "orders; DROP TABLE x", "a.b.c", "or\"ders", "ord`ers", "é", "a-b"]
    {
        assert!(Table::new(bad, "id").is_err(), "table {bad:?} was accepted");
        assert!(Table::new("orders", bad).is_err(), "key column {bad:?} was accepted");
        let orders = Table::new("orders", "id").unwrap();
        assert!(orders.state::<String>(bad, ["A"], "B").is_err(), "column {bad:?} was accepted");
        assert!(orders.versioned(bad).is_err(), "version column {bad:?} was accepted");
    }
    assert!(Table::new(&"a".repeat(64), "id").is_err());
    assert!(Table::new(&"a".repeat(63), "id").is_ok());
    assert!(Table::new("shop.orders", "id").is_ok());
    let orders = Table::new("orders", "id").unwrap();
    let none = orders.state::<String>("status", Vec::<String>::new(), "PAID").unwrap_err();
    assert_eq!(none, InvalidGuard::NoFromState);
}

#[test]
fn refusals_carry_the_class_a_handler_needs() {
    assert_eq!(StateRefused::<String>::AlreadyApplied.class(), ErrorClass::Duplicate);
    assert_eq!(StateRefused::Conflict("CANCELLED".to_string()).class(), ErrorClass::Terminal);
    assert_eq!(StateRefused::<String>::NotFound.class(), ErrorClass::Terminal);
    assert_eq!(VersionRefused::Stale(3).class(), ErrorClass::Retryable);
    assert_eq!(VersionRefused::NotFound.class(), ErrorClass::Terminal);
    assert_eq!(StateChange::<String>::Applied.into_result(), Ok(()));
    assert_eq!(VersionChange::Stale(4).into_result(), Err(VersionRefused::Stale(4)));
    // A version from the message: past it is a duplicate, behind it a retry.
    let past = VersionChange::Stale(5).into_result_for_message(3);
    assert_eq!(past, Err(VersionRefused::AlreadyApplied(5)));
    assert_eq!(past.unwrap_err().class(), ErrorClass::Duplicate);
    assert_eq!(VersionChange::Stale(2).into_result_for_message(3), Err(VersionRefused::Stale(2)));
    assert_eq!(VersionChange::Applied.into_result_for_message(3), Ok(()));
}

/// The cases, written once, for a database type, its test pool, and its quote for
/// identifiers in the test's own DDL.
macro_rules! guard_cases {
    ($module:ident, $db:ty, $pool:expr, $quote:literal) => {
        mod $module {
            use super::*;

            type Pool = sqlx::Pool<$db>;

            async fn pool(connections: u32) -> Option<Pool> {
                $pool(connections).await
            }

            async fn exec(pool: &Pool, sql: String) {
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(pool).await.unwrap();
            }

            /// A table `(id, status, stock, version)` holding `rows` as
            /// `(id, status)`, each with stock 10 at version 1.
            async fn orders(pool: &Pool, rows: &[(i64, &str)]) -> String {
                let table = super::mysql::table("guard_orders");
                exec(
                    pool,
                    format!(
                        "CREATE TABLE {table} (id BIGINT PRIMARY KEY, status VARCHAR(64) NOT NULL, \
                         stock BIGINT NOT NULL, version BIGINT NOT NULL)"
                    ),
                )
                .await;
                for (id, status) in rows {
                    exec(pool, format!("INSERT INTO {table} VALUES ({id}, '{status}', 10, 1)")).await;
                }
                table
            }

            async fn status(pool: &Pool, table: &str, id: i64) -> String {
                let sql = format!("SELECT status FROM {table} WHERE id = {id}");
                sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_one(pool).await.unwrap()
            }

            async fn stock(pool: &Pool, table: &str, id: i64) -> (i64, i64) {
                let sql = format!("SELECT stock, version FROM {table} WHERE id = {id}");
                sqlx::query_as(sqlx::AssertSqlSafe(sql)).fetch_one(pool).await.unwrap()
            }

            async fn drop_table(pool: &Pool, table: &str) {
                exec(pool, format!("DROP TABLE {table}")).await;
            }

            fn pay(table: &str) -> StateGuard<String> {
                Table::new(table, "id").unwrap().state("status", ["UNPAID", "PENDING"], "PAID").unwrap()
            }

            #[tokio::test]
            async fn a_state_guard_answers_each_case() {
                let Some(pool) = pool(4).await else { return };
                let rows = [(1, "UNPAID"), (2, "PENDING"), (3, "PAID"), (4, "CANCELLED")];
                let table = orders(&pool, &rows).await;
                let pay = pay(&table);

                assert_eq!(pay.apply(&pool, 1_i64).await.unwrap(), StateChange::Applied);
                assert_eq!(status(&pool, &table, 1).await, "PAID");
                assert_eq!(pay.apply(&pool, 1_i64).await.unwrap(), StateChange::AlreadyApplied);
                assert_eq!(pay.apply(&pool, 2_i64).await.unwrap(), StateChange::Applied);
                assert_eq!(pay.apply(&pool, 3_i64).await.unwrap(), StateChange::AlreadyApplied);
                assert_eq!(
                    pay.apply(&pool, 4_i64).await.unwrap(),
                    StateChange::Conflict("CANCELLED".to_string())
                );
                assert_eq!(status(&pool, &table, 4).await, "CANCELLED");
                assert_eq!(pay.apply(&pool, 99_i64).await.unwrap(), StateChange::NotFound);
                drop_table(&pool, &table).await;
            }

            /// A duplicate redelivered after the order moved on past PAID (shipped) is
            /// already applied, not a conflict to dead-letter with an alert; a state
            /// outside the path (cancelled) is still a conflict.
            #[tokio::test]
            async fn a_late_duplicate_past_the_target_is_already_applied() {
                let Some(pool) = pool(4).await else { return };
                let table = orders(&pool, &[(1, "SHIPPED"), (2, "CANCELLED"), (3, "UNPAID")]).await;
                let pay = pay(&table).beyond(["SHIPPED", "DELIVERED"]);
                assert_eq!(pay.apply(&pool, 1_i64).await.unwrap(), StateChange::AlreadyApplied);
                assert_eq!(status(&pool, &table, 1).await, "SHIPPED");
                assert_eq!(
                    pay.apply(&pool, 2_i64).await.unwrap(),
                    StateChange::Conflict("CANCELLED".to_string())
                );
                assert_eq!(pay.apply(&pool, 3_i64).await.unwrap(), StateChange::Applied);
                drop_table(&pool, &table).await;
            }

            #[tokio::test]
            async fn a_state_change_rolls_back_with_its_transaction() {
                let Some(pool) = pool(4).await else { return };
                let table = orders(&pool, &[(1, "UNPAID")]).await;
                let pay = pay(&table);
                let mut tx = pool.begin().await.unwrap();
                assert_eq!(pay.apply(&mut *tx, 1_i64).await.unwrap(), StateChange::Applied);
                assert_eq!(pay.apply(&mut *tx, 1_i64).await.unwrap(), StateChange::AlreadyApplied);
                tx.rollback().await.unwrap();
                assert_eq!(status(&pool, &table, 1).await, "UNPAID");

                let mut tx = pool.begin().await.unwrap();
                assert_eq!(pay.apply(&mut *tx, 1_i64).await.unwrap(), StateChange::Applied);
                tx.commit().await.unwrap();
                assert_eq!(status(&pool, &table, 1).await, "PAID");
                drop_table(&pool, &table).await;
            }

            /// Sixteen deliveries of one "pay" message, each in its own transaction
            /// that holds the row a while: exactly one applies, and every other one
            /// says "already applied", not "conflict" (on PostgreSQL the later ones
            /// wait for the first to commit and then see a snapshot older than it).
            #[tokio::test]
            async fn concurrent_deliveries_apply_a_state_change_once() {
                let Some(pool) = pool(17).await else { return };
                let table = orders(&pool, &[(1, "UNPAID")]).await;
                let pay = Arc::new(pay(&table));
                let mut tasks = Vec::new();
                for _ in 0..16 {
                    let (pool, pay) = (pool.clone(), pay.clone());
                    tasks.push(tokio::spawn(async move {
                        let mut tx = pool.begin().await.unwrap();
                        let answer = pay.apply(&mut *tx, 1_i64).await.unwrap();
                        tokio::time::sleep(Duration::from_millis(30)).await;
                        tx.commit().await.unwrap();
                        answer
                    }));
                }
                let mut answers = Vec::new();
                for task in tasks {
                    answers.push(task.await.unwrap());
                }
                let applied = answers.iter().filter(|a| **a == StateChange::Applied).count();
                let already = answers.iter().filter(|a| **a == StateChange::AlreadyApplied).count();
                assert_eq!((applied, already), (1, 15), "{answers:?}");
                drop_table(&pool, &table).await;
            }

            /// A state that reads like SQL is stored as it is, and the table is intact.
            #[tokio::test]
            async fn hostile_values_are_bound_not_spliced() {
                let Some(pool) = pool(4).await else { return };
                let table = orders(&pool, &[(1, "UNPAID")]).await;
                let evil = format!("x'); DROP TABLE {table}; -- \\ \" `");
                let guard: StateGuard<String> =
                    Table::new(&table, "id").unwrap().state("status", ["UNPAID"], evil.clone()).unwrap();
                assert_eq!(guard.apply(&pool, 1_i64).await.unwrap(), StateChange::Applied);
                assert_eq!(status(&pool, &table, 1).await, evil);
                drop_table(&pool, &table).await;
            }

            /// Names are quoted: reserved words work as columns.
            #[tokio::test]
            async fn reserved_words_work_as_names() {
                let Some(pool) = pool(4).await else { return };
                let table = super::mysql::table("guard_reserved");
                let q = $quote;
                exec(
                    &pool,
                    format!(
                        "CREATE TABLE {table} ({q}select{q} VARCHAR(8) PRIMARY KEY, \
                         {q}order{q} VARCHAR(8) NOT NULL, {q}group{q} BIGINT NOT NULL)"
                    ),
                )
                .await;
                exec(&pool, format!("INSERT INTO {table} VALUES ('a', 'NEW', 1)")).await;
                let rows = Table::new(&table, "select").unwrap();
                let guard: StateGuard<String> = rows.state("order", ["NEW"], "SHIPPED").unwrap();
                assert_eq!(guard.apply(&pool, "a").await.unwrap(), StateChange::Applied);
                let version = rows.versioned("group").unwrap();
                let change = version.set("order", "DONE").apply(&pool, "a", 1).await.unwrap();
                assert_eq!(change, VersionChange::Applied);
                assert_eq!(version.set("order", "X").apply(&pool, "a", 1).await.unwrap(), VersionChange::Stale(2));
                drop_table(&pool, &table).await;
            }

            /// A key column that is not unique is a mistake the guard reports instead
            /// of answering for one of the rows.
            #[tokio::test]
            async fn a_key_matching_several_rows_is_an_error() {
                let Some(pool) = pool(4).await else { return };
                let table = super::mysql::table("guard_dupes");
                exec(&pool, format!("CREATE TABLE {table} (id BIGINT NOT NULL, status VARCHAR(8) NOT NULL, version BIGINT NOT NULL)")).await;
                exec(&pool, format!("INSERT INTO {table} VALUES (1, 'PAID', 1), (1, 'PAID', 1)")).await;
                let rows = Table::new(&table, "id").unwrap();
                let pay: StateGuard<String> = rows.state("status", ["UNPAID"], "PAID").unwrap();
                let error = pay.apply(&pool, 1_i64).await.unwrap_err();
                assert!(error.to_string().contains("must be unique"), "{error}");
                let error = rows.versioned("version").unwrap().set("status", "X").apply(&pool, 1_i64, 7).await.unwrap_err();
                assert!(error.to_string().contains("must be unique"), "{error}");
                drop_table(&pool, &table).await;
            }

            /// A key column that is not unique is an error, and the rows are as they
            /// were once the caller's transaction rolls back on it (on PostgreSQL the
            /// guard's update does not change them in the first place: see
            /// `on_postgres_only::a_key_matching_several_rows_is_left_alone_through_a_pool`).
            #[tokio::test]
            async fn a_key_matching_several_rows_changes_none_of_them() {
                let Some(pool) = pool(4).await else { return };
                let table = super::mysql::table("guard_dupes");
                exec(&pool, format!("CREATE TABLE {table} (id BIGINT NOT NULL, status VARCHAR(8) NOT NULL, version BIGINT NOT NULL)")).await;
                exec(&pool, format!("INSERT INTO {table} VALUES (1, 'UNPAID', 1), (1, 'UNPAID', 1)")).await;
                let rows = Table::new(&table, "id").unwrap();
                let pay: StateGuard<String> = rows.state("status", ["UNPAID"], "PAID").unwrap();
                let mut tx = pool.begin().await.unwrap();
                let error = pay.apply(&mut *tx, 1_i64).await.unwrap_err();
                assert!(error.to_string().contains("must be unique"), "{error}");
                tx.rollback().await.unwrap();
                let versioned = rows.versioned("version").unwrap();
                let mut tx = pool.begin().await.unwrap();
                let error = versioned.set("status", "X").apply(&mut *tx, 1_i64, 1).await.unwrap_err();
                assert!(error.to_string().contains("must be unique"), "{error}");
                tx.rollback().await.unwrap();
                let sql = format!("SELECT status, version FROM {table} ORDER BY status");
                let after: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(sql)).fetch_all(&pool).await.unwrap();
                drop_table(&pool, &table).await;
                assert_eq!(
                    after,
                    [("UNPAID".to_string(), 1), ("UNPAID".to_string(), 1)],
                    "the guards answered an error but changed the rows"
                );
            }

            /// A guard whose target is also one of its source states ("pay an order
            /// that is UNPAID or PAID") must still tell a duplicate from a first
            /// delivery: a row already in the target state is `AlreadyApplied`, as
            /// the type documents. Both databases test the sources first, so every
            /// redelivery answers `Applied` and the handler charges again.
            #[tokio::test]
            async fn a_row_in_the_target_state_is_already_applied_even_if_listed_as_a_source() {
                let Some(pool) = pool(4).await else { return };
                let table = orders(&pool, &[(1, "UNPAID")]).await;
                let pay: StateGuard<String> =
                    Table::new(&table, "id").unwrap().state("status", ["UNPAID", "PAID"], "PAID").unwrap();
                let first = pay.apply(&pool, 1_i64).await.unwrap();
                let second = pay.apply(&pool, 1_i64).await.unwrap();
                drop_table(&pool, &table).await;
                assert_eq!(
                    (first, second),
                    (StateChange::Applied, StateChange::AlreadyApplied),
                    "a redelivery was answered Applied: its effect runs twice"
                );
            }

            #[tokio::test]
            async fn a_version_guard_answers_each_case() {
                let Some(pool) = pool(4).await else { return };
                let table = orders(&pool, &[(1, "UNPAID")]).await;
                let guard = Table::new(&table, "id").unwrap().versioned("version").unwrap();

                let change = guard.set("stock", 9_i64).set("status", "RESERVED").apply(&pool, 1_i64, 1).await;
                assert_eq!(change.unwrap(), VersionChange::Applied);
                assert_eq!(stock(&pool, &table, 1).await, (9, 2));
                assert_eq!(status(&pool, &table, 1).await, "RESERVED");
                let stale = guard.set("stock", 8_i64).apply(&pool, 1_i64, 1).await.unwrap();
                assert_eq!(stale, VersionChange::Stale(2));
                assert_eq!(guard.set("stock", 8_i64).apply(&pool, 2_i64, 1).await.unwrap(), VersionChange::NotFound);

                // Mistakes in the update are errors, and change nothing.
                let bump = guard.set("stock", 0_i64).set("version", 100_i64).apply(&pool, 1_i64, 2).await;
                assert!(bump.unwrap_err().to_string().contains("version column"));
                let bad = guard.set("stock; DROP TABLE x", 0_i64).apply(&pool, 1_i64, 2).await;
                assert!(bad.unwrap_err().to_string().contains("not a plain SQL identifier"));
                assert_eq!(stock(&pool, &table, 1).await, (9, 2));
                drop_table(&pool, &table).await;
            }

            /// Eight writers each take 25 units off one row by read, compute, guarded
            /// write, rereading on `Stale`: no write is lost and none applies twice.
            #[tokio::test]
            async fn optimistic_writers_lose_no_update() {
                let Some(pool) = pool(8).await else { return };
                let table = orders(&pool, &[(1, "OPEN")]).await;
                exec(&pool, format!("UPDATE {table} SET stock = 200")).await;
                let guard = Arc::new(Table::new(&table, "id").unwrap().versioned("version").unwrap());
                let mut tasks = Vec::new();
                for _ in 0..8 {
                    let (pool, guard, table) = (pool.clone(), guard.clone(), table.clone());
                    tasks.push(tokio::spawn(async move {
                        let mut stale = 0;
                        for _ in 0..25 {
                            loop {
                                let (left, version) = stock(&pool, &table, 1).await;
                                let change = guard.set("stock", left - 1).apply(&pool, 1_i64, version).await.unwrap();
                                match change {
                                    VersionChange::Applied => break,
                                    VersionChange::Stale(now) => {
                                        assert!(now > version, "stale at {now}, read {version}");
                                        stale += 1;
                                    }
                                    VersionChange::NotFound => panic!("the row went away"),
                                }
                            }
                        }
                        stale
                    }));
                }
                let mut stale = 0;
                for task in tasks {
                    stale += task.await.unwrap();
                }
                assert_eq!(stock(&pool, &table, 1).await, (0, 201), "after {stale} stale reads");
                drop_table(&pool, &table).await;
            }

            /// A handler guarded only by the row's state, on `NoStore`: the first
            /// delivery applies, a redelivery is acked as a duplicate without an
            /// alert, a forbidden change is dead-lettered, and a rolled-back attempt
            /// leaves the order payable.
            #[tokio::test]
            async fn a_handler_on_no_store_takes_its_answers_from_the_guard() {
                let Some(pool) = pool(4).await else { return };
                let table = orders(&pool, &[(1, "UNPAID"), (2, "CANCELLED")]).await;
                let guard = pay(&table);

                #[idempotent(key = "order:{id}", store = NoStore)]
                async fn pay_order(id: i64, pool: &Pool, guard: &StateGuard<String>, fail: bool) -> Result<(), PayError> {
                    let mut tx = pool.begin().await?;
                    guard.apply(&mut *tx, id).await?.into_result()?;
                    if fail {
                        return Err(sqlx::Error::PoolTimedOut.into());
                    }
                    tx.commit().await?;
                    Ok(())
                }

                let failed = pay_order(1, &pool, &guard, true).await;
                assert_eq!(failed.disposition(), Disposition::Retry);
                assert_eq!(status(&pool, &table, 1).await, "UNPAID");
                let first = pay_order(1, &pool, &guard, false).await;
                assert_eq!(first.unwrap(), Outcome::Processed(()));
                let again = pay_order(1, &pool, &guard, false).await;
                assert_eq!(again.unwrap(), Outcome::Duplicate);
                let cancelled = pay_order(2, &pool, &guard, false).await;
                assert_eq!(cancelled.disposition(), Disposition::DeadLetter);
                assert_eq!(status(&pool, &table, 2).await, "CANCELLED");
                drop_table(&pool, &table).await;
            }
        }
    };
}

guard_cases!(on_postgres, sqlx::Postgres, postgres::pool, '"');
guard_cases!(on_mysql, sqlx::MySql, mysql::pool, '`');

/// PostgreSQL only: column types and isolation levels.
mod on_postgres_only {
    use super::*;

    /// On PostgreSQL the guards' updates apply only when the key names one row, so
    /// even through a pool (each statement committed on its own) a key column that
    /// is not unique leaves the rows as they were.
    #[tokio::test]
    async fn a_key_matching_several_rows_is_left_alone_through_a_pool() {
        let Some(pool) = postgres::pool(4).await else { return };
        let table = mysql::table("guard_dupes_pool");
        exec(&pool, format!("CREATE TABLE {table} (id BIGINT NOT NULL, status TEXT NOT NULL, version BIGINT NOT NULL)")).await;
        exec(&pool, format!("INSERT INTO {table} VALUES (1, 'UNPAID', 1), (1, 'UNPAID', 1)")).await;
        let rows = Table::new(&table, "id").unwrap();
        let pay: StateGuard<String> = rows.state("status", ["UNPAID"], "PAID").unwrap();
        let error = pay.apply(&pool, 1_i64).await.unwrap_err();
        assert!(error.to_string().contains("must be unique"), "{error}");
        let versioned = rows.versioned("version").unwrap();
        let error = versioned.set("status", "X").apply(&pool, 1_i64, 1).await.unwrap_err();
        assert!(error.to_string().contains("must be unique"), "{error}");
        let sql = format!("SELECT status, version FROM {table}");
        let after: Vec<(String, i64)> =
            sqlx::query_as(sqlx::AssertSqlSafe(sql)).fetch_all(&pool).await.unwrap();
        exec(&pool, format!("DROP TABLE {table}")).await;
        assert_eq!(after, [("UNPAID".to_string(), 1), ("UNPAID".to_string(), 1)]);
    }

    async fn exec(pool: &sqlx::PgPool, sql: String) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(pool).await.unwrap();
    }

    /// A state column of type `CHAR(n)`: PostgreSQL compares `'PAID'` and the padded
    /// `'PAID      '` as equal, so the update's `IN` matches an unpadded source, but the
    /// guard decides "already applied" by comparing, in Rust, the padded value it read
    /// back with the target. A redelivered "pay" answers `Conflict("PAID      ")`, a
    /// terminal refusal that dead-letters the duplicate with an alert, instead of
    /// `AlreadyApplied`.
    #[tokio::test]
    async fn a_char_state_column_answers_already_applied() {
        let Some(pool) = postgres::pool(2).await else { return };
        let table = mysql::table("guard_char");
        exec(
            &pool,
            format!("CREATE TABLE {table} (id BIGINT PRIMARY KEY, status CHAR(10) NOT NULL)"),
        )
        .await;
        exec(&pool, format!("INSERT INTO {table} VALUES (1, 'UNPAID')")).await;
        let pay: StateGuard<String> =
            Table::new(&table, "id").unwrap().state("status", ["UNPAID"], "PAID").unwrap();
        let first = pay.apply(&pool, 1_i64).await.unwrap();
        let again = pay.apply(&pool, 1_i64).await.unwrap();
        exec(&pool, format!("DROP TABLE {table}")).await;
        assert_eq!((first, again), (StateChange::Applied, StateChange::AlreadyApplied));
    }

    /// In a REPEATABLE READ transaction whose snapshot predates another writer's
    /// commit, a version guard given the row's current version (carried by the message,
    /// or read outside the transaction) misses the snapshot's row, and then reads the
    /// version back from the same old snapshot: it answers `Stale(1)` for a row at
    /// version 2 that was given 2. `Stale` promises "another writer got there first:
    /// the row's version is now this one"; the truth is a serialization conflict
    /// (a retry in a new transaction applies). The MySQL side reads with a locking
    /// read for exactly this reason; the PostgreSQL side does not.
    #[tokio::test]
    async fn stale_never_reports_a_version_older_than_the_one_given() {
        let Some(pool) = postgres::pool(2).await else { return };
        let table = mysql::table("guard_rr");
        exec(&pool, format!("CREATE TABLE {table} (id BIGINT PRIMARY KEY, stock BIGINT NOT NULL, version BIGINT NOT NULL)"))
            .await;
        exec(&pool, format!("INSERT INTO {table} VALUES (1, 10, 1)")).await;
        let guard = Table::new(&table, "id").unwrap().versioned("version").unwrap();
        let mut tx = pool.begin().await.unwrap();
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut *tx)
            .await
            .unwrap();
        sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap(); // the snapshot
        exec(&pool, format!("UPDATE {table} SET stock = 9, version = 2 WHERE id = 1")).await;
        let answer = guard.set("stock", 8_i64).apply(&mut *tx, 1_i64, 2).await;
        tx.rollback().await.unwrap();
        exec(&pool, format!("DROP TABLE {table}")).await;
        assert!(
            !matches!(answer, Ok(VersionChange::Stale(now)) if now <= 2),
            "given version 2, the guard answered {answer:?}"
        );
    }
}

/// MySQL and MariaDB only.
mod on_mysql_only {
    use super::*;

    type Pool = sqlx::MySqlPool;

    async fn exec(pool: &Pool, sql: String) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(pool).await.unwrap();
    }

    async fn mariadb(pool: &Pool) -> bool {
        let version: String = sqlx::query_scalar("SELECT VERSION()").fetch_one(pool).await.unwrap();
        version.contains("MariaDB")
    }

    /// On a pool (each statement commits on its own), the state guard's second
    /// statement, which reads the state after the update found a conflicting one,
    /// can see a later writer's state. Here the update finds CANCELLED, another
    /// writer queued behind it reopens the order (UNPAID) and commits, and the guard
    /// answers `Conflict("UNPAID")`: a terminal refusal naming a state the change is
    /// allowed from, so the message is dead-lettered although it could apply now.
    #[tokio::test]
    async fn a_conflict_never_names_a_state_the_change_is_allowed_from() {
        let Some(pool) = mysql::pool(4).await else { return };
        let table = mysql::table("guard_conflict_race");
        exec(
            &pool,
            format!("CREATE TABLE {table} (id BIGINT PRIMARY KEY, status VARCHAR(16) NOT NULL)"),
        )
        .await;
        exec(&pool, format!("INSERT INTO {table} VALUES (1, 'CANCELLED')")).await;
        let pay = Arc::new(
            Table::new(&table, "id")
                .unwrap()
                .state::<String>("status", ["UNPAID"], "PAID")
                .unwrap(),
        );
        // Someone holds the row; the guard's update queues behind them, and a writer
        // that reopens the order queues behind the guard.
        let mut holder = pool.begin().await.unwrap();
        let lock = format!("SELECT status FROM {table} WHERE id = 1 FOR UPDATE");
        sqlx::query(sqlx::AssertSqlSafe(lock)).execute(&mut *holder).await.unwrap();
        let guard = tokio::spawn({
            let (pool, pay) = (pool.clone(), pay.clone());
            async move { pay.apply(&pool, 1_i64).await }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let reopen = tokio::spawn({
            let (pool, table) = (pool.clone(), table.clone());
            async move {
                let mut tx = pool.begin().await.unwrap();
                let sql = format!("UPDATE {table} SET status = 'UNPAID' WHERE id = 1");
                sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&mut *tx).await.unwrap();
                tokio::time::sleep(Duration::from_millis(300)).await;
                tx.commit().await.unwrap();
            }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        holder.commit().await.unwrap();
        let answer = guard.await.unwrap().unwrap();
        reopen.await.unwrap();
        exec(&pool, format!("DROP TABLE {table}")).await;
        assert!(
            matches!(&answer, StateChange::Applied)
                || answer == StateChange::Conflict("CANCELLED".to_string()),
            "the guard answered {answer:?}"
        );
    }

    #[derive(Debug, thiserror::Error, Classify)]
    enum ReserveError {
        #[error(transparent)]
        #[idempotent(transparent)]
        Db(#[from] sqlx::Error),
        #[error(transparent)]
        #[idempotent(transparent)]
        Version(#[from] VersionRefused),
    }

    /// The optimistic-locking handler of `examples/optimistic_lock.rs`, with another
    /// writer committing between its read and its guarded write.
    #[idempotent(key = "reserve:{sku}", store = NoStore)]
    async fn reserve(sku: i64, pool: &Pool, table: &str) -> Result<(), ReserveError> {
        let mut tx = pool.begin().await?;
        let read = format!("SELECT stock, version FROM {table} WHERE id = ?");
        let read = sqlx::query_as(sqlx::AssertSqlSafe(read)).bind(sku);
        let (left, version): (i64, i64) = read.fetch_one(&mut *tx).await?;
        let other =
            format!("UPDATE {table} SET stock = stock - 1, version = version + 1 WHERE id = ?");
        sqlx::query(sqlx::AssertSqlSafe(other)).bind(sku).execute(pool).await?;
        let guard = Table::new(table, "id").unwrap().versioned("version").unwrap();
        guard.set("stock", left - 1).apply(&mut *tx, sku, version).await?.into_result()?;
        Ok(tx.commit().await?)
    }

    /// MariaDB from 11.6.2 on (11.8 LTS) runs with `innodb_snapshot_isolation = ON`:
    /// in a REPEATABLE READ transaction, a write to a row another transaction changed
    /// after this one's read view fails with error 1020, "Record has changed since last
    /// read ... try restarting transaction" (SQLSTATE HY000). That is the lost race the
    /// version guard exists to turn into a retry, but 1020 is not among the MySQL
    /// errors classified retryable, so the handler's error is terminal and the message
    /// is dead-lettered instead of retried. (The session setting stands in for the
    /// newer server's default; the state guard's concurrent duplicates meet the same
    /// error.)
    #[tokio::test]
    async fn a_lost_race_under_mariadb_snapshot_isolation_is_retried() {
        let Some(pool) = mysql::pool(1).await else { return };
        if !mariadb(&pool).await {
            return;
        }
        let settings = ["SET SESSION innodb_snapshot_isolation = ON"];
        let Some(pool) = mysql::pool_with(4, &settings).await else { return };
        let table = mysql::table("guard_snapshot");
        exec(&pool, format!("CREATE TABLE {table} (id BIGINT PRIMARY KEY, stock BIGINT NOT NULL, version BIGINT NOT NULL)"))
            .await;
        exec(&pool, format!("INSERT INTO {table} VALUES (1, 10, 1)")).await;
        let result = reserve(1, &pool, &table).await;
        exec(&pool, format!("DROP TABLE {table}")).await;
        assert_eq!(result.disposition(), Disposition::Retry, "{result:?}");
    }
}

/// MySQL and MariaDB only: triggers and names.
mod on_mysql_triggers {
    use super::*;

    async fn exec(pool: &sqlx::MySqlPool, sql: String) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(pool).await.unwrap();
    }

    /// A table with a trigger, even one that changes nothing (`SET NEW.x = NEW.x`):
    /// the server then no longer carries the `LAST_INSERT_ID(expr)` value in the
    /// update's OK packet (it reports 0, while the session's `LAST_INSERT_ID()` does
    /// hold the answer), so the MySQL state guard answers a protocol error for every
    /// row that exists, after having applied the change. The error is retryable: on
    /// `NoStore` the message is retried until its attempts run out and then
    /// dead-lettered, and through a pool the first attempt's change is committed
    /// although the caller was told it failed.
    #[tokio::test]
    async fn a_state_guard_answers_on_a_table_with_a_trigger() {
        let Some(pool) = mysql::pool(2).await else { return };
        let table = mysql::table("guard_trigger");
        exec(&pool, format!("CREATE TABLE {table} (id BIGINT PRIMARY KEY, status VARCHAR(16) NOT NULL, touched INT NOT NULL DEFAULT 0)"))
            .await;
        exec(&pool, format!("CREATE TRIGGER {table}_bu BEFORE UPDATE ON {table} FOR EACH ROW SET NEW.touched = NEW.touched"))
            .await;
        exec(
            &pool,
            format!("INSERT INTO {table} (id, status) VALUES (1, 'UNPAID'), (2, 'CANCELLED')"),
        )
        .await;
        let pay: StateGuard<String> =
            Table::new(&table, "id").unwrap().state("status", ["UNPAID"], "PAID").unwrap();
        let answers = [
            pay.apply(&pool, 1_i64).await.map_err(|e| e.to_string()),
            pay.apply(&pool, 1_i64).await.map_err(|e| e.to_string()),
            pay.apply(&pool, 2_i64).await.map_err(|e| e.to_string()),
        ];
        exec(&pool, format!("DROP TABLE {table}")).await;
        assert_eq!(
            answers,
            [
                Ok(StateChange::Applied),
                Ok(StateChange::AlreadyApplied),
                Ok(StateChange::Conflict("CANCELLED".to_string()))
            ]
        );
    }

    /// The version column is the guard's to bump, and `set` refuses it by name; but
    /// MySQL's column names are case-insensitive, so `set("VERSION", 100)` passes the
    /// check and the update writes `version = 100, version = version + 1`: the
    /// version jumps to 101.
    #[tokio::test]
    async fn the_version_column_cannot_be_set_under_another_spelling() {
        let Some(pool) = mysql::pool(2).await else { return };
        let table = mysql::table("guard_version_case");
        exec(&pool, format!("CREATE TABLE {table} (id BIGINT PRIMARY KEY, stock BIGINT NOT NULL, version BIGINT NOT NULL)"))
            .await;
        exec(&pool, format!("INSERT INTO {table} VALUES (1, 10, 1)")).await;
        let guard = Table::new(&table, "id").unwrap().versioned("version").unwrap();
        let bump = guard.set("stock", 9_i64).set("VERSION", 100_i64).apply(&pool, 1_i64, 1).await;
        let sql = format!("SELECT version FROM {table} WHERE id = 1");
        let version: i64 =
            sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_one(&pool).await.unwrap();
        exec(&pool, format!("DROP TABLE {table}")).await;
        assert!(bump.is_err(), "{bump:?}, and the version is now {version}");
    }
}
