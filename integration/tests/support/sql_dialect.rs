//! What the SQL test harnesses need of each database alike: its store, pool and the
//! statements that read and tamper with a records or ledger table, in `pg` and `my`.
//! A harness includes it beside `support/postgres.rs` and `support/mysql.rs` (as
//! `postgres` and `mysql`) and extends each module with what only it needs.
#![allow(dead_code)]

/// PostgreSQL's side.
pub mod pg {
    pub use idempotent::PostgresStore as Store;
    #[allow(unused_imports)] // Only the harnesses that pick a claim mode use it.
    pub use idempotent::postgres_store::TransactionalClaim;
    use sqlx::{AssertSqlSafe, PgPool};

    pub type Db = sqlx::Postgres;
    pub type Pool = PgPool;

    pub async fn pool(connections: u32) -> Option<Pool> {
        super::super::postgres::pool(connections).await
    }

    pub fn count_rows(ledger: &str) -> String {
        format!("SELECT count(*) FROM {ledger} WHERE message_id = $1")
    }

    /// Gives the key's claim a token no consumer holds, as a takeover would.
    pub fn steal_claim(records: &str) -> String {
        format!("UPDATE {records} SET token = '\\x00'::bytea WHERE key = $1")
    }

    pub async fn drop_tables(pool: &Pool, tables: &[&str]) {
        let sql = format!("DROP TABLE IF EXISTS {}", tables.join(", "));
        sqlx::query(AssertSqlSafe(sql)).execute(pool).await.unwrap();
    }
}

/// MySQL's and MariaDB's side.
pub mod my {
    pub use idempotent::MysqlStore as Store;
    #[allow(unused_imports)] // Only the harnesses that pick a claim mode use it.
    pub use idempotent::mysql_store::TransactionalClaim;
    use sqlx::MySqlPool;

    pub type Db = sqlx::MySql;
    pub type Pool = MySqlPool;

    pub async fn pool(connections: u32) -> Option<Pool> {
        super::super::mysql::pool(connections).await
    }

    pub fn count_rows(ledger: &str) -> String {
        format!("SELECT count(*) FROM {ledger} WHERE message_id = ?")
    }

    /// Gives the key's claim a token no consumer holds, as a takeover would.
    pub fn steal_claim(records: &str) -> String {
        format!("UPDATE {records} SET token = X'00' WHERE `key` = ?")
    }

    pub async fn drop_tables(pool: &Pool, tables: &[&str]) {
        super::super::mysql::drop_tables(pool, tables).await;
    }
}
