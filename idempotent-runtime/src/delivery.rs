//! The broker's count of deliveries of the message being handled, for stores that
//! keep no attempt count of their own ([`NoStore`](crate::NoStore)).
//!
//! The consumer loops in `consume` run each handler call inside
//! [`with_delivery_count`] when their broker reports the count: NATS JetStream always
//! (the message's `delivered`), RabbitMQ on quorum queues (`x-delivery-count`, plus
//! one) and for first deliveries, Redis Streams (the pending list's count). Kafka
//! keeps no count. A hand-written consumer can do the same.

use std::cell::Cell;
use std::future::Future;
use std::pin::pin;
use std::task::Poll;

thread_local! {
    static COUNT: Cell<Option<u32>> = const { Cell::new(None) };
}

/// Runs `call` with `count` as the delivery count that [`delivery_count`] reports
/// while it is polled (not in tasks it spawns).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use idempotent_runtime::delivery::{delivery_count, with_delivery_count};
///
/// assert_eq!(with_delivery_count(Some(3), async { delivery_count() }).await, Some(3));
/// assert_eq!(delivery_count(), None);
/// # }
/// ```
pub async fn with_delivery_count<F: Future>(count: Option<u32>, call: F) -> F::Output {
    let mut call = pin!(call);
    std::future::poll_fn(|cx| {
        let _restore = Restore(COUNT.replace(count));
        match call.as_mut().poll(cx) {
            Poll::Ready(output) => Poll::Ready(output),
            Poll::Pending => Poll::Pending,
        }
    })
    .await
}

/// The delivery count [`with_delivery_count`] set for the call being polled, if any:
/// 1 for a first delivery.
pub fn delivery_count() -> Option<u32> {
    COUNT.get()
}

/// Puts the outer count back, also when the poll panics.
struct Restore(Option<u32>);

impl Drop for Restore {
    fn drop(&mut self) {
        COUNT.set(self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_count_holds_across_awaits_and_nests() {
        let inner = with_delivery_count(Some(2), async {
            tokio::task::yield_now().await;
            let nested = with_delivery_count(Some(7), async { delivery_count() }).await;
            (delivery_count(), nested)
        });
        assert_eq!(inner.await, (Some(2), Some(7)));
        assert_eq!(delivery_count(), None);
    }

    #[tokio::test]
    async fn a_panicking_poll_leaves_no_count_behind() {
        let call = with_delivery_count(Some(4), async { panic!("handler bug") });
        let caught = futures_util::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(call));
        assert!(caught.await.is_err());
        assert_eq!(delivery_count(), None);
    }
}
