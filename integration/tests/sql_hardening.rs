//! `PostgresStore`, `MysqlStore` and the transactional mode under the conditions
//! users' databases have: handlers longer than the dedupe window, snapshot isolation
//! as the default (PostgreSQL's REPEATABLE READ, MariaDB's strict snapshots), a pool
//! smaller than the handlers in flight, a session `after_connect` sets, a records table
//! nobody made, a record row left locked by a dead consumer, keys too long for an
//! index. The tests both databases share run on each through `hardening_tests!`;
//! what differs (SQL spelling, how a session is set) is in `pg` and `my`, and what only
//! one database has is in the tests each passes to the macro. Each test has its own
//! tables.

use std::time::Duration;

#[path = "support/mysql.rs"]
mod mysql;
#[path = "support/postgres.rs"]
mod postgres;
#[path = "support/sql_dialect.rs"]
mod sql_dialect;

use idempotent::{Claim, Classify, Error, Key, Outcome, Store, idempotent};
use sqlx::{AssertSqlSafe, Transaction};

#[derive(Debug, thiserror::Error, Classify)]
enum LedgerError {
    #[error("database: {0}")]
    #[idempotent(transparent)]
    Db(#[from] sqlx::Error),
}

/// PostgreSQL's side of the tests.
mod pg {
    pub use super::sql_dialect::pg::*;
    use sqlx::{AssertSqlSafe, Executor};

    /// A pool whose sessions default to REPEATABLE READ: lease renewals from other
    /// connections would make a DONE update in such a snapshot fail with 40001.
    pub async fn snapshot_pool(connections: u32) -> Option<Pool> {
        let settings = [("default_transaction_isolation", "repeatable read")];
        super::postgres::pool_with(connections, &settings).await
    }

    pub fn create_ledger(ledger: &str) -> String {
        format!("CREATE TABLE {ledger} (message_id bigint NOT NULL)")
    }

    pub fn insert(ledger: &str) -> String {
        format!("INSERT INTO {ledger} (message_id) VALUES ($1)")
    }

    /// The store's own table definition with its primary key left out, as a
    /// migration tool of the user's might write it.
    pub fn without_its_key(migration: &str) -> String {
        migration.replace("key bytea PRIMARY KEY", "key bytea NOT NULL")
    }

    pub fn lock_record(records: &str) -> String {
        format!("SELECT 1 FROM {records} WHERE key = $1 FOR UPDATE")
    }

    /// How long the store's statements wait for a row lock, if it can bound that.
    pub async fn lock_timeout(_: &Pool) -> Option<std::time::Duration> {
        Some(idempotent::postgres_store::LOCK_TIMEOUT)
    }

    /// A schema of its own, and pools of one and of two connections whose
    /// `after_connect` sets the `search_path` to it (sqlx's own example of the hook).
    pub async fn pools_set_to_a_namespace() -> Option<(Pool, String, Pool, Pool)> {
        let admin = pool(2).await?;
        let schema = super::mysql::table("sp");
        sqlx::query(AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
            .execute(&admin)
            .await
            .unwrap();
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
        Some((admin, schema, one, other))
    }

    pub async fn drop_namespace(admin: &Pool, schema: &str) {
        let sql = format!("DROP SCHEMA {schema} CASCADE");
        sqlx::query(AssertSqlSafe(sql)).execute(admin).await.unwrap();
    }
}

/// MySQL's and MariaDB's side of the tests.
mod my {
    pub use super::sql_dialect::my::*;
    use sqlx::AssertSqlSafe;

    /// A pool whose sessions keep REPEATABLE READ snapshots strictly: MariaDB's
    /// `innodb_snapshot_isolation` (10.6.18+, on by default from 11.8) makes a locking
    /// read of a row changed since the snapshot fail (error 1020). Plain REPEATABLE
    /// READ on a server without it.
    pub async fn snapshot_pool(connections: u32) -> Option<Pool> {
        super::mysql::pool_with(connections, &strict_snapshots().await?).await
    }

    pub async fn strict_snapshots() -> Option<Vec<&'static str>> {
        let pool = pool(1).await?;
        let known = sqlx::query("SELECT @@innodb_snapshot_isolation").execute(&pool).await.is_ok();
        let mut settings = vec!["SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ"];
        if known {
            settings.push("SET SESSION innodb_snapshot_isolation = ON");
        } else {
            eprintln!("no innodb_snapshot_isolation on this server: plain REPEATABLE READ");
        }
        Some(settings)
    }

