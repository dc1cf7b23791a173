//! `NoStore`: keeps no records.

use std::time::Duration;

use async_trait::async_trait;

use crate::{Claim, Fingerprint, Key, Store, StoreError, Token, Transition};

/// Keeps no records: every claim wins and every transition applies.
///
/// For handlers whose guard is the business state itself: "only an UNPAID order may
/// be paid" checked and changed in one statement, a unique constraint on the effect's
/// own row, a version column. `#[idempotent]` then still gives the handler its key in
/// logs, error classes and dispositions, panic safety and alerts, but deduplicates
/// nothing: a redelivered message runs again, and the guard must turn it away (answer
/// with an error marked `#[idempotent(duplicate)]` to ack it as a duplicate).
///
/// Without records, the attempt is the broker's delivery count where the consumer
/// loop reports one ([`delivery`](crate::delivery): NATS JetStream, RabbitMQ quorum
/// queues, Redis Streams), so `max_attempts` still dead-letters a message
/// that keeps failing retryably; elsewhere every claim is attempt 1, and only the
/// broker can bound redeliveries (`max_deliver` on a NATS JetStream consumer, which
/// `NatsConsumer` dead-letters at; `x-delivery-limit` on a RabbitMQ quorum queue).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use std::time::Duration;
/// use idempotent_runtime::{Claim, Key, NoStore, Store};
///
/// let key = Key::new("orders", "42").unwrap();
/// let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(600));
/// for _ in 0..2 {
///     let claim = NoStore.claim(&key, lease, ttl, None).await.unwrap();
///     assert!(matches!(claim, Claim::Won { attempt: 1, .. }));
/// }
/// // Inside a consumer loop that knows the broker's delivery count:
/// let third = idempotent_runtime::delivery::with_delivery_count(Some(3), async {
///     NoStore.claim(&key, lease, ttl, None).await.unwrap()
/// });
/// assert!(matches!(third.await, Claim::Won { attempt: 3, .. }));
/// # }
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct NoStore;

#[async_trait]
impl Store for NoStore {
    async fn claim(
        &self,
        _: &Key,
        _: Duration,
        _: Duration,
        _: Option<&Fingerprint>,
    ) -> Result<Claim, StoreError> {
        let attempt = crate::delivery::delivery_count().unwrap_or(1).max(1);
        Ok(Claim::Won { token: Token::random(), attempt, fence: None })
    }

    async fn complete(
        &self,
        _: &Key,
        _: Token,
        _: Duration,
        _: Option<&[u8]>,
    ) -> Result<Transition, StoreError> {
        Ok(Transition::Applied)
    }

    async fn release(&self, _: &Key, _: Token) -> Result<Transition, StoreError> {
        Ok(Transition::Applied)
    }

    async fn fail(&self, _: &Key, _: Token, _: Duration) -> Result<Transition, StoreError> {
        Ok(Transition::Applied)
    }

    async fn renew(
        &self,
        _: &Key,
        _: Token,
        _: Duration,
        _: Duration,
    ) -> Result<Transition, StoreError> {
        Ok(Transition::Applied)
    }
}
