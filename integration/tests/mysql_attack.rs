//! `MysqlStore` under races and session settings that could split a claim's verdict
//! from what it wrote: concurrent claims on a fresh key, `LAST_INSERT_ID` left set by
//! earlier statements on the same connection, MariaDB's `SIMULTANEOUS_ASSIGNMENT`, a
//! purge racing claims of the rows it would delete, a takeover racing the old owner's
//! DONE, and a transactional handler that finds its effect already applied. Each test
//! has its own tables.

use std::sync::Arc;
use std::time::Duration;

#[path = "support/mysql.rs"]
mod mysql;

use idempotent::{Claim, Classify, Key, MysqlStore, Outcome, Store, Transition, idempotent};
use sqlx::{AssertSqlSafe, MySql, MySqlPool, Transaction};

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(60);

async fn store_on(pool: MySqlPool) -> MysqlStore {
    let store = MysqlStore::from_pool(pool).with_table(&mysql::table("attack")).unwrap();
    store.migrate().await.unwrap();
    store
}

fn table_of(store: &MysqlStore) -> String {
    // `MysqlStore`'s Debug prints the table name.
    let debug = format!("{store:?}");
    debug.split('"').nth(1).unwrap().to_owned()
}

async fn drop_store(store: &MysqlStore) {
    mysql::drop_tables(store.pool(), &[&table_of(store)]).await;
}

async fn won(store: &MysqlStore, key: &Key, lease: Duration, ttl: Duration) -> idempotent::Token {
    match store.claim(key, lease, ttl, None).await.unwrap() {
        Claim::Won { token, .. } => token,
        other => panic!("{key} was not won: {other:?}"),
    }
}

/// The record's state letter, if there is one.
async fn state(store: &MysqlStore, key: &Key) -> Option<String> {
    let sql = format!(
        "SELECT CAST(state AS CHAR) FROM {} WHERE `key` = ? AND expires_at > UTC_TIMESTAMP(6)",
        table_of(store)
    );
    sqlx::query_scalar(AssertSqlSafe(sql))
        .bind(key.stored().as_ref())
        .fetch_optional(store.pool())
        .await
        .unwrap()
}

/// MariaDB's `SIMULTANEOUS_ASSIGNMENT` SQL mode (10.3.5+) makes every assignment of an
/// `UPDATE` (and of `ON DUPLICATE KEY UPDATE`) read the row as it was before the
/// statement. A server or pool that has it on must not let one claim's takeover
/// leave the record claimable by the next: a released key, once taken, is in
/// progress; an expired DONE key, once taken, can be completed.
#[tokio::test]
async fn simultaneous_assignment_does_not_let_two_consumers_win() {
    let probe = match mysql::pool(1).await {
        Some(pool) => pool,
        None => return,
    };
    let mode = "SET SESSION sql_mode = CONCAT(@@sql_mode, ',SIMULTANEOUS_ASSIGNMENT')";
    if sqlx::query(mode).execute(&probe).await.is_err() {
        eprintln!("skipped: this server has no SIMULTANEOUS_ASSIGNMENT mode");
        return;
    }
    let Some(pool) = mysql::pool_with(4, &[mode]).await else { return };
    let store = store_on(pool).await;

    // Released, then taken: the taker holds it.
    let key = Key::new("simultaneous", "released").unwrap();
    let first = won(&store, &key, LEASE, TTL).await;
    assert_eq!(store.release(&key, first).await.unwrap(), Transition::Applied);
    let second = won(&store, &key, LEASE, TTL).await;
    assert_eq!(state(&store, &key).await.as_deref(), Some("P"), "the takeover left the record");
    assert!(
        matches!(store.claim(&key, LEASE, TTL, None).await.unwrap(), Claim::InProgress { .. }),
        "a second consumer won a key in progress"
    );
    assert_eq!(store.complete(&key, second, TTL, None).await.unwrap(), Transition::Applied);

    // DONE and expired, then taken again: the new owner's DONE is recorded.
    let key = Key::new("simultaneous", "expired").unwrap();
    let first = won(&store, &key, LEASE, TTL).await;
    let short = Duration::from_millis(50);
    assert_eq!(store.complete(&key, first, short, None).await.unwrap(), Transition::Applied);
    tokio::time::sleep(Duration::from_millis(150)).await;
    let again = won(&store, &key, LEASE, TTL).await;
    assert_eq!(
        store.complete(&key, again, TTL, None).await.unwrap(),
        Transition::Applied,
        "the new owner's DONE was refused: the handler will run again"
    );
    assert_eq!(store.claim(&key, LEASE, TTL, None).await.unwrap(), Claim::Done);
    drop_store(&store).await;
}

