//! `ZooKeeperStore` when ZooKeeper misbehaves: each test runs its own server and
//! restarts it, partitions a consumer from it until its session expires, or races two
//! consumers over the same keys; no message is lost, and none takes effect twice.

#[path = "support/fault_proxy.rs"]
mod fault_proxy;
#[path = "support/zookeeper.rs"]
mod zookeeper;

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use fault_proxy::FaultProxy;
use idempotent::testing::block_on;
use idempotent::{Error, Outcome, ZooKeeperStore, idempotent};
use tokio::sync::Notify;
use zookeeper::ZooKeeperServer;

struct Order {
    id: u32,
}

#[derive(Debug, thiserror::Error, idempotent::Classify)]
#[error("never")]
#[idempotent(retryable)]
struct Never;

/// Effects by order id.
#[derive(Default)]
struct Ledger {
    applied: Mutex<HashMap<u32, u32>>,
}

impl Ledger {
    fn apply(&self, id: u32) {
        *self.applied.lock().unwrap().entry(id).or_default() += 1;
    }

    fn count(&self, id: u32) -> u32 {
        self.applied.lock().unwrap().get(&id).copied().unwrap_or(0)
    }
}

// DONE is tried again for half the lease: 15 s covers a JVM restarting on a loaded
// machine (seconds), so an effect applied just before the kill is recorded once the
// server is back, as the README's life-cycle table promises.
#[idempotent(key = "order:{id}", store = store, lease = "30s")]
async fn apply(msg: Order, store: &ZooKeeperStore, ledger: &Ledger) -> Result<(), Never> {
    ledger.apply(msg.id);
    Ok(())
}

/// Delivers `id` until a call settles it (a broker's redeliveries), counting the calls
/// that met a store error.
async fn deliver(id: u32, store: &ZooKeeperStore, ledger: &Ledger, errors: &AtomicUsize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(Instant::now() < deadline, "order {id} never settled");
        match apply(Order { id }, store, ledger).await {
            Ok(Outcome::Processed(()) | Outcome::Duplicate) => return,
            Ok(Outcome::InProgress { retry_after }) => {
                tokio::time::sleep(retry_after.min(Duration::from_millis(200))).await;
            }
            Err(Error::Store { handler_ran: false, .. }) => {
                errors.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => panic!("order {id}: {other:?}"),
        }
    }
}

/// The server is killed (`SIGKILL`) while 400 orders flow and started again a second
/// later on the same files: calls during the outage fail with store errors and are
/// delivered again; every order takes effect exactly once.
#[test]
fn a_server_restart_mid_stream_loses_nothing_and_doubles_nothing() {
    let Some(mut server) = ZooKeeperServer::start() else { return };
    block_on(async {
        let store = zookeeper::connect(&server.hosts(), "/orders", Duration::from_secs(4)).await;
        let (ledger, errors, settled) =
            (Ledger::default(), AtomicUsize::new(0), AtomicUsize::new(0));
        let orders = futures_util::stream::iter(0..400u32)
            .map(|id| {
                let (store, ledger, errors, settled) = (&store, &ledger, &errors, &settled);
                async move {
                    deliver(id, store, ledger, errors).await;
                    settled.fetch_add(1, Ordering::SeqCst);
                }
            })
            .buffer_unordered(16)
            .collect::<Vec<()>>();
        let faults = async {
            while settled.load(Ordering::SeqCst) < 100 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            server.kill();
            tokio::time::sleep(Duration::from_secs(1)).await;
            tokio::task::block_in_place(|| server.restart());
        };
        futures_util::join!(orders, faults);
        assert!(errors.load(Ordering::SeqCst) > 0, "the outage was not noticed");
        for id in 0..400 {
            assert_eq!(ledger.count(id), 1, "order {id}");
        }
    });
}

#[idempotent(key = "order:{id}", store = store, lease = "9s")]
async fn slow(
    msg: Order,
    store: &ZooKeeperStore,
    ledger: &Ledger,
    gate: &Notify,
) -> Result<(), Never> {
    gate.notified().await;
    ledger.apply(msg.id);
    Ok(())
}

