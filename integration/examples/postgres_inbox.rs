//! A transactional inbox: debits land exactly once, even when the consumer dies
//! between its UPDATE and the commit.
//!
//! Every debit is delivered three times, by four consumers at once, and the first run
//! of debit 2 is cut off after its UPDATE, as a crash would. The balance update and
//! the DONE record commit in one transaction, so a cut-off run leaves neither.
//!
//! `DATABASE_URL=postgres://postgres@127.0.0.1:5432/test cargo run -p idempotent-integration --example postgres_inbox`

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idempotent::{Classify, Outcome, PostgresStore, idempotent};
use sqlx::{Postgres, Transaction};

#[derive(Debug, Clone)]
struct Debit {
    debit_id: u64,
    account: i64,
    cents: i64,
}

#[derive(Debug, thiserror::Error, Classify)]
enum DebitError {
    #[error(transparent)]
    #[idempotent(transparent)]
    Db(#[from] sqlx::Error),
    #[error("insufficient funds")]
    #[idempotent(terminal)]
    InsufficientFunds,
}

static CRASHED: AtomicBool = AtomicBool::new(false);

/// Takes `cents` from the account; returns the new balance.
#[idempotent(key = "debit:{debit_id}", store = pg, transactional, lease = "5s")]
async fn debit(
    msg: &Debit,
    pg: &PostgresStore,
    tx: &mut Transaction<'_, Postgres>,
) -> Result<i64, DebitError> {
    let balance: Option<i64> = sqlx::query_scalar(
        "UPDATE inbox_accounts SET balance = balance - $1 WHERE id = $2 AND balance >= $1 RETURNING balance",
    )
    .bind(msg.cents)
    .bind(msg.account)
    .fetch_optional(&mut **tx)
    .await?;
    if msg.debit_id == 2 && !CRASHED.swap(true, Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_secs(3600)).await; // the consumer dies here
    }
    balance.ok_or(DebitError::InsufficientFunds)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let pg = PostgresStore::connect(&url).await?.with_table("inbox_records")?;
    pg.migrate().await?;
    sqlx::raw_sql(
        "TRUNCATE inbox_records;
         DROP TABLE IF EXISTS inbox_accounts;
         CREATE TABLE inbox_accounts (id bigint PRIMARY KEY, balance bigint NOT NULL);
         INSERT INTO inbox_accounts VALUES (1, 10000), (2, 500);",
    )
    .execute(pg.pool())
    .await?;

    let debits = [(1, 1, 2500), (2, 1, 1000), (3, 2, 400), (4, 2, 400)];
    let debits: Vec<Debit> =
        debits.map(|(debit_id, account, cents)| Debit { debit_id, account, cents }).into();
    let deliveries: Vec<&Debit> = debits.iter().cycle().take(debits.len() * 3).collect();
    // Four consumers; a delivery that is not settled is delivered again, as a broker would.
    let pg = &pg;
    let consumers = deliveries.chunks(3).map(|batch| async move {
        for msg in batch {
            loop {
                match tokio::time::timeout(Duration::from_secs(1), debit(msg, pg)).await {
                    Err(_) => println!("debit {}: consumer crashed mid-handler", msg.debit_id),
                    Ok(Ok(Outcome::InProgress { .. })) => {}
                    Ok(Ok(outcome)) => break println!("debit {}: {outcome:?}", msg.debit_id),
                    Ok(Err(e)) if !e.is_retryable() => {
                        break println!("debit {}: {e}", msg.debit_id);
                    }
                    Ok(Err(e)) => println!("debit {}: {e}; redelivering", msg.debit_id),
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    });
    futures_util::future::join_all(consumers).await;

    let balances: Vec<(i64, i64)> =
        sqlx::query_as("SELECT id, balance FROM inbox_accounts ORDER BY id")
            .fetch_all(pg.pool())
            .await?;
    println!("balances: {balances:?}");
    assert_eq!(balances, [(1, 10000 - 2500 - 1000), (2, 500 - 400)], "each debit applied once");
    Ok(())
}