    pub fn create_ledger(ledger: &str) -> String {
        format!("CREATE TABLE {ledger} (message_id bigint NOT NULL, KEY (message_id))")
    }

    pub fn insert(ledger: &str) -> String {
        format!("INSERT INTO {ledger} (message_id) VALUES (?)")
    }

    /// The store's own table definition with its primary key left out, as a
    /// migration tool of the user's might write it.
    pub fn without_its_key(migration: &str) -> String {
        migration.replace("PRIMARY KEY (`key`),", "")
    }

    pub fn lock_record(records: &str) -> String {
        format!("SELECT 1 FROM {records} WHERE `key` = ? FOR UPDATE")
    }

    /// How long the store's statements wait for a row lock, if it can bound that:
    /// MariaDB only (MySQL 8 has no per-statement lock wait).
    pub async fn lock_timeout(pool: &Pool) -> Option<std::time::Duration> {
        let version: String = sqlx::query_scalar("SELECT VERSION()").fetch_one(pool).await.unwrap();
        if !version.contains("MariaDB") {
            eprintln!("MySQL {version} can't bound a lock wait per statement");
            return None;
        }
        Some(idempotent::mysql_store::LOCK_TIMEOUT)
    }

    /// A database of its own, and pools of one and of two connections whose
    /// `after_connect` chooses it (`USE`).
    pub async fn pools_set_to_a_namespace() -> Option<(Pool, String, Pool, Pool)> {
        let admin = pool(1).await?;
        let database = super::mysql::table("sv");
        let sql = format!("CREATE DATABASE {database}");
        sqlx::query(AssertSqlSafe(sql)).execute(&admin).await.unwrap();
        let session: &'static str = Box::leak(format!("USE {database}").into_boxed_str());
        let one = super::mysql::pool_with(1, &[session]).await.unwrap();
        let other = super::mysql::pool_with(2, &[session]).await.unwrap();
        Some((admin, database, one, other))
    }