/// Many consumers claim the same fresh keys at once: exactly one wins each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claims_on_a_fresh_key_have_one_winner() {
    let Some(pool) = mysql::pool(16).await else { return };
    let store = Arc::new(store_on(pool).await);
    for round in 0..20 {
        let key = Key::new("fresh", round.to_string()).unwrap();
        let claims = (0..16).map(|_| {
            let (store, key) = (store.clone(), key.clone());
            tokio::spawn(async move { store.claim(&key, LEASE, TTL, None).await.unwrap() })
        });
        let mut winners = 0;
        for claim in futures_util::future::join_all(claims).await {
            match claim.unwrap() {
                Claim::Won { attempt, .. } => {
                    assert_eq!(attempt, 1);
                    winners += 1;
                }
                Claim::InProgress { .. } => {}
                other => panic!("{key}: {other:?}"),
            }
        }
        assert_eq!(winners, 1, "{key}");
    }
    drop_store(&store).await;
}

/// The claim's verdict travels in the OK packet's last insert id: a value left by
/// earlier statements on the same connection (an `AUTO_INCREMENT` insert, an explicit
/// `LAST_INSERT_ID(expr)`) must not be read as a verdict.
#[tokio::test]
async fn an_earlier_last_insert_id_on_the_connection_is_no_verdict() {
    let Some(pool) = mysql::pool(1).await else { return };
    let store = store_on(pool).await;
    let counter = table_of(&store).replacen("attack", "counter", 1);
    let create =
        format!("CREATE TABLE {counter} (id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, x INT)");
    sqlx::query(AssertSqlSafe(create)).execute(store.pool()).await.unwrap();
    let insert = format!("INSERT INTO {counter} (x) VALUES (1)");
    // Values that read as each verdict, and a plain id.
    let leftovers: [u64; 6] = [1 << 33 | 1, 2 << 33, 2 << 33 | 1 << 32, 4 << 33, 5 << 33, 0];
    for (i, leftover) in leftovers.into_iter().enumerate() {
        let key = Key::new("leftover", i.to_string()).unwrap();
        if leftover == 0 {
            sqlx::query(AssertSqlSafe(insert.clone())).execute(store.pool()).await.unwrap();
        } else {
            sqlx::query("SELECT LAST_INSERT_ID(?)")
                .bind(leftover)
                .execute(store.pool())
                .await
                .unwrap();
        }
        let token = won(&store, &key, LEASE, TTL).await;
        sqlx::query(AssertSqlSafe(insert.clone())).execute(store.pool()).await.unwrap();
        assert!(matches!(
            store.claim(&key, LEASE, TTL, None).await.unwrap(),
            Claim::InProgress { .. }
        ));
        assert_eq!(store.complete(&key, token, TTL, None).await.unwrap(), Transition::Applied);
        sqlx::query(AssertSqlSafe(insert.clone())).execute(store.pool()).await.unwrap();
        assert_eq!(store.claim(&key, LEASE, TTL, None).await.unwrap(), Claim::Done);
    }
    mysql::drop_tables(store.pool(), &[&counter]).await;
    drop_store(&store).await;
}

/// A purge running while consumers take expired records over deletes only records
/// that are still expired: every taken key stays in progress.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_racing_takeovers_deletes_no_live_record() {
    let Some(pool) = mysql::pool(8).await else { return };
    let store = Arc::new(store_on(pool).await);
    let short = Duration::from_millis(40);
    for round in 0..5 {
        let keys: Vec<Key> =
            (0..60).map(|i| Key::new("purged", format!("{round}-{i}")).unwrap()).collect();
        for key in &keys {
            let token = won(&store, key, short, short).await;
            assert_eq!(store.complete(key, token, short, None).await.unwrap(), Transition::Applied);
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
        let purge = {
            let store = store.clone();
            tokio::spawn(async move {
                let mut deleted = 0;
                for _ in 0..20 {
                    deleted += store.purge_expired(5).await.unwrap_or(0);
                }
                deleted
            })
        };
        let takers = keys.chunks(15).map(|chunk| {
            let (store, chunk) = (store.clone(), chunk.to_vec());
            tokio::spawn(async move {
                for key in &chunk {
                    match store.claim(key, LEASE, TTL, None).await.unwrap() {
                        Claim::Won { .. } => {}
                        other => panic!("{key}: {other:?}"),
                    }
                }
            })
        });
        for taker in futures_util::future::join_all(takers).await {
            taker.unwrap();
        }
        purge.await.unwrap();
        for key in &keys {
            assert!(
                matches!(
                    store.claim(key, LEASE, TTL, None).await.unwrap(),
                    Claim::InProgress { .. }
                ),
                "{key}: the purge deleted a record taken over"
            );
        }
    }
    drop_store(&store).await;
}

