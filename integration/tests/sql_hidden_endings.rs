//! `transactional` handlers whose transaction ends or aborts in ways the simple checks
//! would miss, each found by probing the real servers: on MariaDB a transaction ended
//! (its own `COMMIT`, `ROLLBACK`, DDL, a deadlock it caught) before a statement that
//! then hits a lock-wait timeout, whose error the handler returns; on PostgreSQL a
//! statement error the handler swallows (the transaction is aborted, and `COMMIT`
//! answers a rollback without an error), and a session `search_path` a handler leaves
//! on the pooled connection. The ledger and the record are read back from another
//! connection, after the first call and after a redelivery.

#[path = "support/mysql.rs"]
mod mysql;
#[path = "support/postgres.rs"]
mod postgres;

#[derive(Debug, thiserror::Error, idempotent::Classify)]
enum LedgerError {
    #[error("database: {0}")]
    #[idempotent(transparent)]
    Db(#[from] sqlx::Error),
    #[error("the payment provider timed out")]
    #[idempotent(retryable)]
    Timeout,
}

/// MariaDB's cases.
mod mariadb {
    use std::time::Duration;

    use super::{LedgerError, mysql};

    use idempotent::mysql_store::TransactionalClaim;
    use idempotent::{MysqlStore, idempotent};
    use sqlx::{AssertSqlSafe, MySql, Transaction};

    #[derive(Clone, Debug)]
    enum Step {
        /// Insert a ledger row.
        Insert,
        /// Run a statement, returning its error with `?`.
        Exec(String),
        /// Wait for a row lock held elsewhere (lock wait timeout 1 s), error with `?`.
        LockWait,
        /// Take part in a deadlock as victim; swallow the error.
        DeadlockSwallowed,
    }

    struct Job {
        id: i64,
        steps: Vec<Step>,
        fails: bool,
    }

    struct Env {
        ledger: String,
        locks: String,
        pool: sqlx::MySqlPool,
    }

    async fn heavier_side(
        pool: sqlx::MySqlPool,
        locks: String,
        locked: tokio::sync::oneshot::Sender<()>,
    ) {
        let mut side = pool.begin().await.unwrap();
        let heavy = format!("UPDATE {locks} SET n = n + 1 WHERE id >= 2 AND id < 100");
        sqlx::query(AssertSqlSafe(heavy)).execute(&mut *side).await.unwrap();
        locked.send(()).unwrap();
        let one = format!("UPDATE {locks} SET n = n + 1 WHERE id = 1");
        sqlx::query(AssertSqlSafe(one)).execute(&mut *side).await.unwrap();
        side.commit().await.unwrap();
    }

    async fn deadlock(tx: &mut Transaction<'_, MySql>, env: &Env) -> Result<(), sqlx::Error> {
        let one = format!("UPDATE {} SET n = n + 1 WHERE id = 1", env.locks);
        sqlx::query(AssertSqlSafe(one)).execute(&mut **tx).await?;
        let (locked, side_locked) = tokio::sync::oneshot::channel();
        tokio::spawn(heavier_side(env.pool.clone(), env.locks.clone(), locked));
        side_locked.await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let two = format!("UPDATE {} SET n = n + 1 WHERE id = 2", env.locks);
        sqlx::query(AssertSqlSafe(two)).execute(&mut **tx).await?;
        Ok(())
    }

    #[idempotent(key = "{id}", namespace = "findings-my", store = store, transactional)]
    async fn run_job(
        job: Job,
        store: &MysqlStore,
        env: &Env,
        tx: &mut Transaction<'_, MySql>,
    ) -> Result<(), LedgerError> {
        for step in &job.steps {
            match step {
                Step::Insert => {
                    let insert = format!("INSERT INTO {} (payment_id) VALUES (?)", env.ledger);
                    sqlx::query(AssertSqlSafe(insert)).bind(job.id).execute(&mut **tx).await?;
                }
                Step::Exec(s) => {
                    sqlx::raw_sql(AssertSqlSafe(s.clone())).execute(&mut **tx).await?;
                }
                Step::LockWait => {
                    sqlx::raw_sql("SET SESSION innodb_lock_wait_timeout = 1")
                        .execute(&mut **tx)
                        .await?;
                    let s = format!("UPDATE {} SET n = n + 1 WHERE id = 1000", env.locks);
                    sqlx::raw_sql(AssertSqlSafe(s)).execute(&mut **tx).await?;
                }
                Step::DeadlockSwallowed => {
                    let r = deadlock(tx, env).await;
                    assert!(r.is_err(), "the handler was not the deadlock's victim");
                }
            }
        }
        if job.fails { Err(LedgerError::Timeout) } else { Ok(()) }
    }

