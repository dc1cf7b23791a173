//! `#[idempotent(transactional)]` against the machine's PostgreSQL (`DATABASE_URL`,
//! default `postgres://postgres@127.0.0.1:5432/test`) and MySQL or MariaDB
//! (`MYSQL_URL`, default `mysql://root@127.0.0.1:3306/test`): the business rows and
//! the DONE record commit together or not at all. The same tests run on both
//! databases, each claim mode, through `transactional_tests!`; what differs between
//! the databases (SQL spelling, how a connection is killed) is in `pg` and `my`, and
//! what only one database can do is in the tests each passes to the macro. Each test
//! has its own record and business tables, so the tests run in parallel.
//!
//! The business table has no unique constraint: a message processed twice shows up
//! as two rows.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

#[path = "support/cancel.rs"]
mod cancel;
#[path = "support/mysql.rs"]
mod mysql;
#[path = "support/postgres.rs"]
mod postgres;
#[path = "support/sql_dialect.rs"]
mod sql_dialect;

use idempotent::{Classify, Error, Outcome, idempotent};
use sqlx::{AssertSqlSafe, Transaction};
use tokio::sync::Notify;

#[derive(Debug, Clone)]
struct Debit {
    id: i64,
    account: i64,
    amount: i64,
}

fn debit_of(id: i64) -> Debit {
    Debit { id, account: id % 7, amount: 100 + id }
}

#[derive(Debug, thiserror::Error, Classify)]
enum DebitError {
    #[error("database: {0}")]
    #[idempotent(transparent)]
    Db(#[from] sqlx::Error),
    #[error("the ledger timed out")]
    #[idempotent(retryable)]
    Flaky,
    #[error("account closed")]
    #[idempotent(terminal)]
    Refused,
    #[error("debited already")]
    #[idempotent(duplicate)]
    AlreadyApplied,
}

/// What the handler does after its business write.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fault {
    None,
    Retryable,
    Terminal,
    /// The handler's guard finds the debit made already.
    AlreadyApplied,
    Panic,
    /// Signals `reached`, then never finishes: the caller drops the call.
    Hang,
    /// Reports its connection's id, waits for `go`, then queries the (killed)
    /// connection.
    AwaitKill,
    /// Hands the record's claim to another token, as a consumer that took over an
    /// expired lease would.
    LoseLease,
    /// Writes a row that breaks a constraint checked at commit: the commit fails.
    /// PostgreSQL only (MySQL checks every constraint at once).
    FailCommit,
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// A fresh pair of table names, `records_…` and `ledger_…`.
fn fresh_tables() -> (String, String) {
    let records = mysql::table("records");
    let ledger = records.replacen("records", "ledger", 1);
    (records, ledger)
}

/// PostgreSQL's side of the tests.
mod pg {
    pub use super::sql_dialect::pg::*;
    use sqlx::Transaction;

    pub fn create_ledger(ledger: &str) -> String {
        format!(
            "CREATE TABLE {ledger} (message_id bigint NOT NULL, account bigint NOT NULL, \
             amount bigint NOT NULL)"
        )
    }

    pub fn insert(ledger: &str) -> String {
        format!("INSERT INTO {ledger} (message_id, account, amount) VALUES ($1, $2, $3)")
    }

    pub fn totals(ledger: &str) -> String {
        format!(
            "SELECT count(*), count(DISTINCT message_id), coalesce(sum(amount), 0)::bigint \
             FROM {ledger}"
        )
    }

    pub fn state(records: &str) -> String {
        format!("SELECT state::text FROM {records} WHERE key = $1")
    }

    pub async fn connection_id(tx: &mut Transaction<'_, Db>) -> Result<i64, sqlx::Error> {
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut **tx).await?;
        Ok(i64::from(pid))
    }

    pub async fn kill(pool: &Pool, id: i64) {
        let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
            .bind(i32::try_from(id).unwrap())
            .fetch_one(pool)
            .await
            .unwrap();
        assert!(killed, "backend {id} was not terminated");
    }

