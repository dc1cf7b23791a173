//! A call left unpolled past its lease (a task starved by a blocking neighbour, a
//! stopped process, a future parked by its caller) may find, when it is polled again,
//! that a redelivery took the lapsed key over and ran the message. Its body must then
//! be stopped, as a lost renewal stops it, and not run on to its end: before it is
//! polled again, the renewal that was due meanwhile has to say the claim is still
//! this call's.

use std::sync::LazyLock;
use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
use std::task::{Context, Waker};
use std::time::Duration;

use idempotent::{Error, MemoryStore, Outcome, idempotent};

struct Job {
    id: u64,
    /// How long the body waits before its effect.
    work: Duration,
}

/// Counts of one handler's bodies: started and finished (the effect).
#[derive(Default)]
struct Counts {
    started: AtomicU32,
    finished: AtomicU32,
}

impl Counts {
    fn get(&self) -> (u32, u32) {
        (self.started.load(SeqCst), self.finished.load(SeqCst))
    }
}

static PAUSED_STORE: LazyLock<MemoryStore> = LazyLock::new(MemoryStore::new);
static PAUSED: Counts = Counts { started: AtomicU32::new(0), finished: AtomicU32::new(0) };

#[idempotent(key = "{id}", lease = 2, store = PAUSED_STORE)]
async fn parked(msg: &Job) -> Result<u64, std::io::Error> {
    PAUSED.started.fetch_add(1, SeqCst);
    tokio::time::sleep(msg.work).await;
    PAUSED.finished.fetch_add(1, SeqCst);
    Ok(msg.id)
}

#[tokio::test(start_paused = true)]
async fn a_call_left_unpolled_past_its_lease_is_stopped_when_polled_again() {
    let slow = Job { id: 1, work: Duration::from_secs(3) };
    let mut first = Box::pin(parked(&slow));
    let mut cx = Context::from_waker(Waker::noop());
    assert!(first.as_mut().poll(&mut cx).is_pending(), "claimed, and waiting in the body");
    assert_eq!(PAUSED.get(), (1, 0));

    // Not polled for 5 s: the 2 s lease lapses and a redelivery takes the key over.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let quick = Job { id: 1, work: Duration::ZERO };
    assert_eq!(parked(&quick).await.unwrap(), Outcome::Processed(1));
    assert_eq!(PAUSED.get(), (2, 1));

    let late = first.await;
    assert!(matches!(late, Err(Error::LeaseLost { .. })), "{late:?}");
    assert_eq!(PAUSED.get(), (2, 1), "the first body ran on after the redelivery's run");
}

static STARVED_STORE: LazyLock<MemoryStore> = LazyLock::new(MemoryStore::new);
static STARVED: Counts = Counts { started: AtomicU32::new(0), finished: AtomicU32::new(0) };

#[idempotent(key = "{id}", lease = "300ms", store = STARVED_STORE)]
async fn starved(msg: Job) -> Result<u64, std::io::Error> {
    STARVED.started.fetch_add(1, SeqCst);
    tokio::time::sleep(msg.work).await;
    STARVED.finished.fetch_add(1, SeqCst);
    Ok(msg.id)
}

/// In real time: on a current-thread runtime a neighbouring task blocks the thread
/// for 1.5 s while the handler (300 ms lease) waits in its body; a consumer on another
/// thread takes the lapsed key over at 700 ms.
#[test]
fn a_call_starved_by_a_blocking_neighbour_is_stopped_when_it_resumes() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let late = rt.block_on(async {
        let first = tokio::spawn(starved(Job { id: 2, work: Duration::from_millis(200) }));
        while STARVED.get().0 == 0 {
            tokio::task::yield_now().await;
        }
        let other = std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(700));
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(starved(Job { id: 2, work: Duration::ZERO }))
        });
        // The neighbour: synchronous work on the runtime's only thread.
        tokio::spawn(async { std::thread::sleep(Duration::from_millis(1500)) }).await.unwrap();
        assert_eq!(other.join().unwrap().unwrap(), Outcome::Processed(2), "taken over");
        first.await.unwrap()
    });
    assert!(matches!(late, Err(Error::LeaseLost { .. })), "{late:?}");
    assert_eq!(STARVED.get(), (2, 1), "the starved body ran on after the takeover");
}
