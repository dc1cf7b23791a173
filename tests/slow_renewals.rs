//! A store slow to answer renewals (a loaded database) still stops a body whose key
//! another consumer took: once the lease has run out, each renewal is given time to
//! answer, rather than a thirtieth of the lease, which every answer would outlast.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idempotent::{
    Claim, Error, Fingerprint, Key, MemoryStore, Store, StoreError, Token, Transition, async_trait,
    idempotent,
};

const LEASE: Duration = Duration::from_millis(300);
/// Slower than a thirtieth of the lease, quicker than a third.
const RENEWAL_TAKES: Duration = Duration::from_millis(40);

/// `MemoryStore`, answering renewals late.
struct SlowRenewals(MemoryStore);

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
        tokio::time::sleep(RENEWAL_TAKES).await;
        answer
    }
}

struct Job {
    id: u32,
}

static STORE: std::sync::LazyLock<SlowRenewals> =
    std::sync::LazyLock::new(|| SlowRenewals(MemoryStore::new()));
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
    let job = Job { id: 1 };
    let first = tokio::spawn(async move { slow(&job).await });
    // After the first claim's lease ran out, another consumer takes the key.
    tokio::time::sleep(LEASE + Duration::from_millis(50)).await;
    let key = Key::new("slow", "job:1").unwrap();
    let Claim::Won { token, .. } =
        STORE.claim(&key, LEASE * 10, Duration::from_secs(60), None).await.unwrap()
    else {
        panic!("the lapsed claim is taken over")
    };
    let first = first.await.unwrap();
    assert!(matches!(first, Err(Error::LeaseLost { attempt: 1, .. })), "{first:?}");
    assert!(!WENT_ON.load(Ordering::SeqCst), "the body went on beside the new owner");
    assert_eq!(
        STORE.complete(&key, token, Duration::from_secs(60), None).await.unwrap(),
        Transition::Applied
    );
}
