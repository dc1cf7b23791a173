//! Dropping a future at each of its await points in turn.

use std::future::Future;
use std::pin::pin;
use std::task::Poll;

/// Polls `future` until it has answered `Pending` `pending` times, then drops it
/// (`None`), or returns its output if it finishes first. Each `Pending` is an await
/// point (mostly a round trip to a server), so running this with 1, 2, 3, ... drops a
/// call at every one of its awaits in turn.
pub async fn drop_after_pending<F: Future>(future: F, pending: usize) -> Option<F::Output> {
    let mut future = pin!(future);
    let mut left = pending;
    std::future::poll_fn(|cx| match future.as_mut().poll(cx) {
        Poll::Ready(output) => Poll::Ready(Some(output)),
        Poll::Pending if left <= 1 => Poll::Ready(None),
        Poll::Pending => {
            left -= 1;
            Poll::Pending
        }
    })
    .await
}