    struct Run {
        first: Result<idempotent::Outcome<()>, idempotent::Error<LedgerError>>,
        rows_first: i64,
        again: Result<idempotent::Outcome<()>, idempotent::Error<LedgerError>>,
        rows: i64,
        state: Option<String>,
    }

    /// Runs `steps` once (failing after them when `fails`), then a redelivery that
    /// inserts one row and succeeds; reads the ledger and the record from another
    /// connection after each.
    async fn run_case(
        claim: TransactionalClaim,
        steps: fn(&str) -> Vec<Step>,
        fails: bool,
    ) -> Option<Run> {
        static ID: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);
        let pool = mysql::pool(4).await?;
        let (ledger, locks) = (mysql::table("ledger"), mysql::table("locks"));
        let records = ledger.replacen("ledger", "records", 1);
        for create in [
            format!("CREATE TABLE {ledger} (payment_id bigint NOT NULL)"),
            format!("CREATE TABLE {locks} (id bigint PRIMARY KEY, n bigint NOT NULL)"),
            format!("INSERT INTO {locks} (id, n) SELECT seq, 0 FROM seq_1_to_1000"),
        ] {
            sqlx::query(AssertSqlSafe(create)).execute(&pool).await.unwrap();
        }
        // Row 1000 stays locked by another transaction for the whole case.
        let mut holder = pool.begin().await.unwrap();
        sqlx::query(AssertSqlSafe(format!("UPDATE {locks} SET n = n + 1 WHERE id = 1000")))
            .execute(&mut *holder)
            .await
            .unwrap();
        let case_pool = mysql::pool(4).await.unwrap();
        let store = MysqlStore::from_pool(case_pool.clone())
            .with_table(&records)
            .unwrap()
            .with_transactional_claim(claim);
        store.migrate().await.unwrap();
        let env = Env { ledger: ledger.clone(), locks: locks.clone(), pool: pool.clone() };
        let id = 100 + ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let count = format!("SELECT count(*) FROM {ledger} WHERE payment_id = ?");
        let state = format!("SELECT CAST(state AS CHAR) FROM {records} WHERE `key` LIKE ?");
        let read = || async {
            let rows: i64 = sqlx::query_scalar(AssertSqlSafe(count.clone()))
                .bind(id)
                .fetch_one(&pool)
                .await
                .unwrap();
            let state: Option<String> = sqlx::query_scalar(AssertSqlSafe(state.clone()))
                .bind(format!("%:{id}"))
                .fetch_optional(&pool)
                .await
                .unwrap();
            (rows, state)
        };
        let first = run_job(Job { id, steps: steps(&ledger), fails }, &store, &env).await;
        let (rows_first, _) = read().await;
        let again =
            run_job(Job { id, steps: vec![Step::Insert], fails: false }, &store, &env).await;
        let (rows, state) = read().await;
        holder.rollback().await.unwrap();
        case_pool.close().await;
        let ddl = format!("{ledger}_ddl");
        mysql::drop_tables(&pool, &[&ledger, &locks, &records, &ddl]).await;
        Some(Run { first, rows_first, again, rows, state })
    }

    fn s(x: &str) -> Step {
        Step::Exec(x.to_owned())
    }

    /// The call is dead-lettered, the key FAILED, and the redelivery writes nothing.
    fn assert_dead_lettered(case: &str, run: &Run, rows: i64) {
        assert!(
            matches!(&run.first, Err(idempotent::Error::Store { handler_ran: true, error, .. }) if error.is_permanent()),
            "{case}: first {:?}",
            run.first
        );
        assert!(
            matches!(run.again, Err(idempotent::Error::PreviouslyFailed { .. })),
            "{case}: again {:?}",
            run.again
        );
        assert_eq!(run.state.as_deref(), Some("F"), "{case}: state");
        assert_eq!((run.rows_first, run.rows), (rows, rows), "{case}: rows");
    }