    pub async fn drop_namespace(admin: &Pool, database: &str) {
        let sql = format!("DROP DATABASE {database}");
        sqlx::query(AssertSqlSafe(sql)).execute(admin).await.unwrap();
    }
}

/// The tests for one database: `$sql` is its module above; `$extra` are tests only
/// that database can run, expanded beside the others (they see `Ledger` and
/// `slow_write`).
macro_rules! hardening_tests {
    ($name:ident, $sql:ident, { $($extra:item)* }) => {
        mod $name {
            use super::*;
            use super::$sql as sql;
            use sql::{Db, Pool};

            /// A store with its own records table and a ledger table without unique
            /// constraint: a message applied twice shows as two rows.
            struct Ledger {
                store: sql::Store,
                records: String,
                ledger: String,
            }

            impl Ledger {
                async fn open(pool: Pool) -> Ledger {
                    let records = mysql::table("records");
                    let ledger = records.replacen("records", "ledger", 1);
                    Ledger::on(pool, records, ledger).await
                }

                /// A store on `pool` in the table `records` it makes, and the
                /// `ledger` table.
                async fn on(pool: Pool, records: String, ledger: String) -> Ledger {
                    let store = sql::Store::from_pool(pool).with_table(&records).unwrap();
                    store.migrate().await.unwrap();
                    sqlx::query(AssertSqlSafe(sql::create_ledger(&ledger)))
                        .execute(store.pool())
                        .await
                        .unwrap();
                    Ledger { store, records, ledger }
                }

                /// The same tables through another pool: another consumer process.
                fn other_consumer(&self, pool: Pool) -> Ledger {
                    let store = sql::Store::from_pool(pool).with_table(&self.records).unwrap();
                    Ledger { store, records: self.records.clone(), ledger: self.ledger.clone() }
                }

                async fn rows(&self, id: i64) -> i64 {
                    sqlx::query_scalar(AssertSqlSafe(sql::count_rows(&self.ledger)))
                        .bind(id)
                        .fetch_one(self.store.pool())
                        .await
                        .unwrap()
                }

                async fn write(
                    &self,
                    id: i64,
                    tx: &mut Transaction<'_, Db>,
                ) -> Result<(), sqlx::Error> {
                    sqlx::query(AssertSqlSafe(sql::insert(&self.ledger)))
                        .bind(id)
                        .execute(&mut **tx)
                        .await
                        .map(drop)
                }

                /// A consistent read of the records table: under REPEATABLE READ it
                /// fixes the transaction's snapshot.
                async fn read_records(
                    &self,
                    tx: &mut Transaction<'_, Db>,
                ) -> Result<i64, sqlx::Error> {
                    let sql = format!("SELECT count(*) FROM {}", self.records);
                    sqlx::query_scalar(AssertSqlSafe(sql)).fetch_one(&mut **tx).await
                }

                async fn drop_tables(&self) {
                    sql::drop_tables(self.store.pool(), &[&self.records, &self.ledger]).await;
                }
            }

            /// Reads the records table (fixing a snapshot), writes one ledger row, then
            /// takes `hold` (the handler's own work).
            #[idempotent(
                key = "{id}",
                store = ledger.store,
                transactional,
                ttl = "1s",
                lease = "300ms",
                namespace = "slow"
            )]
            async fn slow_write(
                id: i64,
                hold: Duration,
                ledger: &Ledger,
                tx: &mut Transaction<'_, Db>,
            ) -> Result<(), LedgerError> {
                ledger.read_records(tx).await?;
                ledger.write(id, tx).await?;
                tokio::time::sleep(hold).await;
                Ok(())
            }

            /// A handler that runs longer than `ttl` commits a DONE record that is
            /// still alive: its expiry is counted from the DONE statement, not from the
            /// transaction's start.
            #[tokio::test]
            async fn done_is_kept_for_ttl_after_a_handler_longer_than_ttl() {
                let Some(pool) = sql::pool(4).await else { return };
                let ledger = Ledger::open(pool).await;
                let ran = slow_write(1, Duration::from_millis(1500), &ledger).await.unwrap();
                assert_eq!(ran, Outcome::Processed(()));
                let again = slow_write(1, Duration::ZERO, &ledger).await.unwrap();
                assert_eq!(again, Outcome::Duplicate, "the DONE record was born expired");
                assert_eq!(ledger.rows(1).await, 1);
                ledger.drop_tables().await;
            }

            /// With snapshot isolation as the sessions' default, lease renewals from
            /// other connections change the record after the handler's snapshot: the
            /// DONE update must still see it as it is.
            #[tokio::test]
            async fn renewals_after_the_handlers_snapshot_do_not_refuse_done() {
                let Some(pool) = sql::snapshot_pool(4).await else { return };
                let ledger = Ledger::open(pool).await;
                // 700 ms with a 300 ms lease: renewed twice after the snapshot was taken.
                let ran = slow_write(2, Duration::from_millis(700), &ledger).await;
                assert!(matches!(ran, Ok(Outcome::Processed(()))), "{ran:?}");
                assert_eq!(ledger.rows(2).await, 1);
                ledger.drop_tables().await;
            }

            /// Reads the records table (fixing a snapshot), writes one ledger row, then
            /// hands the record's claim to another token from another connection, as a
            /// consumer that took over an expired lease would. The lease is long: no
            /// renewal notices the takeover before the DONE update does.
            #[idempotent(key = "{id}", store = ledger.store, transactional, namespace = "taken")]
            async fn taken_over_write(
                id: i64,
                ledger: &Ledger,
                tx: &mut Transaction<'_, Db>,
            ) -> Result<(), LedgerError> {
                ledger.read_records(tx).await?;
                ledger.write(id, tx).await?;
                let key = Key::new("taken", id.to_string()).unwrap();
                sqlx::query(AssertSqlSafe(sql::steal_claim(&ledger.records)))
                    .bind(key.as_bytes())
                    .execute(ledger.store.pool())
                    .await?;
                Ok(())
            }

            /// A consumer that took the key over after the handler's snapshot was
            /// taken is seen by the DONE update, which finds the token changed: the
            /// call is `LeaseLost` and the business row rolls back, with snapshot
            /// isolation as the sessions' default.
            #[tokio::test]
            async fn a_takeover_after_the_handlers_snapshot_is_seen_by_done() {
                let Some(pool) = sql::snapshot_pool(4).await else { return };
                let ledger = Ledger::open(pool).await;
                let ran = taken_over_write(3, &ledger).await;
                assert!(matches!(ran, Err(Error::LeaseLost { attempt: 1, .. })), "{ran:?}");
                assert_eq!(ledger.rows(3).await, 0);
                ledger.drop_tables().await;
            }

            /// A pool whose only connection is held by the handler's transaction: the
            /// lease is still renewed, so another consumer finds the key in progress,
            /// not free.
            #[tokio::test]
            async fn a_full_pool_does_not_let_the_lease_lapse() {
                let (Some(one), Some(other)) = (sql::pool(1).await, sql::pool(2).await) else {
                    return;
                };
                let ledger = Ledger::open(one).await;
                let rival = ledger.other_consumer(other);
                let running = slow_write(4, Duration::from_millis(1200), &ledger);
                let probe = async {
                    // Three leases after the claim: without renewal it would have lapsed.
                    tokio::time::sleep(Duration::from_millis(900)).await;
                    slow_write(4, Duration::ZERO, &rival).await
                };
                let (ran, probed) = tokio::join!(running, probe);
                assert!(matches!(ran, Ok(Outcome::Processed(()))), "{ran:?}");
                assert!(
                    matches!(probed, Ok(Outcome::InProgress { .. })),
                    "the lease lapsed: {probed:?}"
                );
                assert_eq!(ledger.rows(4).await, 1);
                rival.drop_tables().await;
            }

            /// A pool whose `after_connect` sets the session to the schema or database
            /// the records table is in, named without it: lease renewals run on
            /// connections of their own, which must get the same session, or every
            /// renewal misses the table, the lease lapses mid-handler and another
            /// consumer runs the message again.
            #[tokio::test]
            async fn renewals_get_the_session_after_connect_sets() {
                let Some((admin, namespace, one, other)) = sql::pools_set_to_a_namespace().await
                else {
                    return;
                };
                let ledger = Ledger::on(one, "records".into(), "ledger".into()).await;
                let rival = ledger.other_consumer(other);
                let running = slow_write(5, Duration::from_millis(1200), &ledger);
                let probe = async {
                    tokio::time::sleep(Duration::from_millis(900)).await;
                    slow_write(5, Duration::ZERO, &rival).await
                };
                let (ran, probed) = tokio::join!(running, probe);
                assert!(matches!(ran, Ok(Outcome::Processed(()))), "{ran:?}");
                assert!(
                    matches!(probed, Ok(Outcome::InProgress { .. })),
                    "the lease lapsed: {probed:?}"
                );
                assert_eq!(ledger.rows(5).await, 1);
                sql::drop_namespace(&admin, &namespace).await;
            }

            /// A records table nobody made (`migrate()` forgotten, `with_table`
            /// mistyped): `check` and every claim answer `Misconfigured`, naming
            /// `migrate()`, so the call is retried, never dead-lettered, and says what
            /// to do instead of "store unavailable".
            #[tokio::test]
            async fn a_missing_records_table_says_to_run_migrate() {
                let Some(pool) = sql::pool(2).await else { return };
                let table = mysql::table("never_made");
                let store = sql::Store::from_pool(pool).with_table(&table).unwrap();
                use idempotent::StoreError;
                let misconfigured = |e: &StoreError| {
                    matches!(e, StoreError::Misconfigured(why) if why.contains("migrate()"))
                };
                let checked = store.check().await.unwrap_err();
                assert!(misconfigured(&checked), "{checked}");
                let key = Key::new("missing", "1").unwrap();
                let claimed =
                    store.claim(&key, Duration::from_secs(5), Duration::from_secs(60), None).await;
                let err = claimed.unwrap_err();
                assert!(misconfigured(&err), "{err}");
            }

            /// A record row locked by a consumer that died between its DONE update
            /// and COMMIT (its connection holds the lock until TCP gives up): a
            /// duplicate's claim answers InProgress after the store's lock timeout
            /// instead of blocking for the server's (MySQL's 50 s).
            #[tokio::test]
            async fn a_locked_record_answers_in_progress() {
                let Some(pool) = sql::pool(4).await else { return };
                let ledger = Ledger::open(pool).await;
                let Some(lock_timeout) = sql::lock_timeout(ledger.store.pool()).await else {
                    return ledger.drop_tables().await;
                };
                let key = Key::new("locked", "7").unwrap();
                let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(60));
                let claimed = ledger.store.claim(&key, lease, ttl, None).await.unwrap();
                assert!(matches!(claimed, Claim::Won { .. }), "fresh key: {claimed:?}");
                let mut stuck = ledger.store.pool().begin().await.unwrap();
                sqlx::query(AssertSqlSafe(sql::lock_record(&ledger.records)))
                    .bind(key.as_bytes())
                    .execute(&mut *stuck)
                    .await
                    .unwrap();
                // A lease that has run out: the claim would take the row over if it
                // could lock it.
                let started = std::time::Instant::now();
                let claim = tokio::time::timeout(
                    Duration::from_secs(20),
                    ledger.store.claim(&key, Duration::from_millis(50), ttl, None),
                )
                .await
                .expect("the claim blocked on the locked row");
                assert!(matches!(claim.unwrap(), Claim::InProgress { .. }));
                let waited = started.elapsed();
                assert!(waited >= lock_timeout / 2, "{waited:?}");
                assert!(waited < Duration::from_secs(10), "{waited:?}");
                stuck.rollback().await.unwrap();
                ledger.drop_tables().await;
            }

