//! An idempotent RabbitMQ consumer: publishes orders (every fifth twice, as a retrying
//! producer would), consumes them with manual acks sent only after the outcome is
//! recorded, rejects failed orders to a dead-letter queue.
//! `cargo run -p idempotent-integration --example rabbitmq` (RabbitMQ at `AMQP_URL`, default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`).

use idempotent::consume::rabbitmq::{RabbitConsumer, RabbitMessage, declare_with_dead_letter};
use idempotent::{Classify, Disposition, MemoryStore, idempotent};
use lapin::options::{BasicPublishOptions, BasicQosOptions};
use lapin::{BasicProperties, Connection, ConnectionProperties};

#[derive(Debug, thiserror::Error, Classify)]
enum PayError {
    #[error("insufficient funds")]
    #[idempotent(terminal)]
    InsufficientFunds,
}

#[idempotent(key = "order:{/order_id}", store = store, ttl = "1h")]
async fn charge(msg: RabbitMessage, store: &MemoryStore) -> Result<(), PayError> {
    let order: idempotent::serde_json::Value =
        idempotent::serde_json::from_slice(&msg.body).expect("the key was read from this JSON");
    if order["amount_cents"].as_i64() > Some(10_000) {
        return Err(PayError::InsufficientFunds);
    }
    println!("charged order {}", order["order_id"]); // charge the customer here
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let connection = Connection::connect(&url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    let queue = format!("example-orders-{}", idempotent::Token::random());
    let dead = declare_with_dead_letter(&channel, &queue).await?;
    let published = 12;
    for i in 0..published {
        let (order_id, amount) = (i % 10, if i % 10 == 7 { 99_999 } else { 500 });
        let body = format!(r#"{{"order_id":{order_id},"amount_cents":{amount}}}"#);
        let props = BasicProperties::default();
        channel
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                props,
            )
            .await?
            .await?;
    }

    channel.basic_qos(16, BasicQosOptions::default()).await?;
    let store = MemoryStore::new();
    let mut consumer = RabbitConsumer::new(&channel, &queue, "billing-1").await?;
    let mut counts = std::collections::HashMap::new();
    for _ in 0..published {
        let disposition = consumer.next(|msg| charge(msg, &store)).await.expect("consuming")?;
        *counts.entry(disposition).or_insert(0) += 1;
    }
    println!("{published} deliveries: {counts:?}; failed orders are in {dead}");
    assert_eq!(counts[&Disposition::DeadLetter], 1);
    for q in [&queue, &dead] {
        channel.queue_delete(q.as_str().into(), Default::default()).await?;
    }
    connection.close(200, "done".into()).await?;
    Ok(())
}
