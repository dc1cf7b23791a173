//! The lease another claim has left, as each store reports it with
//! `Claim::InProgress`: in milliseconds, close below the lease just taken, for short
//! leases and for leases of months or a century (the longest a `Spec` allows).

#[path = "support/mysql.rs"]
mod mysql;
#[path = "support/postgres.rs"]
mod postgres;
mod support;

use std::time::Duration;

use idempotent::testing::{self, block_on};
use idempotent::{Claim, MemoryStore, MysqlStore, PostgresStore, Store};

const MAX_DURATION: Duration = Duration::from_secs(36_500 * 86_400);

const DAY: Duration = Duration::from_secs(86_400);

/// Claims a fresh key for `lease`, claims it again, and checks the lease left.
async fn check(store: &dyn Store, name: &str) {
    for lease in [Duration::from_secs(20), 60 * DAY, MAX_DURATION] {
        let key = testing::fresh_key("lease-left");
        let ttl = lease + DAY;
        let ttl = ttl.min(MAX_DURATION);
        let first = store.claim(&key, lease, ttl, None).await.unwrap();
        assert!(matches!(first, Claim::Won { .. }), "{name}: {first:?}");
        let second = store.claim(&key, lease, ttl, None).await.unwrap();
        let Claim::InProgress { lease_left: Some(left) } = second else {
            panic!("{name}: a live claim with lease {lease:?} answered {second:?}")
        };
        assert!(
            left <= lease && left + Duration::from_secs(2) >= lease,
            "{name}: a claim with lease {lease:?} reports {left:?} left just after it was taken"
        );
    }
}

#[test]
fn memory_reports_the_lease_left() {
    block_on(async { check(&MemoryStore::new(), "memory").await });
}

#[test]
fn redis_reports_the_lease_left() {
    block_on(async {
        let Some(store) = support::shared_store().await else { return };
        check(&store, "redis").await;
    });
}

#[test]
fn postgres_reports_the_lease_left() {
    block_on(async {
        let Some(pool) = postgres::pool(2).await else { return };
        let store = PostgresStore::from_pool(pool);
        store.migrate().await.unwrap();
        check(&store, "postgres").await;
    });
}

#[test]
fn mysql_reports_the_lease_left() {
    block_on(async {
        let Some(pool) = mysql::pool(2).await else { return };
        let table = mysql::table("idempotent_lease_left");
        let store = MysqlStore::from_pool(pool.clone()).with_table(&table).unwrap();
        store.migrate().await.unwrap();
        check(&store, "mysql").await;
        mysql::drop_tables(&pool, &[&table]).await;
    });
}