    const CLAIMS: [TransactionalClaim; 2] =
        [TransactionalClaim::Committed, TransactionalClaim::InTransaction];

    /// The handler ends its transaction (COMMIT, ROLLBACK, DDL), writes again (that
    /// write commits on its own), then a statement of its hits a lock-wait timeout
    /// (innodb_rollback_on_timeout off, as by default) and it returns that error with
    /// `?`. The transaction had ended: the call must be dead-lettered, not retried over
    /// the committed rows, nor recorded DONE.
    #[tokio::test]
    async fn mariadb_ended_then_lock_wait_timeout_is_not_retried_or_done() {
        type Steps = fn(&str) -> Vec<Step>;
        let endings: [(&str, Steps, i64); 3] = [
            ("COMMIT", |_| vec![Step::Insert, s("COMMIT"), Step::Insert, Step::LockWait], 2),
            ("ROLLBACK", |_| vec![Step::Insert, s("ROLLBACK"), Step::Insert, Step::LockWait], 1),
            (
                "DDL",
                |l| {
                    vec![
                        Step::Insert,
                        s(&format!("CREATE TABLE {l}_ddl (x int)")),
                        Step::Insert,
                        Step::LockWait,
                    ]
                },
                2,
            ),
        ];
        for claim in CLAIMS {
            for (name, steps, rows) in endings {
                let Some(run) = run_case(claim, steps, false).await else { return };
                assert_dead_lettered(&format!("{claim:?} {name}"), &run, rows);
            }
        }
    }

    /// A deadlock the handler catches; it then writes again (outside any transaction:
    /// the server rolled its transaction back) and a later statement hits a lock-wait
    /// timeout, which it returns with `?`. SHOW ERRORS shows 1205, but the handler ran
    /// statements after the rollback: a retry doubles the committed write.
    #[tokio::test]
    async fn mariadb_caught_deadlock_then_write_then_lock_wait_is_not_retried() {
        for claim in CLAIMS {
            let Some(run) = run_case(
                claim,
                |_| vec![Step::Insert, Step::DeadlockSwallowed, Step::Insert, Step::LockWait],
                false,
            )
            .await
            else {
                return;
            };
            assert_dead_lettered(&format!("{claim:?}"), &run, 1);
        }
    }

    struct Moving {
        id: i64,
        /// A database the handler makes its session's (`USE`) after its write.
        uses: Option<String>,
    }

    #[idempotent(key = "{id}", namespace = "use-my", store = store, transactional)]
    async fn moving(
        m: Moving,
        store: &MysqlStore,
        ledger: &str,
        tx: &mut Transaction<'_, MySql>,
    ) -> Result<(), LedgerError> {
        let insert = format!("INSERT INTO {ledger} (payment_id) VALUES (?)");
        sqlx::query(AssertSqlSafe(insert)).bind(m.id).execute(&mut **tx).await?;
        if let Some(database) = m.uses {
            sqlx::raw_sql(AssertSqlSafe(format!("USE {database}"))).execute(&mut **tx).await?;
        }
        Ok(())
    }