    /// Whether the pooled connection `pool` hands out next is inside a transaction.
    pub async fn in_transaction(pool: &Pool) -> bool {
        // The first statement of a transaction starts it: an older transaction start
        // means the session was left in one. (One simple-protocol message, so the two
        // times are equal in a transaction of its own.)
        let check = "SELECT transaction_timestamp() <> statement_timestamp()";
        let row = sqlx::raw_sql(check).fetch_one(pool).await.unwrap();
        sqlx::Row::get(&row, 0)
    }

    pub async fn break_the_commit(tx: &mut Transaction<'_, Db>) -> Result<(), sqlx::Error> {
        let sql = "CREATE TEMP TABLE deferred_check (n int UNIQUE DEFERRABLE INITIALLY DEFERRED) \
                   ON COMMIT DROP";
        sqlx::query(sql).execute(&mut **tx).await?;
        sqlx::query("INSERT INTO deferred_check VALUES (1), (1)").execute(&mut **tx).await?;
        Ok(())
    }
}

/// MySQL's and MariaDB's side of the tests.
mod my {
    pub use super::sql_dialect::my::*;
    use sqlx::{AssertSqlSafe, Transaction};

    pub fn create_ledger(ledger: &str) -> String {
        format!(
            "CREATE TABLE {ledger} (message_id bigint NOT NULL, account bigint NOT NULL, \
             amount bigint NOT NULL, KEY (message_id))"
        )
    }

    pub fn insert(ledger: &str) -> String {
        format!("INSERT INTO {ledger} (message_id, account, amount) VALUES (?, ?, ?)")
    }

    pub fn totals(ledger: &str) -> String {
        format!(
            "SELECT count(*), count(DISTINCT message_id), \
             CAST(coalesce(sum(amount), 0) AS SIGNED) FROM {ledger}"
        )
    }

    pub fn state(records: &str) -> String {
        format!("SELECT state FROM {records} WHERE `key` = ?")
    }

    pub async fn connection_id(tx: &mut Transaction<'_, Db>) -> Result<i64, sqlx::Error> {
        let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()").fetch_one(&mut **tx).await?;
        Ok(i64::try_from(id).unwrap())
    }

    /// `KILL CONNECTION`: the next query fails and the open transaction dies with the
    /// connection.
    pub async fn kill(pool: &Pool, id: i64) {
        sqlx::query(AssertSqlSafe(format!("KILL CONNECTION {id}"))).execute(pool).await.unwrap();
    }

    /// Whether the pooled connection `pool` hands out next is inside a transaction.
    pub async fn in_transaction(pool: &Pool) -> bool {
        let open: u64 =
            sqlx::query_scalar("SELECT @@in_transaction").fetch_one(pool).await.unwrap();
        open != 0
    }

    pub async fn break_the_commit(_: &mut Transaction<'_, Db>) -> Result<(), sqlx::Error> {
        unreachable!("MySQL has no constraint checked at commit: no test scripts FailCommit here")
    }
}

/// Two tests that run `$test` with each claim mode, in a module named after it.
macro_rules! in_both_claim_modes {
    ($test:ident) => {
        mod $test {
            use super::*;

            #[tokio::test]
            async fn claim_committed() {
                super::$test(TransactionalClaim::Committed).await;
            }

            #[tokio::test]
            async fn claim_in_the_transaction() {
                super::$test(TransactionalClaim::InTransaction).await;
            }
        }
    };
}

