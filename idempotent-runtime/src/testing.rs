//! The behaviour every [`Store`] must show, as a suite any implementation can run.
//!
//! Each case drives a store through [`run`], the function the
//! `#[idempotent]` expansion calls, and checks one row of the record life cycle (or a
//! concurrency or fencing property). Cases use fresh random namespaces, so they can
//! share one store and one server, and run in parallel. Timing cases use real time
//! with leases of a few hundred milliseconds.
//!
//! To check your own store, enable the `testing` feature and write, in a test file:
//!
//! ```
//! # use idempotent_runtime as idempotent;
//! // `MyStore::connect_for_tests().await` for yours; the expression may `.await`.
//! idempotent::store_suite!(idempotent::MemoryStore::new());
//! ```
//!
//! which expands to one `#[test]` per case (each on its own multi-threaded Tokio
//! runtime), named after the cases in [`CASES`].

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Mutex;

use crate::alert::TerminalEvent;
use crate::execute::{Call, Spec, run};
use crate::{
    Claim, Error, ErrorClass, Fingerprint, Key, Outcome, Store, StoreError, Token, Transition,
};

/// The lease the timing cases use.
pub const LEASE: Duration = Duration::from_millis(300);
/// The ttl the cases use, unless a case is about expiry.
pub const TTL: Duration = Duration::from_secs(60);

/// A handler error whose class the case chooses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} failure")]
pub struct Failure(pub ErrorClass);

impl Failure {
    /// Its class: passed to `run` as the `classify` function. (`Failure` does not
    /// implement `Classify`, so enabling this module changes no trait's impl list.)
    pub fn class(&self) -> ErrorClass {
        self.0
    }
}

/// A fresh key in a namespace no other case uses.
pub fn fresh_key(case: &str) -> Key {
    let namespace = format!("suite-{case}-{:08x}", rand::random::<u32>());
    Key::new(&namespace, "order:42").expect("a valid key")
}

/// Records terminal alerts.
#[derive(Clone, Default)]
pub struct Alerts(Arc<Mutex<Vec<TerminalEvent>>>);

impl Alerts {
    /// The hook to pass as `on_terminal`.
    pub fn hook(
        &self,
    ) -> impl FnOnce(TerminalEvent) -> Pin<Box<dyn Future<Output = ()> + Send>> + use<> {
        let events = self.0.clone();
        move |event| Box::pin(async move { events.lock().await.push(event) })
    }

    /// The alerts so far.
    pub async fn events(&self) -> Vec<TerminalEvent> {
        self.0.lock().await.clone()
    }
}

/// The bulk cases are about atomic claims, not leases: a lease long enough that
/// thousands of queued calls on a loaded machine never outlast it.
const BULK: Spec = Spec::new(TTL, Duration::from_secs(30), 5);

fn spec(max_attempts: u32) -> Spec {
    Spec::new(TTL, LEASE, max_attempts)
}

/// Runs a handler that counts its runs and returns `result`.
async fn call<S: Store + ?Sized>(
    store: &S,
    key: &Key,
    spec: Spec,
    runs: &AtomicU32,
    alerts: &Alerts,
    result: Result<u32, Failure>,
) -> Result<Outcome<u32>, Error<Failure>> {
    run(Call::new(spec, Ok(key.clone())), store, Failure::class, alerts.hook(), async {
        runs.fetch_add(1, Ordering::SeqCst);
        result
    })
    .await
}

async fn claim_state<S: Store + ?Sized>(store: &S, key: &Key) -> Claim {
    store.claim(key, LEASE, TTL, None).await.expect("store reachable")
}

/// First delivery succeeds: `Processed`, record DONE.
pub async fn first_delivery_success<S: Store + ?Sized>(store: &S) {
    let (key, runs, alerts) = (fresh_key("first"), AtomicU32::new(0), Alerts::default());
    let out = call(store, &key, spec(5), &runs, &alerts, Ok(7)).await;
    assert_eq!(out.unwrap(), Outcome::Processed(7));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(claim_state(store, &key).await, Claim::Done, "record must be DONE");
}