            /// A records table made without its primary key on `key` (every column
            /// there): `check` refuses it, naming the key, where claims would
            /// otherwise each win (MySQL: every duplicate runs again) or each fail
            /// (PostgreSQL: retried for ever).
            #[tokio::test]
            async fn a_records_table_without_its_key_is_refused() {
                let Some(pool) = sql::pool(2).await else { return };
                let table = mysql::table("keyless");
                let store = sql::Store::from_pool(pool).with_table(&table).unwrap();
                let made = sql::without_its_key(&store.migration_sql());
                assert_ne!(made, store.migration_sql(), "the key was left in");
                sqlx::raw_sql(AssertSqlSafe(made)).execute(store.pool()).await.unwrap();
                let checked = store.check().await.unwrap_err();
                assert!(
                    matches!(&checked, idempotent::StoreError::Misconfigured(why)
                        if why.contains("unique index on") && why.contains(&table)),
                    "{checked}"
                );
                sql::drop_tables(store.pool(), &[&table]).await;
                // The table as `migrate()` makes it passes.
                store.migrate().await.unwrap();
                store.check().await.unwrap();
                sql::drop_tables(store.pool(), &[&table]).await;
            }

            $($extra)*
        }
    };
}

hardening_tests!(postgresql, pg, {
    /// A key too long for a btree index entry, which a producer can send on purpose,
    /// is stored under its hash, and is deduplicated like any other.
    #[tokio::test]
    async fn keys_too_long_for_an_index_are_stored_hashed() {
        let Some(pool) = sql::pool(4).await else { return };
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
        let Claim::Won { token, .. } = ledger.store.claim(&key, lease, ttl, None).await.unwrap()
        else {
            panic!("fresh key");
        };
        let done = ledger.store.complete(&key, token, ttl, None).await.unwrap();
        assert_eq!(done, idempotent::Transition::Applied);
        assert_eq!(ledger.store.claim(&key, lease, ttl, None).await.unwrap(), Claim::Done);
        let sibling = Key::new("long", format!("{noise}!")).unwrap();
        let claimed = ledger.store.claim(&sibling, lease, ttl, None).await;
        assert!(matches!(claimed, Ok(Claim::Won { .. })), "{claimed:?}");
        ledger.drop_tables().await;
    }

    /// `migrate()` dropped at any moment (a start-up `timeout`, a `select!`), on a
    /// pool of one connection: that connection is never pooled inside a transaction,
    /// so every claim made on it afterwards is committed and seen by another
    /// connection.
    #[tokio::test]
    async fn migrate_dropped_midway_leaves_no_connection_inside_a_transaction() {
        let (Some(one), Some(other)) = (sql::pool(1).await, sql::pool(1).await) else {
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
            assert!(matches!(
                store.claim(&key, lease, ttl, None).await.unwrap(),
                Claim::Won { .. }
            ));
        }
        let sql = format!("SELECT count(*) FROM {} WHERE state = 'P'", ledger.records);
        let seen: i64 = sqlx::query_scalar(AssertSqlSafe(sql)).fetch_one(&other).await.unwrap();
        assert_eq!(seen, 200, "claims made on a connection left inside a transaction");
        ledger.drop_tables().await;
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

    /// A transactional handler that idles inside its transaction past the database's
    /// `idle_in_transaction_session_timeout` (which the README recommends) has its
    /// session ended by the server (25P03): retried, not dead-lettered on its first
    /// attempt, and the redelivery writes once.
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
            tx: &mut Transaction<'_, Db>,
        ) -> Result<(), LedgerError> {
            ledger.write(id, tx).await?;
            tokio::time::sleep(idle).await;
            ledger.write(id, tx).await?;
            Ok(())
        }
        let first = idle_then_write(6, Duration::from_millis(800), &ledger).await;
        let err = first.unwrap_err();
        assert!(err.is_retryable(), "dead-lettered: {err:?}");
        let again = idle_then_write(6, Duration::ZERO, &ledger).await;
        assert!(matches!(again, Ok(Outcome::Processed(()))), "{again:?}");
        assert_eq!(ledger.rows(6).await, 2, "the redelivery's two rows, none of the first");
        ledger.drop_tables().await;
    }
});