/// The tests for one database: `$sql` is its module above; `$extra` are tests only
/// that database can run, expanded beside the others (they see `Bank` and `debit`).
macro_rules! transactional_tests {
    ($name:ident, $sql:ident, { $($extra:item)* }) => {
        mod $name {
            use super::*;
            use super::$sql as sql;
            use sql::{Db, Store, TransactionalClaim};

            /// One test's tables and fault script.
            struct Bank {
                store: Store,
                records: String,
                ledger: String,
                insert: String,
                /// Faults for the next runs, in order; then `random` or none.
                script: Mutex<VecDeque<Fault>>,
                /// Seed of the random faults; 0 for none.
                random: AtomicU64,
                reached: Notify,
                go: Notify,
                connection: Mutex<Option<i64>>,
            }

            impl Bank {
                /// Fresh tables; `None` (with a printed reason) when no server answers
                /// outside CI.
                async fn open(connections: u32) -> Option<Bank> {
                    Bank::open_with(connections, TransactionalClaim::Committed).await
                }

                /// As [`Bank::open`], with `claim` as the store's transactional claim.
                async fn open_with(connections: u32, claim: TransactionalClaim) -> Option<Bank> {
                    let pool = sql::pool(connections).await?;
                    let (records, ledger) = fresh_tables();
                    let store = Store::from_pool(pool).with_table(&records).unwrap();
                    let store = store.with_transactional_claim(claim);
                    store.migrate().await.unwrap();
                    sqlx::query(AssertSqlSafe(sql::create_ledger(&ledger)))
                        .execute(store.pool())
                        .await
                        .unwrap();
                    Some(Bank::on(store, records, ledger))
                }

                /// A bank on `store`, whose table is `records`, writing to `ledger`.
                fn on(store: Store, records: String, ledger: String) -> Bank {
                    Bank {
                        store,
                        records,
                        insert: sql::insert(&ledger),
                        ledger,
                        script: Mutex::new(VecDeque::new()),
                        random: AtomicU64::new(0),
                        reached: Notify::new(),
                        go: Notify::new(),
                        connection: Mutex::new(None),
                    }
                }

                fn script(&self, faults: &[Fault]) {
                    self.script.lock().unwrap().extend(faults);
                }

                /// The next fault: scripted, else random (about 1 run in 8), else none.
                fn next_fault(&self) -> Fault {
                    if let Some(fault) = self.script.lock().unwrap().pop_front() {
                        return fault;
                    }
                    let seed = self.random.load(Ordering::Relaxed);
                    if seed == 0 {
                        return Fault::None;
                    }
                    let step = self.random.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
                    match splitmix(step) % 100 {
                        0..=7 => Fault::Retryable,
                        8..=9 => Fault::Panic,
                        10..=11 => Fault::Hang,
                        _ => Fault::None,
                    }
                }

                /// Rows the ledger holds for `id`, read outside any handler transaction.
                async fn rows(&self, id: i64) -> i64 {
                    sqlx::query_scalar(AssertSqlSafe(sql::count_rows(&self.ledger)))
                        .bind(id)
                        .fetch_one(self.store.pool())
                        .await
                        .unwrap()
                }

                /// The record's state letter for `id` (`P`, `R`, `D`, `F`), if any.
                async fn state(&self, id: i64) -> Option<String> {
                    let key = idempotent::Key::new("debit", format!("debit:{id}")).unwrap();
                    sqlx::query_scalar(AssertSqlSafe(sql::state(&self.records)))
                        .bind(key.as_bytes())
                        .fetch_optional(self.store.pool())
                        .await
                        .unwrap()
                }

                async fn drop_tables(&self) {
                    sql::drop_tables(self.store.pool(), &[&self.records, &self.ledger]).await;
                }
            }

            /// Writes one ledger row, then does what the fault script says; returns
            /// the amount.
            #[idempotent(
                key = "debit:{id}",
                store = bank.store,
                transactional,
                lease = "2s",
                max_attempts = 25,
                cache = true
            )]
            async fn debit(
                msg: &Debit,
                bank: &Bank,
                tx: &mut Transaction<'_, Db>,
            ) -> Result<i64, DebitError> {
                sqlx::query(AssertSqlSafe(bank.insert.as_str()))
                    .bind(msg.id)
                    .bind(msg.account)
                    .bind(msg.amount)
                    .execute(&mut **tx)
                    .await?;
                match bank.next_fault() {
                    Fault::None => {}
                    Fault::Retryable => return Err(DebitError::Flaky),
                    Fault::Terminal => return Err(DebitError::Refused),
                    Fault::AlreadyApplied => return Err(DebitError::AlreadyApplied),
                    Fault::Panic => panic!("the ledger panicked"),
                    Fault::Hang => {
                        bank.reached.notify_one();
                        std::future::pending::<()>().await;
                    }
                    Fault::AwaitKill => {
                        *bank.connection.lock().unwrap() = Some(sql::connection_id(tx).await?);
                        bank.reached.notify_one();
                        bank.go.notified().await;
                        sqlx::query("SELECT 1").execute(&mut **tx).await?;
                    }
                    Fault::FailCommit => sql::break_the_commit(tx).await?,
                    Fault::LoseLease => {
                        let key =
                            idempotent::Key::new("debit", format!("debit:{}", msg.id)).unwrap();
                        sqlx::query(AssertSqlSafe(sql::steal_claim(&bank.records)))
                            .bind(key.as_bytes())
                            .execute(bank.store.pool())
                            .await?;
                    }
                }
                Ok(msg.amount)
            }

            /// Delivers `msg` until a run ends it (a release in flight reads as in
            /// progress).
            async fn deliver_until_settled(
                bank: &Bank,
                msg: &Debit,
            ) -> Result<Outcome<i64>, Error<DebitError>> {
                for _ in 0..200 {
                    match debit(msg, bank).await {
                        Ok(Outcome::InProgress { .. }) => {
                            tokio::time::sleep(Duration::from_millis(10)).await
                        }
                        other => return other,
                    }
                }
                panic!("message {} stayed in progress", msg.id);
            }

            /// Runs the call until the handler signals `reached`, then drops it, as a
            /// crash between the business write and DONE would.
            async fn crash_mid_handler(bank: &Bank, msg: &Debit) {
                let call = debit(msg, bank);
                tokio::pin!(call);
                tokio::select! {
                    out = &mut call => panic!("the hanging run returned {out:?}"),
                    () = bank.reached.notified() => {}
                }
                // The row is written in the open transaction, invisible to everyone else.
                assert_eq!(bank.rows(msg.id).await, 0);
            }

            in_both_claim_modes!(the_business_write_and_done_commit_together);
            async fn the_business_write_and_done_commit_together(claim: TransactionalClaim) {
                let Some(bank) = Bank::open_with(5, claim).await else { return };
                let msg = debit_of(1);
                assert_eq!(debit(&msg, &bank).await.unwrap(), Outcome::Processed(101));
                assert_eq!(bank.rows(1).await, 1);
                assert_eq!(bank.state(1).await.as_deref(), Some("D"));
                assert_eq!(debit(&msg, &bank).await.unwrap(), Outcome::Replayed(101));
                assert_eq!(bank.rows(1).await, 1);
                bank.drop_tables().await;
            }

            in_both_claim_modes!(a_retryable_error_or_a_panic_rolls_back_and_releases);
            async fn a_retryable_error_or_a_panic_rolls_back_and_releases(
                claim: TransactionalClaim,
            ) {
                let Some(bank) = Bank::open_with(5, claim).await else { return };
                let msg = debit_of(2);
                bank.script(&[Fault::Retryable, Fault::Panic]);
                let err = debit(&msg, &bank).await.unwrap_err();
                assert!(matches!(err, Error::Retryable { attempt: 1, .. }), "{err:?}");
                assert_eq!((bank.rows(2).await, bank.state(2).await.as_deref()), (0, Some("R")));
                let err = debit(&msg, &bank).await.unwrap_err();
                assert!(matches!(err, Error::Panicked { attempt: 2, .. }), "{err:?}");
                assert_eq!((bank.rows(2).await, bank.state(2).await.as_deref()), (0, Some("R")));
                assert_eq!(debit(&msg, &bank).await.unwrap(), Outcome::Processed(102));
                assert_eq!(bank.rows(2).await, 1);
                bank.drop_tables().await;
            }

            in_both_claim_modes!(a_terminal_error_rolls_back_and_records_failed);
            async fn a_terminal_error_rolls_back_and_records_failed(claim: TransactionalClaim) {
                let Some(bank) = Bank::open_with(5, claim).await else { return };
                let msg = debit_of(3);
                bank.script(&[Fault::Terminal]);
                let err = debit(&msg, &bank).await.unwrap_err();
                assert!(
                    matches!(err, Error::Terminal { attempt: 1, exhausted: false, .. }),
                    "{err:?}"
                );
                assert_eq!((bank.rows(3).await, bank.state(3).await.as_deref()), (0, Some("F")));
                let err = debit(&msg, &bank).await.unwrap_err();
                assert!(matches!(err, Error::PreviouslyFailed { attempts: 1 }), "{err:?}");
                assert_eq!(bank.rows(3).await, 0);
                bank.drop_tables().await;
            }

            in_both_claim_modes!(an_effect_found_applied_rolls_back_and_records_done);
            async fn an_effect_found_applied_rolls_back_and_records_done(
                claim: TransactionalClaim,
            ) {
                let Some(bank) = Bank::open_with(5, claim).await else { return };
                let msg = debit_of(4);
                bank.script(&[Fault::AlreadyApplied]);
                assert_eq!(debit(&msg, &bank).await.unwrap(), Outcome::Duplicate);
                assert_eq!((bank.rows(4).await, bank.state(4).await.as_deref()), (0, Some("D")));
                assert_eq!(debit(&msg, &bank).await.unwrap(), Outcome::Duplicate);
                assert_eq!(bank.rows(4).await, 0);
                bank.drop_tables().await;
            }

            in_both_claim_modes!(a_crash_between_the_write_and_done_commits_neither);
            async fn a_crash_between_the_write_and_done_commits_neither(
                claim: TransactionalClaim,
            ) {
                let Some(bank) = Bank::open_with(5, claim).await else { return };
                let msg = debit_of(4);
                bank.script(&[Fault::Hang]);
                crash_mid_handler(&bank, &msg).await;
                assert_eq!(bank.rows(4).await, 0);
                assert_ne!(bank.state(4).await.as_deref(), Some("D"));
                let settled = deliver_until_settled(&bank, &msg).await.unwrap();
                assert_eq!(settled, Outcome::Processed(104));
                assert_eq!(debit(&msg, &bank).await.unwrap(), Outcome::Replayed(104));
                assert_eq!(bank.rows(4).await, 1);
                bank.drop_tables().await;
            }

            in_both_claim_modes!(a_connection_killed_mid_handler_is_retryable_and_commits_nothing);
            async fn a_connection_killed_mid_handler_is_retryable_and_commits_nothing(
                claim: TransactionalClaim,
            ) {
                let Some(bank) = Bank::open_with(5, claim).await else { return };
                let msg = debit_of(5);
                bank.script(&[Fault::AwaitKill]);
                let killer = async {
                    bank.reached.notified().await;
                    let id = bank.connection.lock().unwrap().expect("the handler reported it");
                    sql::kill(bank.store.pool(), id).await;
                    bank.go.notify_one();
                };
                let (result, ()) = tokio::join!(debit(&msg, &bank), killer);
                let err = result.unwrap_err();
                assert!(
                    matches!(err, Error::Retryable { error: DebitError::Db(_), attempt: 1, .. }),
                    "{err:?}"
                );
                assert_eq!((bank.rows(5).await, bank.state(5).await.as_deref()), (0, Some("R")));
                assert_eq!(debit(&msg, &bank).await.unwrap(), Outcome::Processed(105));
                assert_eq!(bank.rows(5).await, 1);
                bank.drop_tables().await;
            }

            #[tokio::test]
            async fn a_lost_claim_rolls_the_business_write_back() {
                let Some(bank) = Bank::open(5).await else { return };
                let msg = debit_of(6);
                bank.script(&[Fault::LoseLease]);
                let err = debit(&msg, &bank).await.unwrap_err();
                assert!(matches!(err, Error::LeaseLost { attempt: 1, .. }), "{err:?}");
                assert_eq!((bank.rows(6).await, bank.state(6).await.as_deref()), (0, Some("P")));
                bank.drop_tables().await;
            }

            // A call dropped at any of its awaits (a consumer's deadline, a shutdown)
            // gives its connection back to the pool outside any transaction: one
            // dropped while the handler's transaction was beginning would otherwise
            // leave the session in a transaction the pool does not know of, and the
            // next autocommit claim on that connection would hold its row locks,
            // uncommitted, for as long as it stays pooled.
            in_both_claim_modes!(a_call_dropped_at_any_await_leaves_no_transaction_open);
            async fn a_call_dropped_at_any_await_leaves_no_transaction_open(
                claim: TransactionalClaim,
            ) {
                // One connection, so the check below gets the one the dropped call used.
                let Some(bank) = Bank::open_with(1, claim).await else { return };
                let mut finished = false;
                for pending in 1..=40 {
                    let msg = debit_of(1_000 + pending);
                    if cancel::drop_after_pending(debit(&msg, &bank), pending as usize)
                        .await
                        .is_some()
                    {
                        finished = true;
                        break;
                    }
                    assert!(
                        !sql::in_transaction(bank.store.pool()).await,
                        "dropped after {pending} awaits: the pooled connection is in a transaction"
                    );
                    let outcome = deliver_until_settled(&bank, &msg).await.unwrap();
                    assert!(
                        matches!(outcome, Outcome::Processed(_) | Outcome::Replayed(_)),
                        "{outcome:?}"
                    );
                    assert_eq!(bank.rows(msg.id).await, 1, "message {}", msg.id);
                }
                assert!(finished, "a call took more than 40 awaits");
                bank.drop_tables().await;
            }

            // 8 consumers share 5,000 deliveries (4,000 messages, 1,000 of them
            // delivered twice), with retryable errors, panics and hung handlers
            // injected at random. Anything not settled goes back on the queue, as a
            // broker would redeliver it.
            mod eight_consumers_apply_each_message_exactly_once {
                use super::*;

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn claim_committed() {
                    super::eight_consumers(TransactionalClaim::Committed).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn claim_in_the_transaction() {
                    super::eight_consumers(TransactionalClaim::InTransaction).await;
                }
            }

            async fn eight_consumers(claim: TransactionalClaim) {
                const UNIQUE: i64 = 4_000;
                const DUPLICATES: i64 = 1_000;
                let Some(bank) = Bank::open_with(16, claim).await else { return };
                let seed =
                    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
                bank.random.store(u64::from(seed.subsec_nanos()) | 1, Ordering::Relaxed);
                println!("fault seed {}", bank.random.load(Ordering::Relaxed));

                let mut deliveries: Vec<Debit> = (0..UNIQUE).map(debit_of).collect();
                deliveries.extend((0..DUPLICATES).map(|i| debit_of(i * 4)));
                let mut order = splitmix(seed.as_nanos() as u64);
                for i in (1..deliveries.len()).rev() {
                    order = splitmix(order);
                    deliveries.swap(i, (order % (i as u64 + 1)) as usize);
                }
                let queue = Mutex::new(VecDeque::from(deliveries));
                let open = AtomicUsize::new(queue.lock().unwrap().len());
                let (processed, redelivered) = (AtomicUsize::new(0), AtomicUsize::new(0));

                let consumer = || async {
                    loop {
                        let next = queue.lock().unwrap().pop_front();
                        let Some(msg) = next else {
                            if open.load(Ordering::SeqCst) == 0 {
                                return;
                            }
                            tokio::time::sleep(Duration::from_millis(5)).await;
                            continue;
                        };
                        // A hung handler is cut off, as a consumer's processing
                        // deadline would.
                        let deadline = Duration::from_millis(500);
                        let settled = match tokio::time::timeout(deadline, debit(&msg, &bank)).await
                        {
                            Ok(Ok(Outcome::Processed(_) | Outcome::ProcessedNotCached { .. })) => {
                                processed.fetch_add(1, Ordering::SeqCst);
                                true
                            }
                            Ok(Ok(Outcome::Duplicate | Outcome::Replayed(_))) => true,
                            Ok(Ok(Outcome::InProgress { .. })) => false,
                            Ok(Err(e)) if e.is_retryable() => false,
                            Ok(Err(e)) => panic!("message {} failed for good: {e}", msg.id),
                            Err(_) => false,
                        };
                        if settled {
                            open.fetch_sub(1, Ordering::SeqCst);
                        } else {
                            redelivered.fetch_add(1, Ordering::SeqCst);
                            queue.lock().unwrap().push_back(msg);
                        }
                    }
                };
                let started = std::time::Instant::now();
                futures_util::future::join_all((0..8).map(|_| consumer())).await;
                println!(
                    "{} processed, {} redeliveries, in {:?}",
                    processed.load(Ordering::SeqCst),
                    redelivered.load(Ordering::SeqCst),
                    started.elapsed()
                );

                let (rows, distinct, total): (i64, i64, i64) =
                    sqlx::query_as(AssertSqlSafe(sql::totals(&bank.ledger)))
                        .fetch_one(bank.store.pool())
                        .await
                        .unwrap();
                assert_eq!((rows, distinct), (UNIQUE, UNIQUE), "one ledger row per message");
                assert_eq!(total, (0..UNIQUE).map(|id| 100 + id).sum::<i64>());
                // A call cut off by the deadline after its commit went through is
                // redelivered and answered as a duplicate, so its `Processed` is never
                // seen: at most one each.
                assert!(processed.load(Ordering::SeqCst) <= UNIQUE as usize);
                let sql = format!("SELECT count(*) FROM {} WHERE state = 'D'", bank.records);
                let done: i64 = sqlx::query_scalar(AssertSqlSafe(sql))
                    .fetch_one(bank.store.pool())
                    .await
                    .unwrap();
                assert_eq!(done, UNIQUE);
                assert!(redelivered.load(Ordering::SeqCst) > 0, "faults were injected");
                bank.drop_tables().await;
            }

            $($extra)*
        }
    };
}

