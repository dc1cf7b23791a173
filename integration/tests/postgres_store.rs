//! `PostgresStore` against the machine's PostgreSQL (`DATABASE_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`): the store-generic suite, unchanged, plus
//! the table's own upkeep.

#[path = "support/postgres.rs"]
mod postgres;

use idempotent::testing::{self, block_on};
use idempotent::{Claim, Key, PostgresStore, Store};

/// A migrated store on the shared table; `None` (with a printed reason) when no
/// PostgreSQL answers outside CI.
async fn store() -> Option<PostgresStore> {
    let store = PostgresStore::from_pool(postgres::pool(10).await?);
    store.migrate().await.expect("migration");
    Some(store)
}

idempotent::store_suite!(match store().await {
    Some(store) => store,
    None => return,
});

/// A migrated store whose connections default to `isolation` (as a DBA may set for
/// the whole database), on a table of its own.
async fn store_at(isolation: &str, table: &str) -> Option<PostgresStore> {
    let settings = [("default_transaction_isolation", isolation)];
    let pool = postgres::pool_with(10, &settings).await?;
    let store = PostgresStore::from_pool(pool).with_table(table).unwrap();
    store.migrate().await.expect("migration");
    Some(store)
}

/// The suite with SERIALIZABLE as every connection's default (REPEATABLE READ fails
/// the same statements the same way; the renewals' session under an `after_connect`
/// is `sql_hardening`'s).
mod serializable_default {
    idempotent::store_suite!(
        match super::store_at("serializable", "idempotent_records_ser").await {
            Some(store) => store,
            None => return,
        }
    );
}

#[test]
fn tables_are_configurable_and_expired_records_are_purged() {
    block_on(async {
        let Some(shared) = store().await else { return };
        assert!(shared.clone().with_table("bad name; drop table x").is_err());
        let table =
            format!("idempotent_purge_{}", testing::fresh_key("t").namespace().replace('-', "_"));
        let store = shared.with_table(&table).unwrap();
        store.migrate().await.unwrap();
        store.migrate().await.unwrap();
        let short = std::time::Duration::from_millis(50);
        for i in 0..20 {
            let key = Key::new("purge", i.to_string()).unwrap();
            let Claim::Won { token, .. } = store.claim(&key, short, short, None).await.unwrap()
            else {
                panic!("fresh key")
            };
            let _ = store.complete(&key, token, short, None).await.unwrap();
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        assert_eq!(store.purge_expired(1_000).await.unwrap(), 20);
        assert_eq!(store.purge_expired(1_000).await.unwrap(), 0);
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
            .execute(store.pool())
            .await
            .unwrap();
    });
}