    /// A handler that makes another database its session's (`USE tenant`, which the
    /// pool keeps on the connection), where a records table of the same name exists:
    /// later claims on that connection still go to the store's table, so a key DONE
    /// before is a duplicate and nothing is claimed in the tenant's table.
    #[tokio::test]
    async fn mariadb_a_database_a_handler_left_chosen_does_not_move_later_claims() {
        let Some(pool) = mysql::pool(2).await else { return };
        let home: String = sqlx::query_scalar("SELECT DATABASE()").fetch_one(&pool).await.unwrap();
        let (ledger, records, tenant) =
            (mysql::table("ledger"), mysql::table("records"), mysql::table("tenant"));
        let ledger = format!("{home}.{ledger}");
        for create in [
            format!("CREATE TABLE {ledger} (payment_id bigint NOT NULL)"),
            format!("CREATE DATABASE {tenant}"),
        ] {
            sqlx::query(AssertSqlSafe(create)).execute(&pool).await.unwrap();
        }
        let in_tenant = format!("{tenant}.{records}");
        MysqlStore::from_pool(pool.clone())
            .with_table(&in_tenant)
            .unwrap()
            .migrate()
            .await
            .unwrap();
        // One connection, so that every call reuses the one the handler moved.
        let one = mysql::pool(1).await.unwrap();
        let store = MysqlStore::from_pool(one).with_table(&records).unwrap();
        store.migrate().await.unwrap();
        // Before any statement of the store is prepared on it (a prepared statement
        // keeps the database it was prepared in).
        let moved = moving(Moving { id: 1, uses: Some(tenant.clone()) }, &store, &ledger).await;
        assert!(matches!(moved, Ok(idempotent::Outcome::Processed(()))), "{moved:?}");
        let new = moving(Moving { id: 2, uses: None }, &store, &ledger).await;
        assert!(matches!(new, Ok(idempotent::Outcome::Processed(()))), "a new key: {new:?}");
        let again = moving(Moving { id: 1, uses: None }, &store, &ledger).await;
        assert!(matches!(again, Ok(idempotent::Outcome::Duplicate)), "the DONE key 1: {again:?}");
        let stray = format!("SELECT count(*) FROM {in_tenant}");
        let stray: i64 = sqlx::query_scalar(AssertSqlSafe(stray)).fetch_one(&pool).await.unwrap();
        assert_eq!(stray, 0, "claims went to the tenant's table");
        for drop in
            [format!("DROP DATABASE {tenant}"), format!("DROP TABLE {ledger}, {home}.{records}")]
        {
            sqlx::query(AssertSqlSafe(drop)).execute(&pool).await.unwrap();
        }
    }
}

/// PostgreSQL's cases.
mod postgresql {
    use super::{LedgerError, postgres};

    use idempotent::mysql_store::TransactionalClaim;
    use idempotent::{PostgresStore, idempotent};
    use sqlx::{AssertSqlSafe, Postgres, Transaction};

    #[derive(Clone, Debug)]
    enum Step {
        Insert,
        Exec(String),
        Swallow(String),
    }

    struct Job {
        id: i64,
        steps: Vec<Step>,
        fails: bool,
    }

    #[idempotent(key = "{id}", namespace = "findings-pg", store = store, transactional)]
    async fn run_job(
        job: Job,
        store: &PostgresStore,
        ledger: &str,
        tx: &mut Transaction<'_, Postgres>,
    ) -> Result<(), LedgerError> {
        for step in &job.steps {
            match step {
                Step::Insert => {
                    let insert = format!("INSERT INTO public.{ledger} (payment_id) VALUES ($1)");
                    sqlx::query(AssertSqlSafe(insert)).bind(job.id).execute(&mut **tx).await?;
                }
                Step::Exec(s) => {
                    sqlx::raw_sql(AssertSqlSafe(s.clone())).execute(&mut **tx).await?;
                }
                Step::Swallow(s) => {
                    let r = sqlx::raw_sql(AssertSqlSafe(s.clone())).execute(&mut **tx).await;
                    eprintln!("  swallowed: {:?}", r.err().map(|e| e.to_string()));
                }
            }
        }
        if job.fails { Err(LedgerError::Timeout) } else { Ok(()) }
    }

    fn s(x: &str) -> Step {
        Step::Exec(x.to_owned())
    }

    /// A handler that swallows a statement error (its transaction is then aborted) and
    /// returns Ok. With the claim inside the transaction, the store's COMMIT of the
    /// aborted transaction is a rollback that PostgreSQL answers without an error: the
    /// call must not report Processed (the consumer would ack a message of which
    /// nothing, not even DONE, committed).
    #[tokio::test]
    async fn postgres_in_transaction_claim_aborted_transaction_is_not_processed() {
        let Some(pool) = postgres::pool(4).await else { return };
        let suffix = idempotent::testing::fresh_key("aborted").namespace().replace('-', "_");
        let (ledger, records) = (format!("ledger_{suffix}"), format!("records_{suffix}"));
        sqlx::query(AssertSqlSafe(format!("CREATE TABLE {ledger} (payment_id bigint NOT NULL)")))
            .execute(&pool)
            .await
            .unwrap();
        let store = PostgresStore::from_pool(pool.clone())
            .with_table(&records)
            .unwrap()
            .with_transactional_claim(TransactionalClaim::InTransaction);
        store.migrate().await.unwrap();
        for (id, swallowed) in [(1_i64, "SELECT 1/0"), (2, "DISCARD ALL")] {
            let steps = vec![Step::Insert, Step::Swallow(swallowed.to_owned())];
            let first = run_job(Job { id, steps, fails: false }, &store, &ledger).await;
            let count = format!("SELECT count(*) FROM {ledger} WHERE payment_id = $1");
            let rows: i64 =
                sqlx::query_scalar(AssertSqlSafe(count)).bind(id).fetch_one(&pool).await.unwrap();
            let state = format!("SELECT state::text FROM {records} WHERE key LIKE $1");
            let state: Option<String> = sqlx::query_scalar(AssertSqlSafe(state))
                .bind(format!("%:{id}").into_bytes())
                .fetch_optional(&pool)
                .await
                .unwrap();
            if matches!(first, Ok(idempotent::Outcome::Processed(()))) {
                panic!("{swallowed}: Processed, but {rows} ledger rows and record state {state:?}");
            }
            assert_eq!(rows, 0, "{swallowed}: rows");
            let again =
                run_job(Job { id, steps: vec![Step::Insert], fails: false }, &store, &ledger).await;
            assert!(
                matches!(again, Ok(idempotent::Outcome::Processed(()))),
                "{swallowed}: {again:?}"
            );
        }
    }

