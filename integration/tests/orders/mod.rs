//! The order stream every broker test publishes and consumes: 2,000 messages for
//! 1,600 orders (every fifth message redelivers an earlier order), some orders flaky
//! once, some rejected for good, and a world that records each order's effect.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::Mutex;

use idempotent::Classify;

/// Distinct orders.
pub const UNIQUE: u64 = 1_600;
/// Messages published: 20% are duplicates of earlier orders.
pub const PUBLISHED: u64 = 2_000;

#[derive(Debug, thiserror::Error, Classify)]
pub enum Fault {
    #[error("database timed out")]
    #[idempotent(retryable)]
    Flaky,
    #[error("order rejected")]
    #[idempotent(terminal)]
    Rejected,
}

/// Orders that fail for good: they must end up dead-lettered, never taking effect.
pub fn rejected(id: u64) -> bool {
    id % 100 == 13
}

/// Orders whose first attempt times out: they must be retried and take effect once.
pub fn flaky(id: u64) -> bool {
    id % 50 == 7
}

/// The order id of each published message, in publishing order.
pub fn published() -> Vec<u64> {
    let mut next = 0;
    let ids: Vec<u64> = (0..PUBLISHED)
        .map(|i| {
            if i % 5 == 4 {
                (i * 7) % next
            } else {
                next += 1;
                next - 1
            }
        })
        .collect();
    assert_eq!(next, UNIQUE);
    ids
}

/// A message body for order `id`.
pub fn body(id: u64) -> String {
    format!(r#"{{"id":{id},"amount_cents":{}}}"#, 100 + id)
}

/// The order id in a message body.
pub fn order_id(body: &[u8]) -> u64 {
    let value: idempotent::serde_json::Value = idempotent::serde_json::from_slice(body).unwrap();
    value["id"].as_u64().unwrap()
}

/// What the handlers did.
#[derive(Default)]
pub struct World {
    /// How many times each order took effect.
    pub effects: Mutex<HashMap<u64, u32>>,
    /// How many times each order's handler started.
    pub starts: Mutex<HashMap<u64, u32>>,
    /// Told when a doomed consumer hangs mid-handler.
    pub hung: tokio::sync::Notify,
}

impl World {
    /// The handler body: fails rejected orders, fails flaky ones once, then takes
    /// effect. `doomed`: once 300 orders took effect, hang before the effect, to be
    /// killed there. (A kill between an effect and its DONE record would run the
    /// effect again after the lease: only a transaction spanning both closes that.)
    pub async fn process(&self, id: u64, doomed: bool) -> Result<(), Fault> {
        let start = {
            let mut starts = self.starts.lock().unwrap();
            let n = starts.entry(id).or_default();
            *n += 1;
            *n
        };
        if rejected(id) {
            return Err(Fault::Rejected);
        }
        if flaky(id) && start == 1 {
            return Err(Fault::Flaky);
        }
        if doomed && self.effects.lock().unwrap().len() >= 300 {
            self.hung.notify_one();
            std::future::pending::<()>().await;
        }
        *self.effects.lock().unwrap().entry(id).or_default() += 1;
        Ok(())
    }

    /// How many orders must take effect.
    pub fn expected() -> usize {
        (0..UNIQUE).filter(|&id| !rejected(id)).count()
    }

    /// Every good order took effect exactly once, no rejected one did, and every flaky
    /// one was retried.
    pub fn assert_exactly_once(&self) {
        let effects = self.effects.lock().unwrap();
        for id in 0..UNIQUE {
            let want = if rejected(id) { None } else { Some(&1) };
            assert_eq!(effects.get(&id), want, "order {id}");
        }
        let starts = self.starts.lock().unwrap();
        assert!(
            (0..UNIQUE).filter(|&id| flaky(id)).all(|id| starts[&id] >= 2),
            "flaky ones retried"
        );
    }

    /// The orders that must be dead-lettered.
    pub fn rejected_orders() -> std::collections::HashSet<u64> {
        (0..UNIQUE).filter(|&id| rejected(id)).collect()
    }
}

/// Called with a handler's result just before the consumer settles the delivery: if
/// it is about to be acked, the order's record must already be DONE or FAILED in
/// `store` (claiming a recorded key changes nothing). Counts the acks in `acked`.
pub async fn check_recorded_before_ack<S, R>(
    store: &S,
    namespace: &str,
    id: u64,
    result: &R,
    acked: &Mutex<usize>,
) where
    S: idempotent::Store + ?Sized,
    R: idempotent::DispositionExt,
{
    use idempotent::testing::{LEASE, TTL};
    use idempotent::{Claim, Disposition, Key};
    if result.disposition() != Disposition::Ack {
        return;
    }
    let key = Key::new(namespace, id.to_string()).unwrap();
    let claim = store.claim(&key, LEASE, TTL, None).await.unwrap();
    assert!(
        matches!(claim, Claim::Done | Claim::Failed { .. }),
        "acked order {id} unrecorded: {claim:?}"
    );
    *acked.lock().unwrap() += 1;
}
