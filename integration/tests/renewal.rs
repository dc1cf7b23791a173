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

/// A memory store whose first `complete` fails with a transient error (a dropped
/// connection), as any server-backed store's can.
struct FirstCompleteFails {
    inner: MemoryStore,
    completes: AtomicU32,
}

#[async_trait]
impl Store for FirstCompleteFails {
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
        if self.completes.fetch_add(1, Ordering::SeqCst) == 0 {
            return Err(StoreError::unavailable("connection reset (simulated)"));
        }
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
        self.inner.renew(key, token, lease, ttl).await
    }
    fn abandon(&self, key: &Key, token: Token) {
        self.inner.abandon(key, token)
    }
}

/// Runs one call on a fresh current-thread runtime built with or without its timer.
fn call_on<S: Store, T>(
    timer: bool,
    store: &S,
    id: &str,
    outcome: Result<T, std::io::Error>,
    class: idempotent::ErrorClass,
) -> std::thread::Result<Result<Outcome<T>, idempotent::Error<std::io::Error>>> {
    let mut builder = tokio::runtime::Builder::new_current_thread();
    if timer {
        builder.enable_time();
    }
    let rt = builder.build().unwrap();
    let call = Call::new(Spec::default(), Key::new("timerless", id));
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // The body is ready at its first poll: no renewal timer is ever made.
        rt.block_on(run(call, store, move |_| class, |_| async {}, async move { outcome }))
    }))
}

/// The timer check is made once per thread. On a thread that ran a runtime with a
/// timer and then runs one without, a body that is ready at once and fails for good
/// gets past the check and is marked FAILED; the terminal alert then wraps the hook
/// in `tokio::time::timeout`, which panics without a timer: the call panics instead
/// of answering `Err(Terminal)` (or `Err(Runtime)`).
#[test]
fn a_terminal_error_on_a_runtime_without_timers_after_one_with_them_does_not_panic() {
    std::thread::spawn(|| {
        let store = MemoryStore::new();
        let ok = call_on(true, &store, "1", Ok(()), idempotent::ErrorClass::Terminal);
        assert!(matches!(ok, Ok(Ok(Outcome::Processed(())))), "{ok:?}");

        let failed = call_on(
            false,
            &store,
            "2",
            Err::<(), _>(std::io::Error::other("card declined")),
            idempotent::ErrorClass::Terminal,
        );
        let answer = failed.expect("the call panicked instead of answering");
        assert!(
            matches!(
                answer,
                Err(idempotent::Error::Terminal { .. } | idempotent::Error::Runtime { .. })
            ),
            "{answer:?}"
        );
    })
    .join()
    .unwrap();
}

/// Same thread history as above, a body that is ready at once and succeeds, and a
/// store whose first `complete` fails transiently: the retry of the DONE record
/// sleeps with `tokio::time::sleep`, which panics without a timer. The unwinding
/// drops the call, whose drop guard releases the claim although the handler's
/// effects happened: the redelivery runs the handler a second time.
#[test]
fn a_transient_complete_failure_on_a_runtime_without_timers_does_not_release_a_finished_claim() {
    std::thread::spawn(|| {
        let store = FirstCompleteFails { inner: MemoryStore::new(), completes: AtomicU32::new(0) };
        // A runtime with a timer first, on this thread (its complete is the failing one,
        // so burn it with a key of its own and a working retry).
        let ok = call_on(true, &store, "warm-up", Ok(()), idempotent::ErrorClass::Retryable);
        assert!(matches!(ok, Ok(Ok(Outcome::Processed(())))), "{ok:?}");
        store.completes.store(0, Ordering::SeqCst);

        let first = call_on(false, &store, "3", Ok(()), idempotent::ErrorClass::Retryable);
        let redelivery = call_on(true, &store, "3", Ok(()), idempotent::ErrorClass::Retryable);
        assert!(
            !matches!(redelivery, Ok(Ok(Outcome::Processed(())))),
            "the handler ran twice: first call {first:?}, redelivery {redelivery:?}"
        );
        assert!(first.is_ok(), "the first call panicked");
    })
    .join()
    .unwrap();
}
