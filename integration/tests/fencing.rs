//! The README's downstream fencing recipe, on every store that gives a fence
//! (`MemoryStore`, ZooKeeper, PostgreSQL) with a real downstream table in PostgreSQL:
//! a consumer that claimed a message and then stalled past its lease (a paused
//! process, a write held in a slow network) comes back after another consumer took
//! the message over and wrote; its late write carries the smaller fence and the
//! downstream table refuses it. Checked by reading the row back.

#[path = "support/postgres.rs"]
mod postgres;

use std::time::Duration;

use idempotent::testing::block_on;
use idempotent::{Claim, Key, Outcome, Store, Transition, idempotent};
use sqlx::PgPool;

/// The downstream system: one row per account with the fence of the write that
/// made it. A write is applied unless the row holds a larger fence.
async fn write(pool: &PgPool, account: &str, fence: u64, value: &str) -> bool {
    let done = sqlx::query(
        "INSERT INTO fencing_ledger (account, fence, value) VALUES ($1, $2, $3)
         ON CONFLICT (account) DO UPDATE SET fence = EXCLUDED.fence, value = EXCLUDED.value
         WHERE fencing_ledger.fence <= EXCLUDED.fence",
    )
    .bind(account)
    .bind(i64::try_from(fence).expect("a fence below 2^63"))
    .bind(value)
    .execute(pool)
    .await
    .expect("the ledger");
    done.rows_affected() == 1
}

struct Payment {
    account: String,
}

#[derive(Debug, thiserror::Error, idempotent::Classify)]
#[error("the ledger is unreachable")]
#[idempotent(retryable)]
struct Unreachable;

/// The handler of the recipe: every downstream write carries the claim's fence.
#[idempotent(key = "{account}", namespace = "fencing", ttl = 60, lease = 1, store = store)]
async fn pay(payment: Payment, store: &dyn Store, ledger: &PgPool) -> Result<bool, Unreachable> {
    let fence = idempotent::current().and_then(|claim| claim.fence).expect("this store fences");
    Ok(write(ledger, &payment.account, fence, "written by the claim that took over").await)
}

async fn late_write_is_refused(store: &dyn Store, ledger: &PgPool) {
    let account = format!("account-{:x}", idempotent::Token::random().as_u128());
    let key = Key::new("fencing", account.as_str()).unwrap();
    // The consumer that stalls: it claimed the payment and read its fence, then
    // stopped for longer than its lease.
    let lease = Duration::from_secs(1);
    let Claim::Won { token: stalled, fence: Some(stalled_fence), .. } =
        store.claim(&key, lease, Duration::from_secs(60), None).await.unwrap()
    else {
        panic!("the first claim wins, with a fence")
    };
    tokio::time::sleep(lease + Duration::from_millis(300)).await;

    // The redelivery, on another consumer, takes the key over and writes.
    let taken_over = pay(Payment { account: account.clone() }, store, ledger).await;
    assert!(matches!(taken_over, Ok(Outcome::Processed(true))), "{taken_over:?}");

    // The stalled consumer comes back: its write is refused downstream, and the
    // store refuses its result.
    assert!(!write(ledger, &account, stalled_fence, "the stalled consumer's").await);
    assert_eq!(store.complete(&key, stalled, lease, None).await.unwrap(), Transition::LeaseLost);

    // From outside: the row is the new claim's.
    let (value, fence): (String, i64) =
        sqlx::query_as("SELECT value, fence FROM fencing_ledger WHERE account = $1")
            .bind(&account)
            .fetch_one(ledger)
            .await
            .unwrap();
    assert_eq!(value, "written by the claim that took over");
    assert!(fence as u64 > stalled_fence, "{fence} after {stalled_fence}");
}

async fn ledger() -> Option<PgPool> {
    let pool = postgres::pool(4).await?;
    // Tests run at once: `CREATE TABLE IF NOT EXISTS` races itself without a lock.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('fencing_ledger'))")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS fencing_ledger
         (account text PRIMARY KEY, fence bigint NOT NULL, value text NOT NULL)",
    )
    .execute(&mut *tx)
    .await
    .expect("the ledger table");
    tx.commit().await.unwrap();
    Some(pool)
}

#[test]
fn memory_store_fences_a_stalled_consumer() {
    block_on(async {
        let Some(ledger) = ledger().await else { return };
        late_write_is_refused(&idempotent::MemoryStore::new(), &ledger).await;
    });
}

#[test]
fn postgres_store_fences_a_stalled_consumer() {
    block_on(async {
        let Some(ledger) = ledger().await else { return };
        let store = idempotent::PostgresStore::from_pool(ledger.clone());
        store.migrate().await.expect("migration");
        late_write_is_refused(&store, &ledger).await;
    });
}

#[test]
fn zookeeper_store_fences_a_stalled_consumer() {
    block_on(async {
        let Some(ledger) = ledger().await else { return };
        let hosts = std::env::var("ZOOKEEPER_HOSTS").unwrap_or_else(|_| "127.0.0.1:2181".into());
        let store = match idempotent::ZooKeeperStore::connect(&hosts).await {
            Ok(store) => store,
            Err(e) => {
                assert!(std::env::var_os("CI").is_none(), "CI needs ZooKeeper at {hosts}: {e}");
                eprintln!("skipped: no ZooKeeper at {hosts} ({e})");
                return;
            }
        };
        late_write_is_refused(&store, &ledger).await;
    });
}
