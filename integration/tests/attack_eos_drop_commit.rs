//! Probe: drop the `run()` future at swept instants after the handler returned (so
//! inside deliveries / send_offsets / commit_transaction), then call `run()` again on
//! the same consumer. max_batch = 1.
use std::collections::BTreeMap;
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
fn drop_at_swept_instants_after_handler() {
    let _ = tracing_subscriber::fmt().with_writer(std::io::stderr).try_init();
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
        .max_batch(1);
        let out = topics.output.clone();
        let mk = || {
            let (store, ctl, out) = (store.clone(), ctl.clone(), out.clone());
            move |msg| {
                let (store, ctl, out) = (store.clone(), ctl.clone(), out.clone());
                async move {
                    let r = invoice(msg, &store, &ctl, &out).await;
                    ctl.handled.fetch_add(1, Ordering::SeqCst);
                    r
                }
            }
        };
        let n = 200u64;
        publish(&broker, &topics.input, 0..n).await;
        let mut errors: BTreeMap<String, usize> = BTreeMap::new();
        let mut drops = 0;
        let started = std::time::Instant::now();
        for i in 0..160u64 {
            if started.elapsed() > Duration::from_secs(60) {
                break;
            }
            let before = ctl.handled.load(Ordering::SeqCst);
            let d = Duration::from_millis(i % 40);
            let ended = tokio::select! {
                r = consumer.run(mk()) => Some(r),
                () = async {
                    let t = std::time::Instant::now();
                    while ctl.handled.load(Ordering::SeqCst) == before && t.elapsed() < Duration::from_secs(5) {
                        tokio::task::yield_now().await;
                    }
                    tokio::time::sleep(d).await;
                } => None,
            };
            if i < 40 {
                eprintln!(
                    "iter {i} d={d:?} ended={ended:?} handled={}",
                    ctl.handled.load(Ordering::SeqCst)
                );
            }
            match ended {
                Some(Err(e)) => *errors.entry(e.to_string()).or_default() += 1,
                Some(Ok(())) => {}
                None => drops += 1,
            }
        }
        eprintln!(
            "drops {drops}; run errors {errors:?}; handled {}",
            ctl.handled.load(Ordering::SeqCst)
        );
        // Then run to the end.
        let mut final_errors = BTreeMap::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(25);
        while tokio::time::Instant::now() < deadline {
            tokio::select! {
                r = consumer.run(mk()) => { *final_errors.entry(format!("{r:?}")).or_insert(0) += 1; tokio::time::sleep(Duration::from_millis(50)).await; }
                () = tokio::time::sleep_until(deadline) => {}
            }
        }
        eprintln!(
            "final run errors {final_errors:?}; handled {}",
            ctl.handled.load(Ordering::SeqCst)
        );
        let (address, input, output) =
            (broker.address.clone(), topics.input.clone(), topics.output.clone());
        let (got, ce) = tokio::task::spawn_blocking(move || {
            (
                read(&address, &output, "read_committed", n as usize, Duration::from_secs(20)),
                committed_and_end(&address, &group, &input, 3),
            )
        })
        .await
        .unwrap();
        let want: Vec<u64> = (0..n).collect();
        let (doubled, missing, extra) = tally(&got, &want);
        eprintln!(
            "RESULT read {} outputs; doubled {} {doubled:?}; missing {} {:?}; extra {extra:?}; committed {:?} ends {:?}",
            got.len(),
            doubled.len(),
            missing.len(),
            missing.iter().take(20).collect::<Vec<_>>(),
            ce.0,
            ce.1
        );
        assert!(doubled.is_empty() && missing.is_empty() && extra.is_empty(), "not exactly once");
    });
}