/// The same key again within the ttl: `Duplicate`, handler not run.
pub async fn duplicate_within_ttl<S: Store + ?Sized>(store: &S) {
    let (key, runs, alerts) = (fresh_key("dup"), AtomicU32::new(0), Alerts::default());
    let out = call(store, &key, spec(5), &runs, &alerts, Ok(1)).await;
    assert_eq!(out.unwrap(), Outcome::Processed(1));
    for _ in 0..3 {
        let out = call(store, &key, spec(5), &runs, &alerts, Ok(2)).await;
        assert_eq!(out.unwrap(), Outcome::Duplicate);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// The same key while another consumer holds a live claim: `InProgress`, not run.
pub async fn in_progress_elsewhere<S: Store + ?Sized>(store: &S) {
    let (key, runs, alerts) = (fresh_key("busy"), AtomicU32::new(0), Alerts::default());
    let Claim::Won { token, .. } = claim_state(store, &key).await else {
        panic!("a fresh key must be claimable")
    };
    let out = call(store, &key, spec(5), &runs, &alerts, Ok(1)).await;
    // Retry about when the other claim's lease runs out.
    let retry_after = match out.unwrap() {
        Outcome::InProgress { retry_after } => retry_after,
        other => panic!("expected InProgress, got {other:?}"),
    };
    assert!(retry_after > Duration::ZERO && retry_after <= LEASE, "{retry_after:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(store.complete(&key, token, TTL, None).await.unwrap(), Transition::Applied);
}

/// A retryable error releases the key and keeps the attempt count.
pub async fn retryable_error_releases<S: Store + ?Sized>(store: &S) {
    let (key, runs, alerts) = (fresh_key("retry"), AtomicU32::new(0), Alerts::default());
    let err = call(store, &key, spec(5), &runs, &alerts, Err(Failure(ErrorClass::Retryable)))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Retryable { attempt: 1, .. }), "{err:?}");
    assert!(err.is_retryable());
    let Claim::Won { attempt, token, .. } = claim_state(store, &key).await else {
        panic!("a released key must be claimable")
    };
    assert_eq!(attempt, 2, "the attempt count must survive a release");
    let _ = store.release(&key, token).await.unwrap();
    let out = call(store, &key, spec(5), &runs, &alerts, Ok(3)).await;
    assert_eq!(out.unwrap(), Outcome::Processed(3));
    assert!(alerts.events().await.is_empty());
}

/// A retryable error on attempt `max_attempts`: FAILED, terminal (exhausted), alert.
pub async fn retryable_error_on_last_attempt<S: Store + ?Sized>(store: &S) {
    let (key, runs, alerts) = (fresh_key("exhaust"), AtomicU32::new(0), Alerts::default());
    let failure = Err(Failure(ErrorClass::Retryable));
    for attempt in 1..=2 {
        let err = call(store, &key, spec(3), &runs, &alerts, failure.clone()).await.unwrap_err();
        assert!(matches!(err, Error::Retryable { attempt: a, .. } if a == attempt), "{err:?}");
    }
    let err = call(store, &key, spec(3), &runs, &alerts, failure.clone()).await.unwrap_err();
    assert!(matches!(err, Error::Terminal { attempt: 3, exhausted: true, .. }), "{err:?}");
    assert!(err.is_terminal());
    assert_eq!(claim_state(store, &key).await, Claim::Failed { attempts: 3 });
    let events = alerts.events().await;
    assert_eq!(events.len(), 1);
    assert!(events[0].exhausted && events[0].attempt == 3, "{events:?}");
}

/// A terminal error: FAILED, kept, alert; later deliveries are not run.
pub async fn terminal_error_fails<S: Store + ?Sized>(store: &S) {
    let (key, runs, alerts) = (fresh_key("terminal"), AtomicU32::new(0), Alerts::default());
    let err = call(store, &key, spec(5), &runs, &alerts, Err(Failure(ErrorClass::Terminal)))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Terminal { attempt: 1, exhausted: false, .. }), "{err:?}");
    let events = alerts.events().await;
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].namespace, key.namespace());
    assert_eq!(events[0].key, "order:42");
    assert_eq!(events[0].error, "Terminal failure");
    let again = call(store, &key, spec(5), &runs, &alerts, Ok(1)).await.unwrap_err();
    assert!(matches!(again, Error::PreviouslyFailed { attempts: 1 }), "{again:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A handler that finds its effect already applied (`ErrorClass::Duplicate`): the key
/// is DONE, the call answers `Duplicate` (ack), no alert; later deliveries are not run.
pub async fn already_applied_is_done<S: Store + ?Sized>(store: &S) {
    let (key, runs, alerts) = (fresh_key("applied"), AtomicU32::new(0), Alerts::default());
    let out = call(store, &key, spec(5), &runs, &alerts, Err(Failure(ErrorClass::Duplicate)));
    let out = out.await;
    assert_eq!(crate::DispositionExt::disposition(&out), crate::Disposition::Ack);
    assert_eq!(out.unwrap(), Outcome::Duplicate);
    assert_eq!(claim_state(store, &key).await, Claim::Done, "record must be DONE");
    let again = call(store, &key, spec(5), &runs, &alerts, Ok(1)).await;
    assert_eq!(again.unwrap(), Outcome::Duplicate);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert!(alerts.events().await.is_empty(), "no alert for an effect already applied");
}

/// A panicking handler: `Panicked`, key released, panic does not escape.
pub async fn panic_releases<S: Store + ?Sized>(store: &S) {
    let key = fresh_key("panic");
    let alerts = Alerts::default();
    let out =
        run(Call::new(spec(5), Ok(key.clone())), store, Failure::class, alerts.hook(), async {
            if key.id() == b"order:42" {
                panic!("boom");
            }
            Ok::<u32, Failure>(1)
        })
        .await;
    let err = out.unwrap_err();
    assert!(
        matches!(&err, Error::Panicked { message, attempt: 1, exhausted: false, .. } if message == "boom"),
        "{err:?}"
    );
    assert!(err.is_retryable());
    assert!(
        matches!(claim_state(store, &key).await, Claim::Won { attempt: 2, .. }),
        "a panic must release the key"
    );
}

/// A panic on the last allowed attempt fails the key for good, with an alert that says
/// the handler panicked, instead of leaving the next delivery to find it abandoned.
pub async fn panic_on_last_attempt_fails<S: Store + ?Sized>(store: &S) {
    let key = fresh_key("panic-last");
    let alerts = Alerts::default();
    for attempt in 1..=2 {
        let out =
            run(Call::new(spec(2), Ok(key.clone())), store, Failure::class, alerts.hook(), async {
                if key.id() == b"order:42" {
                    panic!("boom");
                }
                Ok::<u32, Failure>(1)
            })
            .await;
        let err = out.unwrap_err();
        let last = attempt == 2;
        assert!(
            matches!(&err, Error::Panicked { attempt: a, exhausted, .. } if *a == attempt && *exhausted == last),
            "{err:?}"
        );
        assert_eq!(err.is_terminal(), last, "{err}");
    }
    assert!(matches!(claim_state(store, &key).await, Claim::Failed { attempts: 2 }));
    let events = alerts.events().await;
    assert_eq!(events.len(), 1, "{events:?}");
    assert!(events[0].exhausted && events[0].error.contains("boom"), "{events:?}");
}

/// The caller drops the future mid-handler: released at once or after the lease.
pub async fn dropped_future_releases<S: Store + ?Sized>(store: &S) {
    let (key, runs, alerts) = (fresh_key("drop"), AtomicU32::new(0), Alerts::default());
    let started = tokio::sync::Notify::new();
    let handler =
        run(Call::new(spec(5), Ok(key.clone())), store, Failure::class, alerts.hook(), async {
            started.notify_one();
            std::future::pending::<Result<u32, Failure>>().await
        });
    tokio::select! {
        _ = handler => panic!("the handler never finishes"),
        _ = started.notified() => {}
    }
    // `handler` is dropped here, mid-way.
    let out = eventually(LEASE * 3, || call(store, &key, spec(5), &runs, &alerts, Ok(5))).await;
    assert_eq!(out, Outcome::Processed(5));
}

/// A consumer that died mid-handler: its claim expires after the lease and the
/// redelivery is processed.
pub async fn dead_consumer_claim_expires<S: Store + ?Sized>(store: &S) {
    let (key, runs, alerts) = (fresh_key("dead"), AtomicU32::new(0), Alerts::default());
    let Claim::Won { .. } = claim_state(store, &key).await else { panic!("fresh key") };
    // Never completed, never renewed: the process "died".
    let out = call(store, &key, spec(5), &runs, &alerts, Ok(1)).await;
    assert!(matches!(out, Ok(Outcome::InProgress { .. })), "{out:?}");
    tokio::time::sleep(LEASE + Duration::from_millis(200)).await;
    let out = call(store, &key, spec(5), &runs, &alerts, Ok(1)).await;
    assert_eq!(out.unwrap(), Outcome::Processed(1));
}

/// A key whose allowed attempts all died mid-handler is failed, not run again.
pub async fn unfinished_attempts_are_capped<S: Store + ?Sized>(store: &S) {
    let (key, runs, alerts) = (fresh_key("crashloop"), AtomicU32::new(0), Alerts::default());
    let short = Duration::from_millis(100);
    for _ in 0..2 {
        assert!(matches!(store.claim(&key, short, TTL, None).await.unwrap(), Claim::Won { .. }));
        tokio::time::sleep(short + Duration::from_millis(100)).await;
    }
    let err = call(store, &key, spec(2), &runs, &alerts, Ok(1)).await.unwrap_err();
    assert!(matches!(err, Error::Abandoned { attempts: 2 }), "{err:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(alerts.events().await.len(), 1);
    assert!(matches!(claim_state(store, &key).await, Claim::Failed { .. }));
}

/// The store is unreachable at claim: `Err(Store)`, handler not run, and the
/// redelivery is processed once the store is back.
pub async fn store_unreachable_at_claim<S: Store + ?Sized>(store: &S) {
    let (key, runs, alerts) = (fresh_key("down"), AtomicU32::new(0), Alerts::default());
    let flaky = Flaky::new(store);
    flaky.down.store(true, Ordering::SeqCst);
    let err = call(&flaky, &key, spec(5), &runs, &alerts, Ok(1)).await.unwrap_err();
    assert!(matches!(err, Error::Store { handler_ran: false, .. }), "{err:?}");
    assert!(err.is_retryable());
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    flaky.down.store(false, Ordering::SeqCst);
    let out = call(&flaky, &key, spec(5), &runs, &alerts, Ok(1)).await;
    assert_eq!(out.unwrap(), Outcome::Processed(1));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// The store fails when the result is recorded: the error says the handler ran.
pub async fn store_fails_after_handler<S: Store + ?Sized>(store: &S) {
    let (key, runs, alerts) = (fresh_key("lost-done"), AtomicU32::new(0), Alerts::default());
    let flaky = Flaky::new(store);
    flaky.down_after_claim.store(true, Ordering::SeqCst);
    let err = call(&flaky, &key, spec(5), &runs, &alerts, Ok(1)).await.unwrap_err();
    assert!(matches!(err, Error::Store { handler_ran: true, .. }), "{err:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Recording DONE fails twice after the handler ran: the fenced complete is tried again
/// within the lease, so the message is DONE instead of run again after the lease.
pub async fn a_failed_completion_is_retried<S: Store + ?Sized>(store: &S) {
    let (key, runs, alerts) = (fresh_key("retry-done"), AtomicU32::new(0), Alerts::default());
    let flaky = Flaky::new(store);
    flaky.failing_completes.store(2, Ordering::SeqCst);
    let out = call(&flaky, &key, spec(5), &runs, &alerts, Ok(1)).await;
    assert_eq!(out.unwrap(), Outcome::Processed(1));
    assert_eq!(claim_state(store, &key).await, Claim::Done);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// After the ttl, a DONE key is forgotten and processed again.
pub async fn ttl_expiry_forgets<S: Store + ?Sized>(store: &S) {
    let (key, runs, alerts) = (fresh_key("ttl"), AtomicU32::new(0), Alerts::default());
    let short = Spec::new(Duration::from_millis(300), Duration::from_millis(300), 5);
    let out = call(store, &key, short, &runs, &alerts, Ok(1)).await;
    assert_eq!(out.unwrap(), Outcome::Processed(1));
    assert_eq!(call(store, &key, short, &runs, &alerts, Ok(1)).await.unwrap(), Outcome::Duplicate);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let out = call(store, &key, short, &runs, &alerts, Ok(2)).await;
    assert_eq!(out.unwrap(), Outcome::Processed(2));
}

/// A consumer whose lease ran out cannot complete, release or fail the claim that
/// took over, and cannot overwrite its record.
pub async fn expired_lease_is_fenced<S: Store + ?Sized>(store: &S) {
    let key = fresh_key("fence");
    let Claim::Won { token: stale, .. } = claim_state(store, &key).await else { panic!() };
    tokio::time::sleep(LEASE + Duration::from_millis(200)).await;
    // The claim that takes over holds a lease long enough to outlast the stale
    // consumer's calls on a loaded machine.
    let held = Duration::from_secs(30);
    let Claim::Won { token: fresh, attempt, .. } =
        store.claim(&key, held, TTL, None).await.unwrap()
    else {
        panic!("an expired lease must be claimable")
    };
    assert_eq!(attempt, 2);
    assert_ne!(stale, fresh);
    assert_eq!(store.renew(&key, stale, LEASE, TTL).await.unwrap(), Transition::LeaseLost);
    assert_eq!(store.release(&key, stale).await.unwrap(), Transition::LeaseLost);
    assert_eq!(store.fail(&key, stale, TTL).await.unwrap(), Transition::LeaseLost);
    assert_eq!(store.complete(&key, stale, TTL, None).await.unwrap(), Transition::LeaseLost);
    let answer = claim_state(store, &key).await;
    assert!(
        matches!(answer, Claim::InProgress { lease_left: Some(left) } if left <= held),
        "the new claim stands, with the lease it has left: {answer:?}"
    );
    assert_eq!(store.complete(&key, fresh, TTL, None).await.unwrap(), Transition::Applied);
    assert_eq!(store.complete(&key, stale, TTL, None).await.unwrap(), Transition::LeaseLost);
    assert_eq!(claim_state(store, &key).await, Claim::Done);
}

/// A claim's fence is larger than that of every earlier claim of its key that won:
/// after a release, a takeover of a lapsed lease and the record's expiry. A store
/// that gives no fence gives none for any claim.
pub async fn fences_grow_with_every_claim<S: Store + ?Sized>(store: &S) {
    let key = fresh_key("fences");
    let short = Duration::from_millis(300);
    let won = |claim: Claim| match claim {
        Claim::Won { token, fence, .. } => (token, fence),
        other => panic!("not won: {other:?}"),
    };
    let (first, f1) = won(store.claim(&key, LEASE, TTL, None).await.unwrap());
    assert_eq!(store.release(&key, first).await.unwrap(), Transition::Applied);
    let (_, f2) = won(store.claim(&key, LEASE, TTL, None).await.unwrap());
    tokio::time::sleep(LEASE + Duration::from_millis(200)).await;
    let (taken, f3) = won(store.claim(&key, short, short, None).await.unwrap());
    assert_eq!(store.complete(&key, taken, short, None).await.unwrap(), Transition::Applied);
    tokio::time::sleep(short * 2).await;
    let (_, f4) = won(store.claim(&key, LEASE, TTL, None).await.unwrap());
    let fences = [f1, f2, f3, f4];
    match fences {
        [None, None, None, None] => {}
        [Some(a), Some(b), Some(c), Some(d)] => {
            assert!(
                a < b && b < c && c < d,
                "fences after a release, a takeover and an expiry: {fences:?}"
            )
        }
        _ => panic!("some claims had a fence and some not: {fences:?}"),
    }
}

/// A handler that stalls past its lease while renewals are impossible gets
/// `LeaseLost`; the consumer that took over keeps its record.
pub async fn late_completion_gets_lease_lost<S: Store + ?Sized>(store: &S) {
    let (key, runs, alerts) = (fresh_key("late"), AtomicU32::new(0), Alerts::default());
    let flaky = Flaky::new(store);
    flaky.refuse_renewals.store(true, Ordering::SeqCst);
    let slow =
        run(Call::new(spec(5), Ok(key.clone())), &flaky, Failure::class, alerts.hook(), async {
            tokio::time::sleep(LEASE * 3).await;
            Ok::<u32, Failure>(1)
        });
    let takeover = async {
        tokio::time::sleep(LEASE + Duration::from_millis(150)).await;
        call(store, &key, spec(5), &runs, &alerts, Ok(2)).await
    };
    let (slow, takeover) = tokio::join!(slow, takeover);
    assert_eq!(takeover.unwrap(), Outcome::Processed(2));
    assert!(matches!(slow, Err(Error::LeaseLost { attempt: 1, .. })), "{slow:?}");
    assert_eq!(claim_state(store, &key).await, Claim::Done);
}

/// A renewal that finds the claim taken by another consumer stops the body at its
/// next await (as a crash would): it must not go on beside the new owner. The call
/// reports `LeaseLost`, records nothing and sends no alert.
pub async fn lost_lease_stops_the_body<S: Store + ?Sized>(store: &S) {
    let (key, runs, alerts) = (fresh_key("lost-stop"), AtomicU32::new(0), Alerts::default());
    let flaky = Flaky::new(store);
    flaky.refuse_renewals.store(true, Ordering::SeqCst);
    let went_on = AtomicBool::new(false);
    let slow =
        run(Call::new(spec(5), Ok(key.clone())), &flaky, Failure::class, alerts.hook(), async {
            tokio::time::sleep(LEASE * 4).await;
            went_on.store(true, Ordering::SeqCst);
            Err::<u32, _>(Failure(ErrorClass::Terminal))
        });
    let takeover = async {
        tokio::time::sleep(LEASE + Duration::from_millis(150)).await;
        let done = call(store, &key, spec(5), &runs, &alerts, Ok(2)).await;
        // The store answers renewals again: the next one finds the claim gone.
        flaky.refuse_renewals.store(false, Ordering::SeqCst);
        done
    };
    let (slow, takeover) = tokio::join!(slow, takeover);
    assert_eq!(takeover.unwrap(), Outcome::Processed(2));
    assert!(matches!(slow, Err(Error::LeaseLost { attempt: 1, .. })), "{slow:?}");
    assert!(!went_on.load(Ordering::SeqCst), "the body went on after its lease was lost");
    assert!(alerts.events().await.is_empty(), "an alert for a key another consumer completed");
    assert_eq!(claim_state(store, &key).await, Claim::Done);
}

/// A call left unpolled for longer than its lease (its task starved by blocking code,
/// its process stopped) whose key another consumer took meanwhile is stopped when it
/// is polled again: the renewal that was due answers before the body goes on, rather
/// than the body running to its end after the other consumer's run.
pub async fn unpolled_call_is_stopped_when_resumed<S: Store + ?Sized>(store: &S) {
    let (key, alerts) = (fresh_key("unpolled"), Alerts::default());
    let (started, went_on) = (AtomicBool::new(false), AtomicBool::new(false));
    let slow =
        run(Call::new(spec(5), Ok(key.clone())), store, Failure::class, alerts.hook(), async {
            started.store(true, Ordering::SeqCst);
            tokio::time::sleep(LEASE / 2).await;
            went_on.store(true, Ordering::SeqCst);
            Ok::<u32, Failure>(1)
        });
    let mut slow = std::pin::pin!(slow);
    poll_until_started(slow.as_mut(), &started).await;
    // Then not polled for two leases, while another consumer takes the key over.
    stopped_after_takeover(store, &key, slow, &went_on).await;
}

/// Polls `call` until its body has `started` (the key is claimed, the body waits).
async fn poll_until_started<F: Future<Output: std::fmt::Debug>>(
    mut call: Pin<&mut F>,
    started: &AtomicBool,
) {
    let claimed = async {
        while !started.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    };
    tokio::select! {
        out = &mut call => panic!("the call ended before its body waited: {out:?}"),
        () = claimed => {}
    }
}

/// Leaves `call` unpolled for two leases while another consumer takes `key` over and
/// runs it; then `call` must end with `LeaseLost`, its body not gone on.
async fn stopped_after_takeover<S: Store + ?Sized, F>(
    store: &S,
    key: &Key,
    call: Pin<&mut F>,
    went_on: &AtomicBool,
) where
    F: Future<Output = Result<Outcome<u32>, Error<Failure>>>,
{
    let (runs, alerts) = (AtomicU32::new(0), Alerts::default());
    tokio::time::sleep(LEASE * 2).await;
    assert_eq!(
        self::call(store, key, spec(5), &runs, &alerts, Ok(2)).await.unwrap(),
        Outcome::Processed(2)
    );
    let late = call.await;
    assert!(matches!(late, Err(Error::LeaseLost { attempt: 1, .. })), "{late:?}");
    assert!(!went_on.load(Ordering::SeqCst), "the body went on after another consumer's run");
    assert_eq!(claim_state(store, key).await, Claim::Done);
}

/// The same after renewals went unanswered: a call whose lease ran out waits while
/// the store cannot answer its renewals, and once the store answers again, a second
/// time unpolled past a lease, it is stopped by the renewal due meanwhile, not polled
/// on beside the consumer that took its key over.
pub async fn unpolled_again_after_failed_renewals_is_stopped<S: Store + ?Sized>(store: &S) {
    let (key, alerts) = (fresh_key("unpolled-again"), Alerts::default());
    let flaky = Flaky::new(store);
    let (started, went_on) = (AtomicBool::new(false), AtomicBool::new(false));
    let slow =
        run(Call::new(spec(5), Ok(key.clone())), &flaky, Failure::class, alerts.hook(), async {
            started.store(true, Ordering::SeqCst);
            tokio::time::sleep(LEASE * 3).await;
            went_on.store(true, Ordering::SeqCst);
            Ok::<u32, Failure>(1)
        });
    let mut slow = std::pin::pin!(slow);
    poll_until_started(slow.as_mut(), &started).await;
    // Not polled past the lease; then polled for a third of one while every renewal
    // fails: the body is not polled meanwhile.
    tokio::time::sleep(LEASE * 3 / 2).await;
    flaky.refuse_renewals.store(true, Ordering::SeqCst);
    tokio::select! {
        out = &mut slow => panic!("the call ended while its body waited: {out:?}"),
        () = tokio::time::sleep(LEASE / 3) => {}
    }
    assert!(flaky.refused.load(Ordering::SeqCst) > 0, "no renewal was sent after the lapse");
    flaky.refuse_renewals.store(false, Ordering::SeqCst);
    // Unpolled for two leases again (the body's wait ends meanwhile), while another
    // consumer takes the key over.
    stopped_after_takeover(store, &key, slow, &went_on).await;
}

/// A call whose store stops answering its renewals (a partition) does not run past
/// its lease: once the lease runs out unconfirmed its body is no longer polled, and it
/// is stopped when no renewal is confirmed for one more lease. The call reports a store
/// error with `handler_ran` (the message is retried), records nothing and gives the key
/// back, so the next delivery runs it at its second attempt.
pub async fn cut_off_call_stops_at_its_lease<S: Store + ?Sized>(store: &S) {
    let (key, alerts) = (fresh_key("cut-off"), Alerts::default());
    let flaky = Flaky::new(store);
    flaky.refuse_renewals.store(true, Ordering::SeqCst);
    let went_on = AtomicBool::new(false);
    let started = tokio::time::Instant::now();
    let out =
        run(Call::new(spec(5), Ok(key.clone())), &flaky, Failure::class, alerts.hook(), async {
            tokio::time::sleep(LEASE + LEASE / 2).await;
            went_on.store(true, Ordering::SeqCst);
            Ok::<u32, Failure>(1)
        })
        .await;
    let took = started.elapsed();
    assert!(matches!(out, Err(Error::Store { handler_ran: true, .. })), "{out:?}");
    assert!(!went_on.load(Ordering::SeqCst), "the body went on past its lease, unconfirmed");
    assert!(took >= LEASE * 2, "stopped after {took:?}, before a lease more than its own");
    assert!(flaky.refused.load(Ordering::SeqCst) > 3, "renewals were not tried meanwhile");
    assert!(alerts.events().await.is_empty(), "an alert for a call that may run again");
    let claim = store.claim(&key, LEASE, TTL, None).await.unwrap();
    assert!(matches!(claim, Claim::Won { attempt: 2, .. }), "not given back: {claim:?}");
}

/// A handler that fails for good after another consumer took its key (renewals were
/// impossible, so nothing told it) reports `LeaseLost`, not `Terminal`: the key is not
/// kept as failed, and no alert goes out for a message the other consumer completed.
/// The same for a retryable error and a panic: the key was not ours to release.
pub async fn lost_lease_failure_is_not_terminal<S: Store + ?Sized>(store: &S) {
    for (case, outcome) in [
        ("lost-terminal", Some(ErrorClass::Terminal)),
        ("lost-retryable", Some(ErrorClass::Retryable)),
        ("lost-panic", None),
    ] {
        let (key, runs, alerts) = (fresh_key(case), AtomicU32::new(0), Alerts::default());
        let flaky = Flaky::new(store);
        flaky.refuse_renewals.store(true, Ordering::SeqCst);
        // The taken-over attempt is the last but one: a retryable error would release.
        let spec = spec(2);
        let slow =
            run(Call::new(spec, Ok(key.clone())), &flaky, Failure::class, alerts.hook(), async {
                tokio::time::sleep(LEASE * 3).await;
                match outcome {
                    Some(class) => Err::<u32, _>(Failure(class)),
                    None => panic!("after the lease was lost"),
                }
            });
        let takeover = async {
            tokio::time::sleep(LEASE + Duration::from_millis(150)).await;
            call(store, &key, spec, &runs, &alerts, Ok(2)).await
        };
        let (slow, takeover) = tokio::join!(slow, takeover);
        assert_eq!(takeover.unwrap(), Outcome::Processed(2), "{case}");
        assert!(matches!(slow, Err(Error::LeaseLost { attempt: 1, .. })), "{case}: {slow:?}");
        assert!(alerts.events().await.is_empty(), "{case}: alert for a key it did not own");
        assert_eq!(claim_state(store, &key).await, Claim::Done, "{case}");
    }
}

/// A claim renewed past its first retention keeps its record, so a consumer that dies
/// after a long run leaves its attempt count behind (a poison message that kills long
/// handlers still reaches `max_attempts`).
pub async fn renewal_extends_retention<S: Store + ?Sized>(store: &S) {
    let key = fresh_key("renew-keep");
    // Kept claim_retention = 600 ms from the claim, unless renewals extend it.
    let (lease, ttl) = (Duration::from_millis(300), Duration::from_millis(300));
    let Claim::Won { token, attempt: 1, .. } = store.claim(&key, lease, ttl, None).await.unwrap()
    else {
        panic!("a fresh key is won at attempt 1")
    };
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(store.renew(&key, token, lease, ttl).await.unwrap(), Transition::Applied);
    }
    // 800 ms in, past the first retention, the consumer dies; its lease runs out.
    tokio::time::sleep(lease + Duration::from_millis(150)).await;
    let claim = store.claim(&key, lease, ttl, None).await.unwrap();
    assert!(matches!(claim, Claim::Won { attempt: 2, .. }), "attempt count lost: {claim:?}");
}

/// Durations no store can hold as an expiry (`Duration::MAX`) are kept as the longest
/// one a store holds, never an error at every claim or a panic.
pub async fn huge_durations_are_held<S: Store + ?Sized>(store: &S) {
    let key = fresh_key("huge");
    let forever = Duration::MAX;
    let Claim::Won { token, .. } = store.claim(&key, forever, forever, None).await.unwrap() else {
        panic!("a fresh key is won")
    };
    assert_eq!(store.renew(&key, token, forever, forever).await.unwrap(), Transition::Applied);
    assert_eq!(store.complete(&key, token, forever, None).await.unwrap(), Transition::Applied);
    assert_eq!(store.claim(&key, forever, forever, None).await.unwrap(), Claim::Done);
}

/// Renewal keeps a handler that runs longer than its lease in possession. The lease is
/// three times [`LEASE`]: with renewals every third of it, a store answering 600 ms
/// late (a loaded machine running the suite's cases side by side) still renews in
/// time, so the case checks renewal rather than the machine's load.
pub async fn renewal_keeps_slow_handler<S: Store + ?Sized>(store: &S) {
    let (key, runs, alerts) = (fresh_key("slow"), AtomicU32::new(0), Alerts::default());
    let lease = LEASE * 3;
    let spec = || Spec::new(TTL, lease, 5);
    let slow =
        run(Call::new(spec(), Ok(key.clone())), store, Failure::class, alerts.hook(), async {
            tokio::time::sleep(lease * 4).await;
            Ok::<u32, Failure>(1)
        });
    let rival = async {
        let mut seen = Vec::new();
        for _ in 0..5 {
            tokio::time::sleep(lease / 2 + lease / 4).await;
            seen.push(call(store, &key, spec(), &runs, &alerts, Ok(2)).await);
        }
        seen
    };
    let (slow, seen) = tokio::join!(slow, rival);
    assert_eq!(slow.unwrap(), Outcome::Processed(1));
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the rival never ran: {seen:?}");
}

/// With `validate`, the same key with another payload is refused and runs nothing,
/// whether the first delivery is done or still in progress; the same payload is a
/// duplicate.
pub async fn payload_mismatch_is_refused<S: Store + ?Sized>(store: &S) {
    let (key, runs) = (fresh_key("validate"), AtomicU32::new(0));
    let (first, other) =
        (Fingerprint::of(r#"{"amount":100}"#), Fingerprint::of(r#"{"amount":999}"#));
    let validated = |fingerprint: Fingerprint| {
        let call = Call::new(spec(5), Ok(key.clone())).validated(fingerprint);
        run(call, store, Failure::class, Alerts::default().hook(), async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<u32, Failure>(1)
        })
    };
    assert_eq!(validated(first).await.unwrap(), Outcome::Processed(1));
    assert!(matches!(validated(other).await, Err(Error::PayloadMismatch)));
    assert_eq!(validated(first).await.unwrap(), Outcome::Duplicate);
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    let busy = fresh_key("validate-busy");
    let Claim::Won { token, .. } = store.claim(&busy, LEASE, TTL, Some(&first)).await.unwrap()
    else {
        panic!("fresh key")
    };
    let answer = store.claim(&busy, LEASE, TTL, Some(&other)).await.unwrap();
    assert_eq!(answer, Claim::Mismatch, "checked before the live claim");
    let answer = store.claim(&busy, LEASE, TTL, Some(&first)).await.unwrap();
    assert!(matches!(answer, Claim::InProgress { .. }), "{answer:?}");
    assert_eq!(store.complete(&busy, token, TTL, None).await.unwrap(), Transition::Applied);
}

/// Ids a hostile producer can send: NUL, CR/LF, spaces, invalid UTF-8, pattern and
/// separator characters, ids just under [`MAX_KEY_LEN`](crate::MAX_KEY_LEN) that
/// differ only in their last byte, and an id spelling another's hashed form. Each runs
/// once and keeps its own record. An id over the limit (1 MiB) is a key error before
/// the store: dead-letter, nothing run, nothing claimed.
pub async fn hostile_ids_keep_their_own_records<S: Store + ?Sized>(store: &S) {
    let namespace = fresh_key("hostile").namespace().to_owned();
    let longest = crate::MAX_KEY_LEN - namespace.len() - 1;
    let long = |last: u8| {
        let mut id = vec![b'\0'; longest];
        id[longest - 1] = last;
        id
    };
    let stored_long = Key::new(&namespace, long(b'a')).unwrap().stored().into_owned();
    let ids: Vec<Vec<u8>> = vec![
        b"a\0b".to_vec(),
        b"a\0c".to_vec(),
        b"a".to_vec(),
        b"a\r\nb".to_vec(),
        b"a b  c".to_vec(),
        b"\xff\xfe\x80".to_vec(),
        b"*?[]%_\\'\"".to_vec(),
        b":".to_vec(),
        long(b'a'),
        long(b'b'),
        stored_long[namespace.len() + 1..].to_vec(),
    ];
    let runs = AtomicU32::new(0);
    let handle = |id: &[u8], value: u32| {
        let key = Key::new(&namespace, id).expect("within the limit");
        let runs = &runs;
        run(
            Call::new(spec(5), Ok(key)),
            store,
            Failure::class,
            Alerts::default().hook(),
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<u32, Failure>(value)
            },
        )
    };
    for (i, id) in ids.iter().enumerate() {
        let out = handle(id, i as u32).await;
        assert_eq!(out.unwrap(), Outcome::Processed(i as u32), "id {i} is new");
    }
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(handle(id, 99).await.unwrap(), Outcome::Duplicate, "id {i} again");
    }
    assert_eq!(runs.load(Ordering::SeqCst), ids.len() as u32);

    let too_long = Key::new(&namespace, vec![b'x'; 1 << 20]);
    let error = too_long.clone().expect_err("1 MiB is over the limit");
    assert!(error.to_string().contains(&crate::MAX_KEY_LEN.to_string()), "{error}");
    let out =
        run(Call::new(spec(5), too_long), store, Failure::class, Alerts::default().hook(), async {
            Ok::<u32, Failure>(runs.fetch_add(1, Ordering::SeqCst))
        })
        .await;
    assert!(matches!(out, Err(Error::Key(_))), "{out:?}");
    assert_eq!(crate::DispositionExt::disposition(&out), crate::Disposition::DeadLetter);
    assert_eq!(runs.load(Ordering::SeqCst), ids.len() as u32, "the handler did not run");
}

/// A cached value that no longer reads back as the handler's type (it changed shape
/// between versions) is [`Error::Cache`]: ack, the handler does not run again, and the
/// record stays. A compatible type reads it. Values holding NUL, spaces and line
/// breaks round-trip.
pub async fn cached_result_of_another_shape_is_a_cache_error<S: Store + ?Sized>(store: &S) {
    let (key, runs) = (fresh_key("cache-shape"), AtomicU32::new(0));
    let stored = vec!["a\0b".to_owned(), " \r\n ".to_owned(), String::new()];
    let call = Call::new(spec(5), Ok(key.clone())).cached::<Vec<String>>();
    let value = stored.clone();
    let first = run(call, store, Failure::class, Alerts::default().hook(), async {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok::<_, Failure>(value)
    });
    assert_eq!(first.await.unwrap(), Outcome::Processed(stored.clone()));
    let call = Call::new(spec(5), Ok(key.clone())).cached::<u64>();
    let changed = run(call, store, Failure::class, Alerts::default().hook(), async {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok::<u64, Failure>(7)
    })
    .await;
    let Err(Error::Cache { reason }) = &changed else { panic!("{changed:?}") };
    assert!(
        reason.contains("u64") || reason.contains("integer"),
        "says what was expected: {reason}"
    );
    assert_eq!(crate::DispositionExt::disposition(&changed), crate::Disposition::Ack);
    let call = Call::new(spec(5), Ok(key.clone())).cached::<Vec<Box<str>>>();
    let compatible = run(call, store, Failure::class, Alerts::default().hook(), async {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok::<Vec<Box<str>>, Failure>(Vec::new())
    });
    let expected: Vec<Box<str>> = stored.iter().map(|s| s.as_str().into()).collect();
    assert_eq!(compatible.await.unwrap(), Outcome::Replayed(expected));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "only the first delivery ran");
}

/// With `cache`, duplicates get the first delivery's value back; a value too large to
/// cache is refused with an error, and the message is still recorded DONE.
pub async fn cached_result_is_replayed<S: Store + ?Sized>(store: &S) {
    let (key, runs) = (fresh_key("cache"), AtomicU32::new(0));
    let cached = |value: String| {
        let call = Call::new(spec(5), Ok(key.clone())).cached::<String>();
        run(call, store, Failure::class, Alerts::default().hook(), async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<String, Failure>(value)
        })
    };
    let receipt = "receipt 7 \u{1F9FE} with spaces".to_owned();
    assert_eq!(cached(receipt.clone()).await.unwrap(), Outcome::Processed(receipt.clone()));
    assert_eq!(cached("other".into()).await.unwrap(), Outcome::Replayed(receipt.clone()));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // A handler that does not cache sees a plain duplicate.
    let uncached = run(
        Call::new(spec(5), Ok(key.clone())),
        store,
        Failure::class,
        Alerts::default().hook(),
        async { Ok::<String, Failure>("never".into()) },
    );
    assert_eq!(uncached.await.unwrap(), Outcome::Duplicate);

    let (big_key, big) =
        (fresh_key("cache-big"), "x".repeat(crate::execute::MAX_CACHED_RESULT + 1));
    let call = Call::new(spec(5), Ok(big_key.clone())).cached::<String>();
    let out =
        run(call, store, Failure::class, Alerts::default().hook(), async { Ok::<_, Failure>(big) })
            .await;
    // The caller still gets its value: the effect happened.
    let Ok(Outcome::ProcessedNotCached { value, reason }) = &out else { panic!("{out:?}") };
    assert!(reason.contains("limit") && value.len() == crate::execute::MAX_CACHED_RESULT + 1);
    assert_eq!(crate::DispositionExt::disposition(&out), crate::Disposition::Ack);
    assert_eq!(claim_state(store, &big_key).await, Claim::Done, "recorded DONE, uncached");

    // A value whose JSON would not read back (NaN is written as `null`) is not cached:
    // its duplicates are plain ones, not failed replays.
    let nan_key = fresh_key("cache-nan");
    let call = || Call::new(spec(5), Ok(nan_key.clone())).cached::<f64>();
    let hook = || Alerts::default().hook();
    let out = run(call(), store, Failure::class, hook(), async { Ok::<_, Failure>(f64::NAN) });
    let Ok(Outcome::ProcessedNotCached { value, reason }) = out.await else { panic!("NaN cached") };
    assert!(value.is_nan() && reason.contains("read back"), "{reason}");
    let again = run(call(), store, Failure::class, hook(), async { Ok::<_, Failure>(0.0) });
    assert_eq!(again.await.unwrap(), Outcome::Duplicate);
}

/// 1,000 concurrent calls with one key on a multi-threaded runtime: the body runs
/// once; every other call gets `InProgress` or `Duplicate`.
pub async fn concurrent_same_key_runs_once<S: Store + ?Sized + 'static>(store: Arc<S>) {
    let key = fresh_key("race");
    let runs = Arc::new(AtomicU32::new(0));
    let tasks: Vec<_> = (0..1_000)
        .map(|_| {
            let (store, key, runs) = (store.clone(), key.clone(), runs.clone());
            tokio::spawn(async move {
                call(&*store, &key, BULK, &runs, &Alerts::default(), Ok(1)).await
            })
        })
        .collect();
    let mut processed = 0;
    for task in tasks {
        match task.await.expect("no panic") {
            Ok(Outcome::Processed(_)) => processed += 1,
            Ok(Outcome::InProgress { .. } | Outcome::Duplicate) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(processed, 1);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// 10,000 calls over 1,000 keys, concurrently: each key's body runs exactly once.
pub async fn many_keys_each_once<S: Store + ?Sized + 'static>(store: Arc<S>) {
    let namespace = format!("suite-many-{:08x}", rand::random::<u32>());
    let runs: Arc<Vec<AtomicU32>> = Arc::new((0..1_000).map(|_| AtomicU32::new(0)).collect());
    let tasks: Vec<_> = (0..10_000u32)
        .map(|i| {
            let (store, runs, namespace) = (store.clone(), runs.clone(), namespace.clone());
            tokio::spawn(async move {
                let id = (i * 7919) % 1_000;
                let key = Key::new(&namespace, id.to_string()).expect("valid key");
                loop {
                    let out = run(
                        Call::new(BULK, Ok(key.clone())),
                        &*store,
                        Failure::class,
                        Alerts::default().hook(),
                        async {
                            runs[id as usize].fetch_add(1, Ordering::SeqCst);
                            Ok::<u32, Failure>(id)
                        },
                    )
                    .await;
                    // 10,000 calls at once may find a small pool busy (a timed-out
                    // acquire): the message is redelivered, as a broker would.
                    match out {
                        Err(Error::Store { handler_ran: false, retry_after, .. }) => {
                            tokio::time::sleep(retry_after.min(Duration::from_millis(50))).await
                        }
                        other => break other,
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        let out = task.await.expect("no panic").expect("no error");
        assert!(matches!(
            out,
            Outcome::Processed(_) | Outcome::Duplicate | Outcome::InProgress { .. }
        ));
    }
    for (id, n) in runs.iter().enumerate() {
        assert_eq!(n.load(Ordering::SeqCst), 1, "key {id} ran {n:?} times");
    }
}

/// Calls `f` until it returns `Ok(Processed | Duplicate ...)` other than
/// `InProgress`, for at most `within`.
async fn eventually<F, Fut>(within: Duration, mut f: F) -> Outcome<u32>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Outcome<u32>, Error<Failure>>>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match f().await.expect("no error") {
            Outcome::InProgress { .. } if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            other => return other,
        }
    }
}

/// Wraps a store and fails on demand, to show how the runtime reacts to an
/// unreachable store. (Server-backed stores also test the real thing: a killed server.)
struct Flaky<'a, S: ?Sized> {
    inner: &'a S,
    down: AtomicBool,
    down_after_claim: AtomicBool,
    refuse_renewals: AtomicBool,
    /// How many renewals `refuse_renewals` failed.
    refused: AtomicU32,
    /// How many completes still fail before they reach the store.
    failing_completes: AtomicU32,
}

impl<'a, S: Store + ?Sized> Flaky<'a, S> {
    fn new(inner: &'a S) -> Self {
        Flaky {
            inner,
            down: AtomicBool::new(false),
            down_after_claim: AtomicBool::new(false),
            failing_completes: AtomicU32::new(0),
            refuse_renewals: AtomicBool::new(false),
            refused: AtomicU32::new(0),
        }
    }

    fn check(&self, flag: &AtomicBool) -> Result<(), StoreError> {
        if flag.load(Ordering::SeqCst) {
            return Err(StoreError::unavailable("connection refused (simulated)"));
        }
        Ok(())
    }
}

#[async_trait]
impl<S: Store + ?Sized> Store for Flaky<'_, S> {
    async fn claim(
        &self,
        key: &Key,
        lease: Duration,
        ttl: Duration,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Claim, StoreError> {
        self.check(&self.down)?;
        self.inner.claim(key, lease, ttl, fingerprint).await
    }
    async fn complete(
        &self,
        key: &Key,
        token: Token,
        ttl: Duration,
        result: Option<&[u8]>,
    ) -> Result<Transition, StoreError> {
        self.check(&self.down)?;
        self.check(&self.down_after_claim)?;
        let failing =
            self.failing_completes
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if failing.is_ok() {
            return Err(StoreError::unavailable("connection reset (simulated)"));
        }
        self.inner.complete(key, token, ttl, result).await
    }
    async fn release(&self, key: &Key, token: Token) -> Result<Transition, StoreError> {
        self.check(&self.down)?;
        self.inner.release(key, token).await
    }
    async fn fail(&self, key: &Key, token: Token, ttl: Duration) -> Result<Transition, StoreError> {
        self.check(&self.down)?;
        self.inner.fail(key, token, ttl).await
    }
    async fn renew(
        &self,
        key: &Key,
        token: Token,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Transition, StoreError> {
        self.check(&self.down)?;
        self.check(&self.refuse_renewals).inspect_err(|_| {
            self.refused.fetch_add(1, Ordering::SeqCst);
        })?;
        self.inner.renew(key, token, lease, ttl).await
    }
    fn abandon(&self, key: &Key, token: Token) {
        self.inner.abandon(key, token)
    }
    fn hold_limit(&self) -> Option<Duration> {
        self.inner.hold_limit()
    }
}

/// Runs `case` on a fresh multi-threaded Tokio runtime; the `store_suite!` tests use it.
pub fn block_on<F: Future>(case: F) -> F::Output {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a Tokio runtime")
        .block_on(case)
}

/// The cases of the behaviour suite, in one list for everything that names them
/// ([`store_suite!`], [`CASES`], [`every_case`]): calls `$callback!` with `$pre`
/// followed by `[cases on a store] [cases on an Arc of it]`.
#[doc(hidden)]
#[macro_export]
macro_rules! __store_suite_cases {
    ($callback:path; $($pre:tt)*) => {
        $callback!($($pre)*
            [first_delivery_success, duplicate_within_ttl, in_progress_elsewhere,
            retryable_error_releases, retryable_error_on_last_attempt, terminal_error_fails,
            already_applied_is_done, panic_releases, dropped_future_releases, dead_consumer_claim_expires,
            unfinished_attempts_are_capped, store_unreachable_at_claim,
            store_fails_after_handler, ttl_expiry_forgets, expired_lease_is_fenced,
            fences_grow_with_every_claim,
            late_completion_gets_lease_lost, lost_lease_stops_the_body,
            unpolled_call_is_stopped_when_resumed, unpolled_again_after_failed_renewals_is_stopped,
            cut_off_call_stops_at_its_lease,
            lost_lease_failure_is_not_terminal, renewal_keeps_slow_handler,
            renewal_extends_retention, huge_durations_are_held, panic_on_last_attempt_fails,
            a_failed_completion_is_retried,
            payload_mismatch_is_refused, cached_result_is_replayed,
            hostile_ids_keep_their_own_records, cached_result_of_another_shape_is_a_cache_error]
            [concurrent_same_key_runs_once, many_keys_each_once]);
    };
}

macro_rules! suite_items {
    ([$($case:ident),*] [$($shared:ident),*]) => {
        /// The names of the cases `store_suite!` generates.
        pub const CASES: &[&str] = &[$(stringify!($case),)* $(stringify!($shared),)*];

        /// Runs every case of [`store_suite!`](crate::store_suite) one after the other on `store`: for a
        /// store whose server is costly to start (a Redis Cluster of the test's own).
        pub async fn every_case<S: Store + 'static>(store: S) {
            $($case(&store).await;)*
            let store = Arc::new(store);
            $($shared(store.clone()).await;)*
        }
    };
}

crate::__store_suite_cases!(suite_items;);

/// Generates one `#[test]` per case of the behaviour suite for the store that
/// `$make` (an expression, which may `.await`) builds. Every test builds its own
/// store with `$make`.
#[macro_export]
macro_rules! store_suite {
    ($make:expr) => {
        $crate::__store_suite_cases!($crate::store_suite; @generate $make;);
    };
    (@generate $make:expr; [$($case:ident),*] [$($shared:ident),*]) => {
        $crate::store_suite!(@cases $make; $($case),*);
        $crate::store_suite!(@shared $make; $($shared),*);
    };
    (@cases $make:expr; $($case:ident),*) => {$(
        #[test]
        fn $case() {
            $crate::testing::block_on(async {
                let store = $make;
                $crate::testing::$case(&store).await
            })
        }
    )*};
    (@shared $make:expr; $($case:ident),*) => {$(
        #[test]
        fn $case() {
            $crate::testing::block_on(async {
                let store = ::std::sync::Arc::new($make);
                $crate::testing::$case(store).await
            })
        }
    )*};
}
