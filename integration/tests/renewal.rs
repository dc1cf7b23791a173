//! Lease renewal when the store is slow: one renewal that hangs until its timeout
//! must not push the next one past the end of the lease the last applied renewal
//! granted, or a redelivery on another consumer claims the key while the handler
//! still runs and the handler takes effect twice. Paused Tokio time, `MemoryStore`
//! behind a store whose second renewal hangs and whose others take 20 ms.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idempotent::__private::{Call, Spec, run};
use idempotent::{
    Claim, Fingerprint, Key, MemoryStore, Outcome, Store, StoreError, Token, Transition,
    async_trait,
};

/// A memory store whose second renewal hangs (a stalled connection, a GC pause on
/// the server) and whose other renewals take `LATENCY` (an ordinary round trip).
struct SlowSecondRenewal {
    inner: MemoryStore,
    renewals: AtomicU32,
}

const LATENCY: Duration = Duration::from_millis(20);

#[async_trait]
impl Store for SlowSecondRenewal {
    async fn claim(
        &self,
        key: &Key,
        lease: Duration,
        ttl: Duration,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Claim, StoreError> {
        self.inner.claim(key, lease, ttl, fingerprint).await
    }
    async fn complete(
        &self,
        key: &Key,
        token: Token,
        ttl: Duration,
        result: Option<&[u8]>,
    ) -> Result<Transition, StoreError> {
        self.inner.complete(key, token, ttl, result).await
    }
    async fn release(&self, key: &Key, token: Token) -> Result<Transition, StoreError> {
        self.inner.release(key, token).await
    }
    async fn fail(&self, key: &Key, token: Token, ttl: Duration) -> Result<Transition, StoreError> {
        self.inner.fail(key, token, ttl).await
    }
    async fn renew(
        &self,
        key: &Key,
        token: Token,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Transition, StoreError> {
        let n = self.renewals.fetch_add(1, Ordering::SeqCst);
        if n == 1 {
            // Hangs past its timeout (a third of the lease); never applied.
            std::future::pending::<()>().await;
        }
        tokio::time::sleep(LATENCY).await;
        self.inner.renew(key, token, lease, ttl).await
    }
}

#[tokio::test(start_paused = true)]
async fn a_hung_renewal_does_not_let_the_lease_lapse() {
    let store =
        Arc::new(SlowSecondRenewal { inner: MemoryStore::new(), renewals: AtomicU32::new(0) });
    let lease = Duration::from_millis(300);
    let spec = Spec::new(Duration::from_secs(3600), lease, 5);
    let runs = Arc::new(AtomicU32::new(0));

    let handle = |store: Arc<SlowSecondRenewal>, runs: Arc<AtomicU32>| async move {
        let call = Call::new(spec, Key::new("renewal", "order-1"));
        run(
            call,
            &*store,
            |_: &std::io::Error| idempotent::ErrorClass::Retryable,
            |_| async {},
            async {
                runs.fetch_add(1, Ordering::SeqCst);
                // A handler that takes three leases, kept alive by renewals.
                tokio::time::sleep(lease * 3).await;
                Ok::<_, std::io::Error>(())
            },
        )
        .await
    };

    // The first consumer.
    let first = tokio::spawn(handle(store.clone(), runs.clone()));
    tokio::time::sleep(Duration::from_millis(1)).await;
    // A redelivery on a second consumer, every 5 ms until the first finishes.
    let mut second_outcomes = Vec::new();
    while !first.is_finished() {
        let outcome = handle(store.clone(), runs.clone()).await;
        second_outcomes.push(format!("{outcome:?}"));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let first = first.await.unwrap();
    let processed = second_outcomes.iter().filter(|o| o.contains("Processed")).count();
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the handler ran {} times: after one hung renewal the lease lapsed while it ran \
         (first call: {first:?}; second consumer processed it {processed} time(s))",
        runs.load(Ordering::SeqCst)
    );
    assert!(matches!(first, Ok(Outcome::Processed(()))), "{first:?}");
}
