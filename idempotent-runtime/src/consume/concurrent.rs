//! The settle loop the consumers share: up to n deliveries in flight, each settled
//! as soon as its handler call returns.

use std::collections::hash_map::Entry;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::future::Future;
use std::time::Duration;

use futures_util::future::Either;
use futures_util::stream::{FuturesUnordered, Stream, StreamExt as _};
use tokio::time::Instant;

use super::{Answer, deadline_after};
use crate::metrics::ConsumerMeter;
use crate::{Disposition, DispositionExt};

/// Reads deliveries from `deliveries` while fewer than `concurrency` are in hand,
/// starts `call` on each, and settles each with `settle` once its call returns; calls
/// and settles overlap. Returns when the deliveries end and every one taken is
/// settled, or with the first error of the stream or of a settle: then it takes no
/// more deliveries, lets the calls in flight return and settles them (a handler cut
/// off between its effect and its record would run the effect again on the
/// redelivery), and drops the deliveries waiting for a second call unsettled, as
/// they are when the returned future is dropped: each broker's delivery type says
/// what that means. Errors after the first are logged.
///
/// A call that answers `InProgress` while other calls of this loop ran may have met
/// another delivery of the same key in this consumer: it is called once more when
/// every call that had started before it answered has returned (its key is then
/// settled, or held by another consumer), and that second answer settles it. So a
/// key delivered twice close together settles both deliveries in one pass instead of
/// leaving one for a redelivery.
///
/// It waits for those calls at most `patience` (the consumer's retry delay: a
/// redelivery would bring it back by then anyway); then it is settled by its first
/// answer. Otherwise one call that takes long, or never returns, would hold every
/// delivery met `InProgress` after it, and once those fill the `concurrency` slots
/// (or the broker's limit of unsettled deliveries), the whole consumer.
///
/// Deliveries of one `lane` (`Some`) run one after the other, in the order they were
/// read: each starts once the one before it is settled, and a Retry drops the lane's
/// deliveries not yet started, unsettled (the broker hands them out again after the
/// retried one). Deliveries of no lane (`None`) run as they come.
///
/// When `stop` resolves (a graceful shutdown), it takes no more deliveries and
/// finishes those in hand as it would have (the calls in flight, the deliveries
/// queued behind them in their lanes, those waiting for a second call), settles them,
/// and answers `Ok`: a delivery in hand left unsettled would keep a Kafka commit below
/// the records settled after it, which the next owner would then run again. What is
/// still running or waiting `stop.grace` after the stop is dropped then (claims
/// released, deliveries unsettled, as when the returned future is dropped).
///
/// `meter` counts the deliveries taken, settled and let go.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn settle_concurrently<D, E, S, L, C, CF, R, T, TF, X, G>(
    deliveries: S,
    concurrency: usize,
    patience: Duration,
    meter: &ConsumerMeter,
    stop: Stop<G>,
    lane: L,
    mut call: C,
    mut settle: T,
) -> Result<(), E>
where
    G: Future<Output = ()>,
    S: Stream<Item = Result<D, E>>,
    L: Fn(&D) -> Option<u64>,
    C: FnMut(&D) -> CF,
    CF: Future<Output = R>,
    R: DispositionExt,
    T: FnMut(D, Answer) -> TF,
    TF: Future<Output = Result<X, E>>,
    X: SettledAs,
{
    let concurrency = concurrency.max(1);
    let mut deliveries = std::pin::pin!(deliveries.fuse());
    let mut work = FuturesUnordered::new();
    // Sequence numbers of the calls running, and calls waiting to run again once the
    // calls started before the given number have returned (or, past the given
    // instant, to be settled by their first answer).
    let mut calls = Calls::default();
    let mut waiting: Vec<Waiting<D>> = Vec::new();
    // Per lane with a delivery in hand, the deliveries read after it, not started.
    let mut lanes: HashMap<u64, VecDeque<D>> = HashMap::new();
    let mut queued = 0;
    let mut ended = false;
    let mut failed: Option<E> = None;
    let mut signal = std::pin::pin!(futures_util::FutureExt::fuse(stop.signal));
    // Once stopped: when the calls still running are dropped.
    let mut stopped: Option<Instant> = None;
    let mut finish = |delivery: D, answer: Answer| {
        let lane = lane(&delivery);
        Either::Right(settling(lane, answer.disposition, settle(delivery, answer)))
    };
    let mut start = |delivery: D, again: bool, calls: &mut Calls| {
        calls.started += 1;
        let seq = calls.started;
        calls.running.insert(seq);
        let result = call(&delivery);
        Either::Left(async move {
            let answer = Answer::of(&result.await);
            Step::Called { seq, delivery, answer, again }
        })
    };
    loop {
        let oldest = calls.running.first().copied();
        let now = Instant::now();
        let mut index = 0;
        while index < waiting.len() {
            if oldest.is_none_or(|oldest| oldest > waiting[index].after) {
                let Waiting { delivery, .. } = waiting.swap_remove(index);
                work.push(start(delivery, true, &mut calls));
            } else if waiting[index].until <= now {
                let Waiting { delivery, first, .. } = waiting.swap_remove(index);
                work.push(finish(delivery, first));
            } else {
                index += 1;
            }
        }
        if failed.is_some() {
            meter.let_go(waiting.len() + queued);
            waiting.clear();
            lanes.values_mut().for_each(VecDeque::clear);
            queued = 0;
        }
        let patience_over = waiting.iter().map(|w| w.until).min();
        if ended && work.is_empty() && waiting.is_empty() {
            return failed.map_or(Ok(()), Err);
        }
        if stopped.is_some_and(|at| at <= now) {
            meter.let_go(work.len() + waiting.len() + queued);
            tracing::warn!(
                calls = work.len() + waiting.len() + queued,
                grace = ?stop.grace,
                "deliveries still in hand when the shutdown's grace period ended were dropped: \
                 the claims of their calls are released and the deliveries come again"
            );
            return failed.map_or(Ok(()), Err);
        }
        let room = work.len() + waiting.len() + queued < concurrency;
        let grace_over = stopped.unwrap_or(now);
        tokio::select! {
            () = &mut signal, if stopped.is_none() => {
                ended = true;
                stopped = Some(super::deadline_after(stop.grace));
            }
            () = tokio::time::sleep_until(grace_over), if stopped.is_some() => {}
            next = deliveries.next(), if room && !ended => match next {
                Some(Ok(delivery)) => {
                    meter.taken(1);
                    match lane(&delivery).map(|l| lanes.entry(l)) {
                        Some(Entry::Occupied(mut behind)) => {
                            behind.get_mut().push_back(delivery);
                            queued += 1;
                        }
                        Some(Entry::Vacant(free)) => {
                            free.insert(VecDeque::new());
                            work.push(start(delivery, false, &mut calls));
                        }
                        None => work.push(start(delivery, false, &mut calls)),
                    }
                }
                Some(Err(error)) => {
                    failed = Some(error);
                    ended = true;
                }
                None => ended = true,
            },
            Some(step) = work.next(), if !work.is_empty() => match step {
                Step::Called { seq, delivery, answer, again } => {
                    calls.running.remove(&seq);
                    if answer.in_progress && !again && concurrency > 1 && failed.is_none() {
                        let until = deadline_after(patience);
                        waiting.push(Waiting { after: calls.started, until, first: answer, delivery });
                    } else {
                        work.push(finish(delivery, answer));
                    }
                }
                Step::Settled { lane, disposition, result } => {
                    match &result {
                        Ok(done) => meter.settled(*done),
                        Err(_) => meter.let_go(1),
                    }
                    if let Err(error) = result {
                        if failed.is_none() {
                            failed = Some(error);
                            ended = true;
                        } else {
                            tracing::warn!("settling a delivery failed after an earlier error");
                        }
                    }
                    if let Some(Entry::Occupied(mut behind)) = lane.map(|l| lanes.entry(l)) {
                        if disposition == Disposition::Retry || failed.is_some() {
                            meter.let_go(behind.get().len());
                            queued -= behind.get().len();
                            behind.get_mut().clear();
                        }
                        match behind.get_mut().pop_front() {
                            Some(next) => {
                                queued -= 1;
                                work.push(start(next, false, &mut calls));
                            }
                            None => {
                                behind.remove();
                            }
                        }
                    }
                }
            },
            () = tokio::time::sleep_until(patience_over.unwrap_or(now)), if patience_over.is_some() => {}
        }
    }
}

