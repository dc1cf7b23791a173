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

/// Stalls past its lease (its renewals cannot land), then works for a second, and
/// says so in `went_on`.
#[idempotent(key = "job:{id}", store = store, lease = "300ms", ttl = 60)]
async fn slow(msg: &Job, store: &SlowRenewals, went_on: &AtomicBool) -> Result<(), std::io::Error> {
    std::thread::sleep(LEASE + Duration::from_millis(100));
    tokio::time::sleep(Duration::from_secs(1)).await;
    went_on.store(true, Ordering::SeqCst);
    Ok(())
}

/// Renewals slower than a thirtieth of the lease, quicker than a third.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_store_still_stops_a_body_whose_key_was_taken() {
    static STORE: std::sync::LazyLock<SlowRenewals> =
        std::sync::LazyLock::new(|| SlowRenewals(MemoryStore::new(), Duration::from_millis(40)));
    static WENT_ON: AtomicBool = AtomicBool::new(false);
    stops_the_body(&STORE, &WENT_ON).await;
}

/// Renewals slower than a third of the lease, quicker than the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_slower_than_a_third_of_the_lease_still_stops_it() {
    static STORE: std::sync::LazyLock<SlowRenewals> =
        std::sync::LazyLock::new(|| SlowRenewals(MemoryStore::new(), Duration::from_millis(200)));
    static WENT_ON: AtomicBool = AtomicBool::new(false);
    stops_the_body(&STORE, &WENT_ON).await;
}

/// Runs `slow` on `store` and takes its key over meanwhile: the body must be
/// stopped, and the takeover's claim left to complete.
async fn stops_the_body(store: &'static SlowRenewals, went_on: &'static AtomicBool) {
    static JOB: Job = Job { id: 1 };
    let first = tokio::spawn(slow(&JOB, store, went_on));
    // After the first claim's lease ran out, another consumer takes the key.
    tokio::time::sleep(LEASE + Duration::from_millis(50)).await;
    let key = Key::new("slow", "job:1").unwrap();
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