hardening_tests!(mysql_or_mariadb, my, {
    use std::sync::Arc;

    use tokio::sync::Barrier;

    /// Writes the message's ledger row unless a locking read finds it, the usual
    /// hand-written guard; `meet` holds both handlers between the read and the write.
    #[idempotent(key = "{id}", store = ledger.store, transactional, namespace = "guard")]
    async fn guarded_write(
        id: i64,
        meet: Arc<Barrier>,
        ledger: &Ledger,
        tx: &mut Transaction<'_, Db>,
    ) -> Result<(), LedgerError> {
        let sql =
            format!("SELECT message_id FROM {} WHERE message_id = ? FOR UPDATE", ledger.ledger);
        let found: Option<i64> =
            sqlx::query_scalar(AssertSqlSafe(sql)).bind(id).fetch_optional(&mut **tx).await?;
        meet.wait().await;
        if found.is_none() {
            ledger.write(id, tx).await?;
        }
        Ok(())
    }

    /// Two handlers for neighbouring messages, each reading its (missing) ledger row
    /// with a locking read before writing it: at REPEATABLE READ each read locks the
    /// same gap and each insert waits on the other's, a deadlock; at READ COMMITTED,
    /// where the handlers' transactions run, there are no gap locks and both go
    /// through.
    #[tokio::test]
    async fn gap_locks_do_not_deadlock_neighbouring_handlers() {
        let settings = ["SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ"];
        let Some(pool) = mysql::pool_with(6, &settings).await else { return };
        let ledger = Ledger::open(pool).await;
        // Rows on either side, so that both ids fall into one gap.
        for id in [10, 20] {
            sqlx::query(AssertSqlSafe(sql::insert(&ledger.ledger)))
                .bind(id)
                .execute(ledger.store.pool())
                .await
                .unwrap();
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

    /// A claim that waits for another transaction's uncommitted DONE answers from the
    /// committed record, under REPEATABLE READ with strict snapshots: `Done`, not a
    /// stale `InProgress` nor a second win.
    #[tokio::test]
    async fn a_claim_waiting_on_a_commit_reads_the_committed_record() {
        let Some(pool) = sql::snapshot_pool(4).await else { return };
        let ledger = Ledger::open(pool).await;
        let key = Key::new("waiting", "9").unwrap();
        let (lease, ttl) = (Duration::from_millis(200), Duration::from_secs(60));
        let Claim::Won { token, .. } = ledger.store.claim(&key, lease, ttl, None).await.unwrap()
        else {
            panic!("fresh key");
        };
        // The lease lapses: a claim that read a stale record would take the key over.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut done = ledger.store.pool().begin().await.unwrap();
        let sql = format!(
            "UPDATE {} SET state = 'D', token = NULL, \
             expires_at = UTC_TIMESTAMP(6) + INTERVAL 60 SECOND WHERE `key` = ? AND token = ?",
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

    /// A pool whose sessions are not in autocommit mode (the server's `autocommit=0`,
    /// `init_connect`, or an `after_connect` like this one) would leave every claim
    /// and DONE uncommitted, rolled back when the connection goes, and the handler
    /// would run again at each redelivery: `check_server` refuses it.
    #[tokio::test]
    async fn a_pool_without_autocommit_is_refused() {
        let Some(pool) = mysql::pool_with(1, &["SET autocommit = 0"]).await else { return };
        let store = sql::Store::from_pool(pool);
        let refused = store.check_server().await.unwrap_err();
        assert!(
            matches!(&refused, idempotent::StoreError::Misconfigured(why) if why.contains("autocommit")),
            "{refused}"
        );
    }

    /// `check_server` passes on the machine's server, and `check` then finds the
    /// missing table: the server's settings and the table are told apart.
    #[tokio::test]
    async fn the_server_check_passes_where_the_table_check_fails() {
        let Some(pool) = sql::pool(2).await else { return };
        let store = sql::Store::from_pool(pool).with_table(&mysql::table("never_made")).unwrap();
        store.check_server().await.unwrap();
        assert!(store.check().await.is_err());
    }
});