/// A consumer is cut off from ZooKeeper while its handler runs, long enough for its
/// session to expire: ZooKeeper deletes its claim's ephemeral child, so a second
/// consumer takes the key over well before the first one's 9 s lease would have run
/// out. The first consumer's handler is stopped well before that lease ends: by its
/// renewal finding the key taken (`LeaseLost`), or, where that answer comes later than
/// the store's hold (the session's length) and one more, as a loaded machine makes it,
/// by no renewal being confirmed (a store error, the handler having run). The effect
/// happened once.
#[test]
fn an_expired_session_hands_the_claim_over_and_stops_the_old_owner() {
    let Some(server) = ZooKeeperServer::start() else { return };
    block_on(async {
        let proxy = FaultProxy::start(server.port).await;
        let session = Duration::from_secs(1);
        let cut_off = zookeeper::connect(&proxy.address(), "/orders", session).await;
        let other = zookeeper::connect(&server.hosts(), "/orders", session).await;
        // The first call's body waits for ever: only its renewal can end it.
        let (ledger, never) = (Ledger::default(), Notify::new());
        let first = async {
            let claimed = Instant::now();
            let call = slow(Order { id: 7 }, &cut_off, &ledger, &never);
            let ended = tokio::time::timeout(Duration::from_secs(20), call).await;
            (ended.expect("the old owner's handler was never stopped"), claimed.elapsed())
        };
        let second = async {
            // Let the first call claim, then partition it for 2.5 session timeouts.
            tokio::time::sleep(Duration::from_millis(300)).await;
            proxy.cut();
            tokio::time::sleep(Duration::from_millis(2_500)).await;
            let open = Notify::new();
            open.notify_one();
            let second = slow(Order { id: 7 }, &other, &ledger, &open).await;
            proxy.restore();
            second
        };
        let ((first, first_took), second) = futures_util::join!(first, second);
        assert!(matches!(second, Ok(Outcome::Processed(()))), "taken over: {second:?}");
        let stopped = matches!(first, Err(Error::LeaseLost { .. }))
            || matches!(&first, Err(Error::Store { error, handler_ran: true, .. })
                if error.to_string().contains("no renewal of the claim was confirmed"));
        assert!(stopped, "the old owner: {first:?}");
        assert!(
            first_took < Duration::from_secs(9),
            "stopped before its lease ended: {first_took:?}"
        );
        assert_eq!(ledger.count(7), 1, "the effect happened once");
        let again = slow(Order { id: 7 }, &other, &ledger, &Notify::new()).await;
        assert!(matches!(again, Ok(Outcome::Duplicate)), "{again:?}");
    });
}

/// Two consumers, each with its own session, race over 1,000 keys, every key
/// delivered to both at once: each key takes effect exactly once. Half the keys were
/// claimed beforehand by a third consumer that hangs (its session lives, its 300 ms
/// lease lapses), so the two race to take those over.
#[test]
fn two_consumers_racing_over_a_thousand_keys_apply_each_once() {
    use idempotent::{Key, Store as _};
    let Some(server) = ZooKeeperServer::start() else { return };
    block_on(async {
        let session = Duration::from_secs(4);
        let a = zookeeper::connect(&server.hosts(), "/race", session).await;
        let b = zookeeper::connect(&server.hosts(), "/race", session).await;
        let hung = zookeeper::connect(&server.hosts(), "/race", session).await;
        for id in (0..1_000u32).step_by(2) {
            let key = Key::new("apply", format!("order:{id}")).unwrap();
            let lease = Duration::from_millis(300);
            let claim = hung.claim(&key, lease, Duration::from_secs(60), None).await.unwrap();
            assert!(matches!(claim, idempotent::Claim::Won { .. }));
        }
        tokio::time::sleep(Duration::from_millis(400)).await;
        let (ledger, errors) = (Ledger::default(), AtomicUsize::new(0));
        futures_util::stream::iter(0..1_000u32)
            .map(|id| {
                let (a, b, ledger, errors) = (&a, &b, &ledger, &errors);
                async move {
                    futures_util::join!(
                        deliver(id, a, ledger, errors),
                        deliver(id, b, ledger, errors)
                    );
                }
            })
            .buffer_unordered(32)
            .collect::<Vec<()>>()
            .await;
        for id in 0..1_000 {
            assert_eq!(ledger.count(id), 1, "key {id}");
        }
        assert_eq!(errors.load(Ordering::SeqCst), 0, "no store errors without faults");
    });
}

