//! Metrics through Prometheus: the `metrics` feature counts every call by namespace
//! and outcome and times claims and handler bodies; any exporter of the `metrics`
//! facade receives them. This one installs the Prometheus exporter's recorder (an
//! application would also serve `handle.render()` on its `/metrics` endpoint), runs
//! a few deliveries with duplicates and a failure, and prints what Prometheus would
//! scrape.
//!
//! `cargo run -p idempotent-integration --features metrics --example metrics`

use idempotent::{Classify, MemoryStore, idempotent};
use metrics_exporter_prometheus::PrometheusBuilder;

#[derive(Debug, thiserror::Error, Classify)]
enum PayError {
    #[error("card declined")]
    #[idempotent(terminal)]
    Declined,
}

struct Payment {
    id: u32,
    cents: u64,
}

#[idempotent(key = "payment:{id}", namespace = "charge", store = store)]
async fn charge(msg: Payment, store: &MemoryStore) -> Result<u64, PayError> {
    if msg.cents == 0 {
        return Err(PayError::Declined);
    }
    Ok(msg.cents)
}

#[tokio::main]
async fn main() {
    // Before the first call: handles registered with no recorder record nothing.
    let handle = PrometheusBuilder::new()
        // Histograms as buckets, as most Prometheus setups want them.
        .set_buckets(&[0.000_01, 0.000_1, 0.001, 0.01, 0.1, 1.0])
        .expect("buckets")
        .install_recorder()
        .expect("no other recorder is installed");
    let store = MemoryStore::new();
    // Payment 2 is delivered three times; payment 3 is declined.
    for (id, cents) in [(1, 500), (2, 1200), (2, 1200), (2, 1200), (3, 0)] {
        let outcome = charge(Payment { id, cents }, &store).await;
        println!("payment {id}: {outcome:?}");
    }
    println!();
    print!("{}", handle.render());
}
