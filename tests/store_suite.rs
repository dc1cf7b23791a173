//! The record life cycle, every row, on `MemoryStore`: the same suite the other
//! stores run.

idempotent::store_suite!(idempotent::MemoryStore::new());

/// `MemoryStore` releases a dropped handler's claim at once, not after the lease.
#[test]
fn memory_store_releases_a_dropped_future_at_once() {
    use idempotent::{Claim, Store, testing};
    testing::block_on(async {
        let store = idempotent::MemoryStore::new();
        let key = testing::fresh_key("drop-now");
        let started = tokio::sync::Notify::new();
        let spec = idempotent_spec();
        let handler = idempotent::__private::run(
            idempotent::__private::Call::new(spec, Ok(key.clone())),
            &store,
            |_: &std::convert::Infallible| unreachable!(),
            idempotent::__private::process_sink,
            async {
                started.notify_one();
                std::future::pending::<Result<(), std::convert::Infallible>>().await
            },
        );
        tokio::select! {
            _ = handler => unreachable!(),
            _ = started.notified() => {}
        }
        let claim = store.claim(&key, testing::LEASE, testing::TTL, None).await.unwrap();
        assert!(matches!(claim, Claim::Won { attempt: 2, .. }), "{claim:?}");
    })
}

fn idempotent_spec() -> idempotent::__private::Spec {
    idempotent::__private::Spec::new(idempotent::testing::TTL, idempotent::testing::LEASE, 5)
}