use futures_util::StreamExt as _;

/// A claim taken with a short retention, then completed (or failed) with a longer
/// `ttl`: the record must last that `ttl`, so ZooKeeper must not reap its znode at the
/// end of the claim's retention. The test server reaps every 500 ms.
#[test]
fn a_finish_with_a_longer_ttl_than_the_claim_outlives_the_claims_retention() {
    use idempotent::{Claim, Key, Store as _, Transition};
    let Some(server) = ZooKeeperServer::start() else { return };
    block_on(async {
        let store = zookeeper::connect(&server.hosts(), "/finish", Duration::from_secs(4)).await;
        let short = Duration::from_millis(500);
        let (done, failed) =
            (Key::new("apply", "done").unwrap(), Key::new("apply", "failed").unwrap());
        // Retention: 0.5 s + 0.5 s; the records are then kept a minute.
        let Claim::Won { token, .. } = store.claim(&done, short, short, None).await.unwrap() else {
            panic!("not won")
        };
        let minute = Duration::from_secs(60);
        assert_eq!(store.complete(&done, token, minute, None).await.unwrap(), Transition::Applied);
        let Claim::Won { token, .. } = store.claim(&failed, short, short, None).await.unwrap()
        else {
            panic!("not won")
        };
        assert_eq!(store.fail(&failed, token, minute).await.unwrap(), Transition::Applied);
        tokio::time::sleep(Duration::from_secs(3)).await;
        let again = store.claim(&done, short, minute, None).await.unwrap();
        assert!(matches!(again, Claim::Done), "a DONE record kept a minute was lost: {again:?}");
        let again = store.claim(&failed, short, minute, None).await.unwrap();
        assert!(
            matches!(again, Claim::Failed { attempts: 1 }),
            "a FAILED record kept a minute was lost: {again:?}"
        );
    });
}

/// A claim renewed with a longer lease keeps its record (and its attempt count) for
/// the renewal's retention even when its consumer dies: the next consumer's claim is
/// attempt 2, not a fresh attempt 1 after ZooKeeper reaped the znode at the end of
/// the first claim's retention.
#[test]
fn a_renewal_with_a_longer_lease_keeps_the_attempt_count_after_its_owner_died() {
    use idempotent::{Claim, Key, Store as _, Transition};
    let Some(server) = ZooKeeperServer::start() else { return };
    block_on(async {
        let session = Duration::from_millis(800);
        let other = zookeeper::connect(&server.hosts(), "/renew", session).await;
        let key = Key::new("apply", "renewed").unwrap();
        let short = Duration::from_millis(500);
        {
            let dying = zookeeper::connect(&server.hosts(), "/renew", session).await;
            let Claim::Won { token, .. } = dying.claim(&key, short, short, None).await.unwrap()
            else {
                panic!("not won")
            };
            // Now kept 30 s + 0.5 s from the renewal.
            let renewed = dying.renew(&key, token, Duration::from_secs(30), short).await.unwrap();
            assert_eq!(renewed, Transition::Applied);
        } // Its session is never heard from again and expires.
        tokio::time::sleep(Duration::from_secs(4)).await;
        let next = other.claim(&key, short, short, None).await.unwrap();
        assert!(
            matches!(next, Claim::Won { attempt: 2, .. }),
            "the dead consumer's attempt was forgotten: {next:?}"
        );
    });
}