    /// A handler that sets `search_path` for its session (`SET`, not `SET LOCAL`) leaves
    /// it on the pooled connection: the store's next claims on that connection name the
    /// records table unqualified and go to the tenant schema's table of the same name,
    /// while DONE names the resolved `public` table and finds no claim: every message on
    /// that connection, new or already DONE, ends `LeaseLost` with its writes rolled back.
    #[tokio::test]
    async fn postgres_session_search_path_left_by_a_handler_does_not_move_later_claims() {
        let Some(pool) = postgres::pool(4).await else { return };
        let suffix = idempotent::testing::fresh_key("tenantpath").namespace().replace('-', "_");
        let (ledger, records, tenant) =
            (format!("ledger_{suffix}"), format!("records_{suffix}"), format!("tenant_{suffix}"));
        for create in [
            format!("CREATE TABLE {ledger} (payment_id bigint NOT NULL)"),
            format!("CREATE SCHEMA {tenant}"),
        ] {
            sqlx::query(AssertSqlSafe(create)).execute(&pool).await.unwrap();
        }
        PostgresStore::from_pool(pool.clone())
            .with_table(&records)
            .unwrap()
            .migrate()
            .await
            .unwrap();
        PostgresStore::from_pool(pool.clone())
            .with_table(&format!("{tenant}.{records}"))
            .unwrap()
            .migrate()
            .await
            .unwrap();
        // One connection, so that every call reuses the one the first handler changed.
        let one = postgres::pool(1).await.unwrap();
        let store = PostgresStore::from_pool(one.clone()).with_table(&records).unwrap();
        let first =
            run_job(Job { id: 1, steps: vec![Step::Insert], fails: false }, &store, &ledger).await;
        assert!(matches!(first, Ok(idempotent::Outcome::Processed(()))), "{first:?}");
        let moved = vec![Step::Insert, s(&format!("SET search_path TO {tenant}, public"))];
        let second = run_job(Job { id: 2, steps: moved, fails: false }, &store, &ledger).await;
        assert!(matches!(second, Ok(idempotent::Outcome::Processed(()))), "{second:?}");
        let new =
            run_job(Job { id: 3, steps: vec![Step::Insert], fails: false }, &store, &ledger).await;
        assert!(matches!(new, Ok(idempotent::Outcome::Processed(()))), "a new key: {new:?}");
        let again =
            run_job(Job { id: 1, steps: vec![Step::Insert], fails: false }, &store, &ledger).await;
        let count = format!("SELECT count(*) FROM {ledger} WHERE payment_id = 1");
        let rows: i64 = sqlx::query_scalar(AssertSqlSafe(count)).fetch_one(&pool).await.unwrap();
        assert_eq!(rows, 1, "the DONE key 1 ran again: {again:?}");
        let claimed = format!("SELECT count(*) FROM {tenant}.{records}");
        let stray: i64 = sqlx::query_scalar(AssertSqlSafe(claimed)).fetch_one(&pool).await.unwrap();
        eprintln!("records claimed in the tenant's table: {stray}");
        assert!(matches!(again, Ok(idempotent::Outcome::Duplicate)), "the DONE key 1: {again:?}");
    }
}
