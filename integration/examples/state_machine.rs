//! Payments guarded by the order's own state, with no idempotency store (`NoStore`):
//! only an UNPAID order may be paid or cancelled. Four consumers; every "paid" comes three
//! times, a fifth of the orders get a "cancelled" before or after it, one paid run in ten
//! fails after its charge insert. No order is charged twice, none cancelled and charged.
//! `DATABASE_URL=postgres://postgres@127.0.0.1:5432/test cargo run -p idempotent-integration --example state_machine`

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, LazyLock, Mutex};

use idempotent::guard::{StateGuard, StateRefused, Table};
use idempotent::{Classify, Disposition, DispositionExt, NoStore, idempotent};
use sqlx::PgPool;

#[derive(Debug, thiserror::Error, Classify)]
enum OrderError {
    #[error(transparent)]
    #[idempotent(transparent)]
    Db(#[from] sqlx::Error),
    #[error(transparent)]
    #[idempotent(transparent)] // already there: duplicate; another state: terminal
    Refused(#[from] StateRefused<String>),
}

fn from_unpaid(to: &str) -> StateGuard<String> {
    Table::new("sm_orders", "id").and_then(|t| t.state("status", ["UNPAID"], to)).unwrap()
}
static PAY: LazyLock<StateGuard<String>> = LazyLock::new(|| from_unpaid("PAID"));
static CANCEL: LazyLock<StateGuard<String>> = LazyLock::new(|| from_unpaid("CANCELLED"));
#[idempotent(key = "paid:{order}", store = NoStore)]
async fn paid(order: i64, db: &PgPool, fail: bool) -> Result<(), OrderError> {
    let mut tx = db.begin().await?; // the guard and the charge commit together
    PAY.apply(&mut *tx, order).await?.into_result()?;
    sqlx::query("INSERT INTO sm_charges VALUES ($1, 500)").bind(order).execute(&mut *tx).await?;
    if fail {
        return Err(sqlx::Error::PoolTimedOut.into()); // the charge rolls back, and retries
    }
    Ok(tx.commit().await?)
}

#[idempotent(key = "cancelled:{order}", store = NoStore)]
async fn cancelled(order: i64, db: &PgPool) -> Result<(), OrderError> {
    Ok(CANCEL.apply(db, order).await?.into_result()?)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL");
    let db = PgPool::connect(url.as_deref().unwrap_or("postgres://postgres@127.0.0.1:5432/test"))
        .await?;
    sqlx::raw_sql(
        "DROP TABLE IF EXISTS sm_orders, sm_charges;
         CREATE TABLE sm_orders (id BIGINT PRIMARY KEY, status TEXT NOT NULL);
         CREATE TABLE sm_charges (order_id BIGINT NOT NULL, cents BIGINT NOT NULL);
         INSERT INTO sm_orders SELECT g, 'UNPAID' FROM generate_series(1, 500) g;",
    )
    .execute(&db)
    .await?;
    let mut messages: Vec<(i64, bool)> = (1..=500).flat_map(|o| [(o, false); 3]).collect();
    messages.extend((1..=500).step_by(5).map(|o| (o, true)));
    messages.sort_by_key(|&(o, cancel)| (o * 7919 + i64::from(cancel) * 504) % 1009);
    let queue = Arc::new(Mutex::new(VecDeque::from(messages)));
    let settled = Arc::new(Mutex::new(HashMap::<Disposition, usize>::new()));
    let consumers: Vec<_> = (0..4)
        .map(|_| {
            let (queue, db, settled) = (queue.clone(), db.clone(), settled.clone());
            tokio::spawn(async move {
                for run in 0u64.. {
                    let Some((order, cancel)) = queue.lock().unwrap().pop_front() else { break };
                    let disposition = match cancel {
                        true => cancelled(order, &db).await.disposition(),
                        false => paid(order, &db, run % 10 == 3).await.disposition(),
                    };
                    if disposition == Disposition::Retry {
                        queue.lock().unwrap().push_back((order, cancel)); // redelivered
                    }
                    *settled.lock().unwrap().entry(disposition).or_default() += 1;
                }
            })
        })
        .collect();
    for consumer in consumers {
        consumer.await?;
    }
    // Orders charged twice, charged but not PAID, PAID but not charged, untouched; cancelled.
    let (twice, wrongly, uncharged, lost, cancelled): (i64, i64, i64, i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE n > 1), count(*) FILTER (WHERE status <> 'PAID' AND n > 0),
                count(*) FILTER (WHERE status = 'PAID' AND n = 0), count(*) FILTER (WHERE status = 'UNPAID'),
                count(*) FILTER (WHERE status = 'CANCELLED')
         FROM (SELECT status, (SELECT count(*) FROM sm_charges WHERE order_id = id) n FROM sm_orders) t",
    )
    .fetch_one(&db)
    .await?;
    println!("settled: {:?}", settled.lock().unwrap());
    assert_eq!((twice, wrongly, uncharged, lost), (0, 0, 0, 0), "an order charged wrongly or lost");
    // Dead letters are only real conflicts (a cancelled order's 3 payments, a paid one's cancel).
    let dead = settled.lock().unwrap()[&Disposition::DeadLetter] as i64;
    assert_eq!(dead, 3 * cancelled + (100 - cancelled), "a duplicate was dead-lettered");
    Ok(())
}