/// A graceful shutdown for [`settle_concurrently`]: `signal` resolves to stop, and
/// the calls in flight then have `grace` to return.
pub(crate) struct Stop<G> {
    pub(crate) signal: G,
    pub(crate) grace: Duration,
}

#[cfg(test)]
impl Stop<std::future::Pending<()>> {
    /// No shutdown: the loop runs until its deliveries end or fail.
    pub(crate) fn never() -> Self {
        Stop { signal: std::future::pending(), grace: Duration::ZERO }
    }
}

/// A settle, as a step of the loop.
async fn settling<D, E, X: SettledAs>(
    lane: Option<u64>,
    disposition: Disposition,
    settled: impl Future<Output = Result<X, E>>,
) -> Step<D, E> {
    let result = settled.await.map(|done| done.settled_as(disposition));
    Step::Settled { lane, disposition, result }
}

/// What a settle answers: how the delivery was settled in the end.
pub(crate) trait SettledAs {
    /// The disposition carried out, for a delivery whose call answered `asked`.
    fn settled_as(&self, asked: Disposition) -> Disposition;
}

/// As the call answered.
impl SettledAs for () {
    fn settled_as(&self, asked: Disposition) -> Disposition {
        asked
    }
}

/// As the settle says (NATS dead-letters a retry at its last delivery).
impl SettledAs for Disposition {
    fn settled_as(&self, _: Disposition) -> Disposition {
        *self
    }
}

