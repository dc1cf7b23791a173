//! An idempotent NATS JetStream consumer: publishes orders (every fifth twice), pulls
//! them from a durable consumer, acks only after the outcome is recorded, naks
//! retryable failures with a delay and terminates failed orders after copying them to
//! a dead-letter subject.
//! `cargo run -p idempotent-integration --example nats` (NATS with JetStream at `NATS_URL`,
//! default `127.0.0.1:4222`).

use async_nats::jetstream::{self, consumer::pull, stream};
use idempotent::consume::nats::{NatsConsumer, NatsMessage};
use idempotent::{Classify, Disposition, MemoryStore, idempotent};

#[derive(Debug, thiserror::Error, Classify)]
enum PayError {
    #[error("insufficient funds")]
    #[idempotent(terminal)]
    InsufficientFunds,
}

#[idempotent(key = "order:{/order_id}", store = store, ttl = "1h")]
async fn charge(msg: NatsMessage, store: &MemoryStore) -> Result<(), PayError> {
    let order: idempotent::serde_json::Value =
        idempotent::serde_json::from_slice(&msg.payload).expect("the key was read from this JSON");
    if order["amount_cents"].as_i64() > Some(10_000) {
        return Err(PayError::InsufficientFunds);
    }
    println!("charged order {}", order["order_id"]); // charge the customer here
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
    let js = jetstream::new(async_nats::connect(&url).await?);
    let name = format!("example-{}", idempotent::Token::random());
    let subjects = vec![format!("{name}.orders"), format!("{name}.dead")];
    let config = stream::Config { name: name.clone(), subjects, ..Default::default() };
    let orders = js.get_or_create_stream(config).await?;
    let published = 12;
    for i in 0..published {
        let (order_id, amount) = (i % 10, if i % 10 == 7 { 99_999 } else { 500 });
        let body = format!(r#"{{"order_id":{order_id},"amount_cents":{amount}}}"#);
        js.publish(format!("{name}.orders"), body.into()).await?.await?;
    }

    let config = pull::Config {
        durable_name: Some("billing".into()),
        filter_subject: format!("{name}.orders"),
        ..Default::default()
    };
    let durable = orders.get_or_create_consumer("billing", config).await?;
    let mut consumer = NatsConsumer::new(&durable, js.clone(), format!("{name}.dead")).await?;
    let store = MemoryStore::new();
    let mut counts = std::collections::HashMap::new();
    for _ in 0..published {
        let disposition = consumer.next(|msg| charge(msg, &store)).await.expect("consuming")?;
        *counts.entry(disposition).or_insert(0) += 1;
    }
    println!("{published} messages: {counts:?}; failed orders are on {name}.dead");
    assert_eq!(counts[&Disposition::DeadLetter], 1);
    js.delete_stream(&name).await?;
    Ok(())
}