transactional_tests!(postgresql, pg, {
    use idempotent::postgres_store::LOCK_TIMEOUT;

    // Each failed commit counts an attempt, as a handler's error would; without that, a
    // commit that fails every time would be retried for ever.
    in_both_claim_modes!(a_commit_that_always_fails_ends_abandoned_after_max_attempts);
    async fn a_commit_that_always_fails_ends_abandoned_after_max_attempts(
        claim: TransactionalClaim,
    ) {
        let Some(bank) = Bank::open_with(5, claim).await else { return };
        let msg = debit_of(12);
        bank.script(&[Fault::FailCommit; 40]);
        for attempt in 1..=25 {
            let err = debit(&msg, &bank).await.unwrap_err();
            assert!(
                matches!(err, Error::Store { handler_ran: false, .. }),
                "attempt {attempt}: {err:?}"
            );
            assert_eq!(bank.rows(12).await, 0);
        }
        let err = debit(&msg, &bank).await.unwrap_err();
        assert!(matches!(err, Error::Abandoned { attempts: 25 }), "{err:?}");
        assert_eq!((bank.rows(12).await, bank.state(12).await.as_deref()), (0, Some("F")));
        bank.drop_tables().await;
    }

    /// With the claim taken inside the handler's transaction, nothing about the
    /// message is committed before DONE, and a duplicate delivered meanwhile is
    /// answered `InProgress` at once rather than waiting on the uncommitted record.
    /// (MySQL's duplicate waits for its lock wait timeout instead.)
    #[tokio::test]
    async fn a_claim_in_the_transaction_commits_nothing_before_done_and_turns_duplicates_away() {
        let Some(bank) = Bank::open_with(5, TransactionalClaim::InTransaction).await else {
            return;
        };
        let msg = debit_of(8);
        bank.script(&[Fault::Hang]);
        {
            let call = debit(&msg, &bank);
            tokio::pin!(call);
            tokio::select! {
                out = &mut call => panic!("the hanging run returned {out:?}"),
                () = bank.reached.notified() => {}
            }
            assert_eq!(bank.state(8).await, None, "the claim is not committed on its own");
            let started = std::time::Instant::now();
            let duplicate = tokio::time::timeout(Duration::from_secs(10), debit(&msg, &bank)).await;
            assert!(matches!(
                duplicate.expect("the duplicate waited").unwrap(),
                Outcome::InProgress { .. }
            ));
            assert!(started.elapsed() < LOCK_TIMEOUT / 2, "{:?}", started.elapsed());
        }
        assert_eq!((bank.rows(8).await, bank.state(8).await), (0, None));
        assert_eq!(deliver_until_settled(&bank, &msg).await.unwrap(), Outcome::Processed(108));
        assert_eq!(bank.state(8).await.as_deref(), Some("D"));
        assert_eq!(debit(&msg, &bank).await.unwrap(), Outcome::Replayed(108));
        assert_eq!(bank.rows(8).await, 1);
        bank.drop_tables().await;
    }

    /// Two stores naming one records table differently (`records`, `public.records`),
    /// as two services configured apart would: a duplicate through the other name is
    /// answered `InProgress` at once too, not left waiting on the uncommitted record.
    #[tokio::test]
    async fn a_claim_in_the_transaction_turns_duplicates_away_under_any_spelling_of_the_table() {
        let Some(bank) = Bank::open_with(5, TransactionalClaim::InTransaction).await else {
            return;
        };
        let qualified = format!("public.{}", bank.records);
        let store = Store::from_pool(bank.store.pool().clone()).with_table(&qualified).unwrap();
        let store = store.with_transactional_claim(TransactionalClaim::InTransaction);
        let other = Bank::on(store, qualified, bank.ledger.clone());
        let msg = debit_of(9);
        bank.script(&[Fault::Hang]);
        {
            let call = debit(&msg, &bank);
            tokio::pin!(call);
            tokio::select! {
                out = &mut call => panic!("the hanging run returned {out:?}"),
                () = bank.reached.notified() => {}
            }
            let started = std::time::Instant::now();
            let duplicate =
                tokio::time::timeout(Duration::from_secs(10), debit(&msg, &other)).await;
            assert!(matches!(
                duplicate.expect("the duplicate waited").unwrap(),
                Outcome::InProgress { .. }
            ));
            assert!(started.elapsed() < LOCK_TIMEOUT / 2, "{:?}", started.elapsed());
        }
        assert_eq!(deliver_until_settled(&other, &msg).await.unwrap(), Outcome::Processed(109));
        assert_eq!(debit(&msg, &bank).await.unwrap(), Outcome::Replayed(109));
        assert_eq!(bank.rows(9).await, 1);
        bank.drop_tables().await;
    }

    /// A store kept in a `static LazyLock`, as an application keeps one it builds once.
    static LAZY_STORE: std::sync::LazyLock<Store> = std::sync::LazyLock::new(|| {
        let url = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let pool = sqlx::postgres::PgPoolOptions::new().connect_lazy(&url);
        Store::from_pool(pool.expect("DATABASE_URL is a PostgreSQL URL"))
    });

    /// Answers its id from inside the transaction it records DONE in.
    #[idempotent(key = "lazy:{id}", store = LAZY_STORE, transactional)]
    async fn echo_in_lazy_store(
        msg: &Debit,
        tx: &mut Transaction<'_, Db>,
    ) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar("SELECT $1::bigint").bind(msg.id).fetch_one(&mut **tx).await
    }

    #[tokio::test]
    async fn a_store_in_a_lazy_lock_records_in_the_handlers_transaction() {
        if sql::pool(1).await.is_none() {
            return;
        }
        LAZY_STORE.migrate().await.unwrap();
        // A fresh id: the records table is the shared default one.
        let fresh = idempotent::testing::fresh_key("lazy");
        let id = i64::from_str_radix(fresh.namespace().rsplit('-').next().unwrap(), 16).unwrap();
        let msg = debit_of(id);
        assert_eq!(echo_in_lazy_store(&msg).await.unwrap(), Outcome::Processed(id));
        assert_eq!(echo_in_lazy_store(&msg).await.unwrap(), Outcome::Duplicate);
    }
});

transactional_tests!(mysql_or_mariadb, my, {});