/// A delivery whose call answered `InProgress`, waiting to be called again.
struct Waiting<D> {
    /// Called again once every call up to this sequence number has returned...
    after: u64,
    /// ... or, at this instant, settled by its first answer.
    until: Instant,
    first: Answer,
    delivery: D,
}

/// The calls started so far, and those still running, by sequence number.
#[derive(Default)]
struct Calls {
    started: u64,
    running: BTreeSet<u64>,
}

enum Step<D, E> {
    Called {
        seq: u64,
        delivery: D,
        answer: Answer,
        again: bool,
    },
    /// `disposition` as the call answered; `result` as the settle carried it out.
    Settled {
        lane: Option<u64>,
        disposition: Disposition,
        result: Result<Disposition, E>,
    },
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::collections::HashMap;
    use std::rc::Rc;
    use std::time::Duration;

    use super::*;

    fn answer(disposition: Disposition, in_progress: bool) -> Answer {
        Answer { disposition, retry_delay: None, in_progress }
    }

    /// The tests' calls answer directly.
    impl DispositionExt for Answer {
        fn disposition(&self) -> Disposition {
            self.disposition
        }

        fn is_in_progress(&self) -> bool {
            self.in_progress
        }
    }

    /// A key claimed by a call until it returns; a second call meeting it answers
    /// `InProgress` (as the store would), and a call meeting a settled key acks.
    #[derive(Default)]
    struct Keys {
        held: HashMap<u32, ()>,
        done: HashMap<u32, u32>,
        in_flight: usize,
        most_in_flight: usize,
        settled: Vec<(u32, Disposition)>,
        /// Keys whose call never returns.
        hung: Vec<u32>,
    }

