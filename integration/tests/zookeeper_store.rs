//! `ZooKeeperStore` against a real ZooKeeper: the store-generic suite, unchanged, on
//! the machine's server (`ZOOKEEPER_HOSTS`, default `127.0.0.1:2181`, started with
//! `-Dzookeeper.extendedTypesEnabled=true`), under a root of this run's own.

use idempotent::ZooKeeperStore;

/// The machine's ensemble.
fn hosts() -> String {
    std::env::var("ZOOKEEPER_HOSTS").unwrap_or_else(|_| "127.0.0.1:2181".into())
}

/// A store under `/idempotent-test` (each case uses fresh keys); `None` (with a
/// printed reason) when no server answers outside CI.
async fn store() -> Option<ZooKeeperStore> {
    let root = "/idempotent-test";
    let hosts = hosts();
    let session = std::time::Duration::from_secs(6);
    match ZooKeeperStore::connect_with(&hosts, root, session).await {
        Ok(store) => Some(store),
        Err(e) => {
            assert!(std::env::var_os("CI").is_none(), "CI needs ZooKeeper at {hosts}: {e}");
            eprintln!("skipped: no ZooKeeper at {hosts} ({e})");
            None
        }
    }
}

idempotent::store_suite!(match store().await {
    Some(store) => store,
    None => return,
});
