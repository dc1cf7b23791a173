//! Probe: drop the `run()` future while `gather` holds records (inside the commit
//! interval), then call `run()` again on the same consumer.
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use idempotent::consume::kafka::ExactlyOnceConsumer;
use idempotent::testing::block_on;

#[path = "attack_eos/common.rs"]
mod common;
#[path = "support/kafka.rs"]
mod kafka;
use common::*;

#[test]
fn drop_mid_gather_then_run_again() {
    let Some(broker) = kafka::Broker::start() else { return };
    block_on(async {
        let topics = Topics::create(&broker, 3).await;
        let group = format!("g-{}", topics.input);
        let store = redis_store().await;
        let ctl = Arc::new(Ctl::default());
        let consumer = ExactlyOnceConsumer::new(
            member_with(&broker.address, &group, &topics.input, &[]),
            transactional_producer(&broker.address, &format!("tx-{}", topics.input), 20000),
            topics.dead.clone(),
        )
        .unwrap()
        .commit_interval(Duration::from_secs(3))
        .max_batch(10_000);
        let out = topics.output.clone();
        let handler = |msg| {
            let (store, ctl, out) = (store.clone(), ctl.clone(), out.clone());
            async move {
                let r = invoice(msg, &store, &ctl, &out).await;
                ctl.handled.fetch_add(1, Ordering::SeqCst);
                r
            }
        };
        publish(&broker, &topics.input, 0..100).await;
        // Phase 1: 0..100 handled and committed; then 100..200 arrive, gathered, and
        // run is dropped 1.5 s into the 3 s commit interval.
        tokio::select! {
            r = consumer.run(handler) => panic!("run ended: {r:?}"),
            () = async {
                while ctl.handled.load(Ordering::SeqCst) < 100 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                tokio::time::sleep(Duration::from_secs(2)).await;
                publish(&broker, &topics.input, 100..200).await;
                tokio::time::sleep(Duration::from_millis(1500)).await;
            } => {}
        }
        eprintln!("dropped run; handled so far {}", ctl.handled.load(Ordering::SeqCst));
        publish(&broker, &topics.input, 200..300).await;
        let handler = |msg| {
            let (store, ctl, out) = (store.clone(), ctl.clone(), out.clone());
            async move {
                let r = invoice(msg, &store, &ctl, &out).await;
                ctl.handled.fetch_add(1, Ordering::SeqCst);
                r
            }
        };
        tokio::select! {
            r = consumer.run(handler) => panic!("run ended: {r:?}"),
            () = tokio::time::sleep(Duration::from_secs(15)) => {}
        }
        let starts = ctl.starts.lock().unwrap().clone();
        let never: Vec<u64> = (0..300).filter(|id| !starts.contains_key(id)).collect();
        eprintln!(
            "handled {} calls; ids never handled: {} {:?}",
            ctl.handled.load(Ordering::SeqCst),
            never.len(),
            never.iter().take(10).collect::<Vec<_>>()
        );
        let (address, input, output) =
            (broker.address.clone(), topics.input.clone(), topics.output.clone());
        let (got, ce) = tokio::task::spawn_blocking(move || {
            (
                read(&address, &output, "read_committed", 300, Duration::from_secs(20)),
                committed_and_end(&address, &group, &input, 3),
            )
        })
        .await
        .unwrap();
        let want: Vec<u64> = (0..300).collect();
        let (doubled, missing, extra) = tally(&got, &want);
        eprintln!(
            "RESULT read {} outputs; doubled {doubled:?}; missing {} {:?}; extra {extra:?}; committed {:?} ends {:?}",
            got.len(),
            missing.len(),
            missing.iter().take(10).collect::<Vec<_>>(),
            ce.0,
            ce.1
        );
        assert!(doubled.is_empty() && missing.is_empty() && extra.is_empty(), "not exactly once");
    });
}
