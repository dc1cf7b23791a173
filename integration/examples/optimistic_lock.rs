//! Stock reservations on MariaDB or MySQL, with no idempotency store (`NoStore`): a unique
//! key on the reservation turns a duplicate away, a version column on the stock row
//! turns a lost race into a retry (with backoff). Eight consumers; every order comes
//! twice; demand exceeds stock. No unit is sold twice and the final counts are exact.
//! `MYSQL_URL=mysql://root@127.0.0.1:3306/test cargo run -p idempotent-integration --example optimistic_lock`

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, LazyLock, Mutex};

use idempotent::guard::{Table, VersionGuard, VersionRefused};
use idempotent::{Classify, Disposition, DispositionExt, NoStore, idempotent};
use sqlx::MySqlPool;

#[derive(Debug, thiserror::Error, Classify)]
enum ReserveError {
    #[error(transparent)]
    #[idempotent(transparent)]
    Db(#[from] sqlx::Error),
    #[error(transparent)]
    #[idempotent(transparent)] // stale: retryable
    Version(#[from] VersionRefused),
    #[error("order already reserved")]
    #[idempotent(duplicate)]
    AlreadyReserved,
    #[error("sold out")]
    #[idempotent(terminal)]
    SoldOut,
}

static STOCK: LazyLock<VersionGuard> =
    LazyLock::new(|| Table::new("ol_stock", "sku").and_then(|t| t.versioned("version")).unwrap());

/// One unit of `sku` for `order`: the reservation and the stock row commit together.
#[idempotent(key = "reserve:{order}", store = NoStore)]
async fn reserve(order: i64, sku: i64, db: &MySqlPool) -> Result<(), ReserveError> {
    let mut tx = db.begin().await?;
    let insert = sqlx::query("INSERT INTO ol_reservations VALUES (?, ?)").bind(order).bind(sku);
    if let Err(e) = insert.execute(&mut *tx).await {
        let twice = e.as_database_error().is_some_and(|e| e.is_unique_violation());
        return Err(if twice { ReserveError::AlreadyReserved } else { e.into() });
    }
    let read = sqlx::query_as("SELECT quantity, version FROM ol_stock WHERE sku = ?");
    let (left, version): (i64, i64) = read.bind(sku).fetch_one(&mut *tx).await?;
    if left == 0 {
        return Err(ReserveError::SoldOut);
    }
    STOCK.set("quantity", left - 1).apply(&mut *tx, sku, version).await?.into_result()?;
    Ok(tx.commit().await?)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("MYSQL_URL");
    let db = MySqlPool::connect(url.as_deref().unwrap_or("mysql://root@127.0.0.1:3306/test"));
    let db = db.await?;
    sqlx::raw_sql(
        "DROP TABLE IF EXISTS ol_stock, ol_reservations;
         CREATE TABLE ol_stock (sku BIGINT PRIMARY KEY, quantity BIGINT NOT NULL, version BIGINT NOT NULL);
         CREATE TABLE ol_reservations (order_id BIGINT PRIMARY KEY, sku BIGINT NOT NULL);
         INSERT INTO ol_stock VALUES (1, 100, 0), (2, 100, 0), (3, 100, 0), (4, 100, 0);",
    )
    .execute(&db)
    .await?;
    // 600 orders for 400 units, each delivered twice; (order, sku, delivery).
    let orders = (1..=600).flat_map(|o: i64| [(o, 1 + o * 7 % 4, 1u32); 2]);
    let queue = Arc::new(Mutex::new(orders.collect::<VecDeque<_>>()));
    let settled = Arc::new(Mutex::new(HashMap::<Disposition, usize>::new()));
    let consumers: Vec<_> = (0..8)
        .map(|_| {
            let (queue, db, settled) = (queue.clone(), db.clone(), settled.clone());
            tokio::spawn(async move {
                loop {
                    let Some((order, sku, n)) = queue.lock().unwrap().pop_front() else { break };
                    let disposition = reserve(order, sku, &db).await.disposition();
                    if disposition == Disposition::Retry {
                        // Back off 2^n ms, at most 64, then redeliver.
                        tokio::time::sleep(std::time::Duration::from_millis(1 << n.min(6))).await;
                        queue.lock().unwrap().push_back((order, sku, n + 1));
                    }
                    *settled.lock().unwrap().entry(disposition).or_default() += 1;
                }
            })
        })
        .collect();
    for consumer in consumers {
        consumer.await?;
    }
    let rows: Vec<(i64, i64, i64)> = sqlx::query_as(
        "SELECT quantity, (SELECT count(*) FROM ol_reservations r WHERE r.sku = s.sku), version FROM ol_stock s",
    )
    .fetch_all(&db)
    .await?;
    println!("settled: {:?}; (left, reserved, version) per SKU: {rows:?}", settled.lock().unwrap());
    // Demand exceeds stock: all sold once; dead letters are only sold-out orders, twice each.
    assert!(rows.iter().all(|&r| r == (0, 100, 100)), "a unit oversold, lost or left unsold");
    let dead = settled.lock().unwrap()[&Disposition::DeadLetter];
    assert_eq!(dead, 400, "an order was dead-lettered although stock was left for it");
    Ok(())
}
