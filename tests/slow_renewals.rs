//! A store slow to answer renewals (a loaded database) still stops a body whose key
//! another consumer took: once the lease has run out, each renewal is given up to a
//! lease to answer, rather than a thirtieth or a third of it, which every answer of a
//! loaded store might outlast.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idempotent::{
    Claim, Error, Fingerprint, Key, MemoryStore, Store, StoreError, Token, Transition, async_trait,
    idempotent,
};

const LEASE: Duration = Duration::from_millis(300);

/// `MemoryStore`, answering renewals this late.
struct SlowRenewals(MemoryStore, Duration);

#[async_trait]
impl Store for SlowRenewals {
    async fn claim(
        &self,
        key: &Key,
        lease: Duration,
        ttl: Duration,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Claim, StoreError> {
        self.0.claim(key, lease, ttl, fingerprint).await
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        ttl: Duration,
        result: Option<&[u8]>,
    ) -> Result<Transition, StoreError> {
        self.0.complete(key, token, ttl, result).await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<Transition, StoreError> {
        self.0.release(key, token).await
    }

    async fn fail(&self, key: &Key, token: Token, ttl: Duration) -> Result<Transition, StoreError> {
        self.0.fail(key, token, ttl).await
    }

    async fn renew(
        &self,
        key: &Key,
        token: Token,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Transition, StoreError> {
        // The answer is read when it was true: a stalled process cannot renew.
        let answer = self.0.renew(key, token, lease, ttl).await;
        tokio::time::sleep(self.1).await;
        answer
    }
}

struct Job {
    id: u32,
}

/// Renewals slower than a thirtieth of the lease, quicker than a third.
static STORE: std::sync::LazyLock<SlowRenewals> =
    std::sync::LazyLock::new(|| SlowRenewals(MemoryStore::new(), Duration::from_millis(40)));
static WENT_ON: AtomicBool = AtomicBool::new(false);

/// Stalls past its lease (its renewals cannot land), then works for a second.
#[idempotent(key = "job:{id}", store = STORE, lease = "300ms", ttl = 60)]
async fn slow(msg: &Job) -> Result<(), std::io::Error> {
    std::thread::sleep(LEASE + Duration::from_millis(100));
    tokio::time::sleep(Duration::from_secs(1)).await;
    WENT_ON.store(true, Ordering::SeqCst);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_store_still_stops_a_body_whose_key_was_taken() {
    stops_the_body(&STORE, &WENT_ON, "slow", slow).await;
}

/// Renewals slower than a third of the lease, quicker than the lease.
static SLOWER_STORE: std::sync::LazyLock<SlowRenewals> =
    std::sync::LazyLock::new(|| SlowRenewals(MemoryStore::new(), Duration::from_millis(200)));
static SLOWER_WENT_ON: AtomicBool = AtomicBool::new(false);

/// As `slow`, on `SLOWER_STORE`.
#[idempotent(key = "job:{id}", store = SLOWER_STORE, lease = "300ms", ttl = 60)]
async fn slower(msg: &Job) -> Result<(), std::io::Error> {
    std::thread::sleep(LEASE + Duration::from_millis(100));
    tokio::time::sleep(Duration::from_secs(1)).await;
    SLOWER_WENT_ON.store(true, Ordering::SeqCst);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_slower_than_a_third_of_the_lease_still_stops_it() {
    stops_the_body(&SLOWER_STORE, &SLOWER_WENT_ON, "slower", slower).await;
}

/// Runs `handler` (which stalls past its lease, then works; its keys in `namespace`)
/// and takes its key over meanwhile: the body must be stopped, and the takeover's
/// claim left to complete.
async fn stops_the_body<F>(
    store: &'static SlowRenewals,
    went_on: &'static AtomicBool,
    namespace: &str,
    handler: fn(&'static Job) -> F,
) where
    F: Future<Output = Result<idempotent::Outcome<()>, Error<std::io::Error>>> + Send + 'static,
{
    static JOB: Job = Job { id: 1 };
    let first = tokio::spawn(handler(&JOB));
    // After the first claim's lease ran out, another consumer takes the key.
    tokio::time::sleep(LEASE + Duration::from_millis(50)).await;
    let key = Key::new(namespace, "job:1").unwrap();
    let Claim::Won { token, .. } =
        store.claim(&key, LEASE * 10, Duration::from_secs(60), None).await.unwrap()
    else {
        panic!("the lapsed claim is taken over")
    };
    let first = first.await.unwrap();
    assert!(matches!(first, Err(Error::LeaseLost { attempt: 1, .. })), "{first:?}");
    assert!(!went_on.load(Ordering::SeqCst), "the body went on beside the new owner");
    assert_eq!(
        store.complete(&key, token, Duration::from_secs(60), None).await.unwrap(),
        Transition::Applied
    );
}
