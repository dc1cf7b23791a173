//! A ZooKeeper claim holds while its lease runs *and* its session's ephemeral child
//! exists, so another consumer may take the key over as soon as the owner's session
//! expires, however much lease is left. A consumer cut off from ZooKeeper therefore
//! counts its claim as held for the session timeout after its last confirmed
//! renewal, not for its lease: its body is stopped (not polled) once that runs out
//! unconfirmed. Before, the cut-off consumer's body went on for its whole 9 s lease
//! and took effect beside the consumer that took the key over after its 1 s session
//! expired (two effects).

#[path = "support/fault_proxy.rs"]
mod fault_proxy;
#[path = "support/zookeeper.rs"]
mod zookeeper;

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use fault_proxy::FaultProxy;
use idempotent::testing::block_on;
use idempotent::{Outcome, ZooKeeperStore, idempotent};
use zookeeper::ZooKeeperServer;

struct Order {
    id: u32,
    hold: Duration,
}

#[derive(Debug, thiserror::Error, idempotent::Classify)]
#[error("never")]
#[idempotent(retryable)]
struct Never;

/// Works for `hold`, then takes effect.
#[idempotent(key = "order:{id}", store = store, lease = "9s")]
async fn work(msg: Order, store: &ZooKeeperStore, effects: &AtomicU32) -> Result<(), Never> {
    tokio::time::sleep(msg.hold).await;
    effects.fetch_add(1, Ordering::SeqCst);
    Ok(())
}

#[test]
fn a_cut_off_owner_whose_session_expired_does_not_take_effect_beside_the_new_owner() {
    let Some(server) = ZooKeeperServer::start() else { return };
    block_on(async {
        let proxy = FaultProxy::start(server.port).await;
        let session = Duration::from_secs(1);
        let cut_off = zookeeper::connect(&proxy.address(), "/idempotent-partition", session).await;
        let other = zookeeper::connect(&server.hosts(), "/idempotent-partition", session).await;
        let effects = AtomicU32::new(0);
        let start = Instant::now();
        let first = async {
            let call = work(Order { id: 1, hold: Duration::from_secs(4) }, &cut_off, &effects);
            let out = tokio::time::timeout(Duration::from_secs(30), call).await;
            println!("first consumer: {out:?} after {:?}", start.elapsed());
            out
        };
        let second = async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            proxy.cut();
            // 2.5 session timeouts: the first consumer's session is gone.
            tokio::time::sleep(Duration::from_millis(2_500)).await;
            let out = work(Order { id: 1, hold: Duration::ZERO }, &other, &effects).await;
            println!("second consumer: {out:?} after {:?}", start.elapsed());
            // The partition lasts until the first body is done.
            tokio::time::sleep(Duration::from_millis(2_000)).await;
            proxy.restore();
            out
        };
        let (first, second) = futures_util::join!(first, second);
        assert!(
            matches!(
                first,
                Ok(Err(idempotent::Error::Store { handler_ran: true, .. }))
                    | Ok(Err(idempotent::Error::LeaseLost { .. }))
            ),
            "the cut-off call was not stopped: {first:?}"
        );
        assert!(matches!(second, Ok(Outcome::Processed(()))), "taken over: {second:?}");
        assert_eq!(effects.load(Ordering::SeqCst), 1, "expected one effect for the key");
    });
}
