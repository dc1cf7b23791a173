use idempotent::{PostgresStore, idempotent};
use sqlx::{Postgres, Transaction};

struct Debit {
    id: i64,
    amount: i64,
}

#[idempotent(key = "debit:{id}", store = pg, transactional)]
async fn debit(
    msg: &Debit,
    pg: &PostgresStore,
    tx: &mut Transaction<'_, Postgres>,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE accounts SET balance = balance - $1").bind(msg.amount).execute(&mut **tx).await?;
    Ok(())
}