    async fn run(
        deliveries: Vec<u32>,
        concurrency: usize,
        keys: Rc<RefCell<Keys>>,
        fail_settle_of: Option<u32>,
    ) -> Result<(), &'static str> {
        run_until(deliveries, concurrency, keys, fail_settle_of, Stop::never()).await
    }

    async fn run_until(
        deliveries: Vec<u32>,
        concurrency: usize,
        keys: Rc<RefCell<Keys>>,
        fail_settle_of: Option<u32>,
        stop: Stop<impl Future<Output = ()>>,
    ) -> Result<(), &'static str> {
        let stream = futures_util::stream::iter(deliveries.into_iter().map(Ok));
        let call = |&key: &u32| {
            let keys = keys.clone();
            async move {
                {
                    let mut k = keys.borrow_mut();
                    k.in_flight += 1;
                    k.most_in_flight = k.most_in_flight.max(k.in_flight);
                    if k.done.contains_key(&key) {
                        k.in_flight -= 1;
                        return answer(Disposition::Ack, false);
                    }
                    if k.held.insert(key, ()).is_some() {
                        k.in_flight -= 1;
                        return answer(Disposition::Retry, true);
                    }
                }
                if keys.borrow().hung.contains(&key) {
                    std::future::pending::<()>().await;
                }
                tokio::time::sleep(Duration::from_millis(10 + u64::from(key % 7))).await;
                let mut k = keys.borrow_mut();
                k.held.remove(&key);
                *k.done.entry(key).or_default() += 1;
                k.in_flight -= 1;
                answer(Disposition::Ack, false)
            }
        };
        let settle = |key: u32, answer: Answer| {
            let keys = keys.clone();
            async move {
                if fail_settle_of == Some(key) {
                    return Err("settle failed");
                }
                keys.borrow_mut().settled.push((key, answer.disposition));
                Ok(())
            }
        };
        let meter = ConsumerMeter::new("test", "stream");
        settle_concurrently(
            stream,
            concurrency,
            Duration::from_secs(1),
            &meter,
            stop,
            |_| None,
            call,
            settle,
        )
        .await
    }

    #[tokio::test(start_paused = true)]
    async fn every_delivery_settles_with_at_most_n_calls_in_flight() {
        for concurrency in [1, 4, 32] {
            let keys = Rc::new(RefCell::new(Keys::default()));
            run((0..200).collect(), concurrency, keys.clone(), None).await.unwrap();
            let keys = keys.borrow();
            assert_eq!(keys.settled.len(), 200);
            assert!(keys.settled.iter().all(|&(_, d)| d == Disposition::Ack));
            assert_eq!(keys.most_in_flight, concurrency.min(200));
        }
    }

    /// Two deliveries of one key in flight together: the second meets the first's
    /// claim, is called again once the first returned, and acks as a duplicate; the
    /// key takes effect once and nothing is left for a redelivery.
    #[tokio::test(start_paused = true)]
    async fn a_key_met_in_progress_here_is_called_again_after_the_holder() {
        let keys = Rc::new(RefCell::new(Keys::default()));
        let deliveries = vec![1, 2, 1, 3, 1, 4, 2];
        run(deliveries, 8, keys.clone(), None).await.unwrap();
        let keys = keys.borrow();
        assert_eq!(keys.settled.len(), 7);
        assert!(keys.settled.iter().all(|&(_, d)| d == Disposition::Ack), "{:?}", keys.settled);
        assert!(keys.done.values().all(|&n| n == 1));
    }

    /// At concurrency 1 nothing else runs, so `InProgress` means another consumer:
    /// settled as it is.
    #[tokio::test(start_paused = true)]
    async fn alone_an_in_progress_answer_is_settled_as_it_is() {
        let keys = Rc::new(RefCell::new(Keys::default()));
        keys.borrow_mut().held.insert(5, ());
        run(vec![5], 1, keys.clone(), None).await.unwrap();
        assert_eq!(keys.borrow().settled, vec![(5, Disposition::Retry)]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_settle_stops_the_loop_with_its_error() {
        let keys = Rc::new(RefCell::new(Keys::default()));
        let stopped = run((0..100).collect(), 4, keys.clone(), Some(10)).await;
        assert_eq!(stopped, Err("settle failed"));
        assert!(keys.borrow().settled.len() < 100);
    }

    /// One call hangs (a handler stuck on a dependency) while a delivery meets a key
    /// another consumer holds. That delivery must not wait for the hung call before
    /// it is settled, nor keep the loop from taking the next deliveries: without the
    /// rerun, it would have been settled at once and the other slots kept working.
    #[tokio::test(start_paused = true)]
    async fn a_hung_call_does_not_stall_deliveries_met_in_progress() {
        let keys = Rc::new(RefCell::new(Keys::default()));
        keys.borrow_mut().hung.push(99);
        keys.borrow_mut().held.insert(5, ());
        let deliveries = vec![99, 5, 1, 2, 3];
        let ran =
            tokio::time::timeout(Duration::from_secs(60), run(deliveries, 2, keys.clone(), None));
        assert!(ran.await.is_err(), "the hung call returned");
        let mut settled = keys.borrow().settled.clone();
        settled.sort_by_key(|&(key, _)| key);
        assert_eq!(
            settled,
            vec![
                (1, Disposition::Ack),
                (2, Disposition::Ack),
                (3, Disposition::Ack),
                (5, Disposition::Retry)
            ],
            "deliveries stuck behind the hung call"
        );
    }

    /// A settle fails while other calls are in flight. Those calls are not cancelled
    /// halfway (a handler cut between its effect and its record runs the effect again
    /// on the redelivery): the loop takes no more deliveries, lets the calls started
    /// return and settles them, then answers the error.
    #[tokio::test(start_paused = true)]
    async fn a_failed_settle_lets_the_calls_in_flight_finish() {
        let keys = Rc::new(RefCell::new(Keys::default()));
        // Key 0's call returns first (10 ms); 1 to 6 take 11 to 16 ms.
        let stopped = run((0..100).collect(), 8, keys.clone(), Some(0)).await;
        assert_eq!(stopped, Err("settle failed"));
        let keys = keys.borrow();
        assert_eq!(keys.in_flight, 0, "calls were cut off halfway");
        let mut settled: Vec<u32> = keys.settled.iter().map(|&(key, _)| key).collect();
        settled.sort();
        assert_eq!(settled, (1..8).collect::<Vec<_>>(), "the calls in flight were not settled");
    }

    /// Deliveries of one lane run one at a time, in the order read, while other lanes
    /// run beside them; a Retry drops the lane's deliveries not yet started, unsettled,
    /// and the lane goes on with the next ones read.
    #[tokio::test(start_paused = true)]
    async fn a_lane_runs_in_order_and_a_retry_drops_what_waits_behind_it() {
        // (lane, number): lane 0's second delivery is retried.
        let deliveries: Vec<(u64, u32)> =
            vec![(0, 1), (1, 1), (0, 2), (0, 3), (1, 2), (2, 1), (1, 3)];
        let running = RefCell::new(HashMap::<u64, u32>::new());
        let started = RefCell::new(Vec::new());
        let settled = RefCell::new(Vec::new());
        let dropped = Rc::new(RefCell::new(Vec::new()));
        struct Delivery((u64, u32), Rc<RefCell<Vec<(u64, u32)>>>, bool);
        impl Drop for Delivery {
            fn drop(&mut self) {
                if !self.2 {
                    self.1.borrow_mut().push(self.0);
                }
            }
        }
        let stream = futures_util::stream::iter(
            deliveries.into_iter().map(|d| Ok::<_, ()>(Delivery(d, dropped.clone(), false))),
        );
        let call = |d: &Delivery| {
            let ((lane, n), running, started) = (d.0, &running, &started);
            async move {
                assert!(running.borrow_mut().insert(lane, n).is_none(), "lane {lane} ran twice");
                started.borrow_mut().push((lane, n));
                tokio::time::sleep(Duration::from_millis(10)).await;
                running.borrow_mut().remove(&lane);
                let disposition =
                    if (lane, n) == (0, 2) { Disposition::Retry } else { Disposition::Ack };
                answer(disposition, false)
            }
        };
        let settle = |mut d: Delivery, answer: Answer| {
            d.2 = true;
            settled.borrow_mut().push((d.0, answer.disposition));
            async { Ok::<_, ()>(()) }
        };
        let meter = ConsumerMeter::new("test", "stream");
        settle_concurrently(
            stream,
            8,
            Duration::from_secs(1),
            &meter,
            Stop::never(),
            |d| Some(d.0.0),
            call,
            settle,
        )
        .await
        .unwrap();
        let started = started.into_inner();
        for lane in 0..3 {
            let order: Vec<u32> =
                started.iter().filter(|(l, _)| *l == lane).map(|&(_, n)| n).collect();
            assert!(order.windows(2).all(|w| w[0] < w[1]), "lane {lane} out of order: {order:?}");
        }
        assert_eq!(*dropped.borrow(), vec![(0, 3)], "what waited behind the retry is dropped");
        assert_eq!(settled.borrow().len(), 6);
        assert!(settled.borrow().contains(&((0, 2), Disposition::Retry)));
        assert!(started.contains(&(1, 1)) && started.contains(&(2, 1)));
    }

    /// A graceful stop while calls are in flight: none is cut off, each is settled,
    /// nothing more is taken, and the loop answers `Ok`.
    #[tokio::test(start_paused = true)]
    async fn a_stop_lets_the_calls_in_flight_finish_and_takes_no_more() {
        let keys = Rc::new(RefCell::new(Keys::default()));
        let signal = tokio::time::sleep(Duration::from_millis(25));
        let stop = Stop { signal, grace: Duration::from_secs(30) };
        run_until((0..100).collect(), 4, keys.clone(), None, stop).await.unwrap();
        let keys = keys.borrow();
        assert_eq!(keys.in_flight, 0, "calls were cut off halfway");
        let settled = keys.settled.len();
        assert!((4..100).contains(&settled), "{settled} settled: the stop took no effect");
        assert_eq!(keys.done.len(), settled, "a call returned but was not settled");
    }

    /// A call that outlasts the grace period is dropped then, and the loop answers.
    #[tokio::test(start_paused = true)]
    async fn a_call_that_outlasts_the_grace_period_is_dropped() {
        let keys = Rc::new(RefCell::new(Keys::default()));
        keys.borrow_mut().hung.push(0);
        let signal = tokio::time::sleep(Duration::from_millis(5));
        let stop = Stop { signal, grace: Duration::from_secs(2) };
        let started = Instant::now();
        run_until((0..10).collect(), 2, keys.clone(), None, stop).await.unwrap();
        let waited = started.elapsed();
        assert!(waited >= Duration::from_secs(2) && waited < Duration::from_secs(3), "{waited:?}");
        assert!(!keys.borrow().settled.iter().any(|&(key, _)| key == 0));
    }
}