/// A consumer whose lease lapsed records DONE just as another takes the key over:
/// exactly one of them owns the key, never both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_done_racing_a_takeover_has_one_owner() {
    let Some(pool) = mysql::pool(8).await else { return };
    let store = Arc::new(store_on(pool).await);
    let lease = Duration::from_millis(30);
    for round in 0..40 {
        let key = Key::new("late", round.to_string()).unwrap();
        let old = won(&store, &key, lease, TTL).await;
        tokio::time::sleep(Duration::from_millis(40)).await;
        let (done, taken) =
            tokio::join!(store.complete(&key, old, TTL, None), store.claim(&key, LEASE, TTL, None));
        match (done.unwrap(), taken.unwrap()) {
            (Transition::Applied, Claim::Done) => {}
            (Transition::LeaseLost, Claim::Won { token, attempt: 2, .. }) => {
                assert_eq!(
                    store.renew(&key, old, LEASE, TTL).await.unwrap(),
                    Transition::LeaseLost
                );
                assert_eq!(
                    store.renew(&key, token, LEASE, TTL).await.unwrap(),
                    Transition::Applied
                );
            }
            other => panic!("{key}: {other:?}"),
        }
    }
    drop_store(&store).await;
}

#[derive(Debug, thiserror::Error, Classify)]
enum ShipError {
    #[error("database: {0}")]
    #[idempotent(transparent)]
    Db(#[from] sqlx::Error),
    #[error("already shipped")]
    #[idempotent(duplicate)]
    AlreadyShipped,
}

struct Shop {
    store: MysqlStore,
    shipments: String,
}

/// Writes a shipment row, then finds the parcel already shipped.
#[idempotent(key = "{id}", store = shop.store, transactional, namespace = "ship")]
async fn ship(id: i64, shop: &Shop, tx: &mut Transaction<'_, MySql>) -> Result<(), ShipError> {
    let sql = format!("INSERT INTO {} (id) VALUES (?)", shop.shipments);
    sqlx::query(AssertSqlSafe(sql)).bind(id).execute(&mut **tx).await?;
    Err(ShipError::AlreadyShipped)
}

/// A transactional handler whose error says its effect is already there: its own
/// writes roll back, the key is DONE, and a redelivery is a duplicate.
#[tokio::test]
async fn a_duplicate_error_in_a_transaction_rolls_back_and_records_done() {
    let Some(pool) = mysql::pool(1).await else { return };
    let store = store_on(pool).await;
    let shipments = table_of(&store).replacen("attack", "shipments", 1);
    let create = format!("CREATE TABLE {shipments} (id BIGINT NOT NULL)");
    sqlx::query(AssertSqlSafe(create)).execute(store.pool()).await.unwrap();
    let shop = Shop { store, shipments };
    assert_eq!(ship(5, &shop).await.unwrap(), Outcome::Duplicate);
    assert_eq!(ship(5, &shop).await.unwrap(), Outcome::Duplicate);
    let count = format!("SELECT count(*) FROM {}", shop.shipments);
    let rows: i64 =
        sqlx::query_scalar(AssertSqlSafe(count)).fetch_one(shop.store.pool()).await.unwrap();
    assert_eq!(rows, 0, "the handler's write was kept");
    let key = Key::new("ship", "5").unwrap();
    assert_eq!(state(&shop.store, &key).await.as_deref(), Some("D"));
    mysql::drop_tables(shop.store.pool(), &[&shop.shipments]).await;
    drop_store(&shop.store).await;
}
