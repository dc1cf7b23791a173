//! An idempotent RocketMQ consumer: publishes orders with their order id as the
//! business key (every fifth order twice), consumes them in a consumer group, commits
//! only after the outcome is recorded, and sends failed orders to the group's
//! dead-letter queue `%DLQ%{group}`.
//! `cargo run -p idempotent-integration --example rocketmq` (a RocketMQ name server at
//! `ROCKETMQ_NAMESRV`, default `127.0.0.1:9876`, with a broker that creates topics).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use idempotent::consume::rocketmq::{RocketMqConsumer, RocketMqMessage};
use idempotent::publish::rocketmq::RocketMqPublisher;
use idempotent::{Classify, Disposition, DispositionExt, MemoryStore, idempotent};

#[derive(Debug, thiserror::Error, Classify)]
enum PayError {
    #[error("insufficient funds")]
    #[idempotent(terminal)]
    InsufficientFunds,
}

// The business key (`KEYS`) is the same when the producer sends an order again; the
// message id (`{message_id}`) would not be.
#[idempotent(key = "order:{keys}", store = store, ttl = "1h")]
async fn charge(msg: RocketMqMessage, store: &MemoryStore) -> Result<(), PayError> {
    let order: idempotent::serde_json::Value =
        idempotent::serde_json::from_slice(&msg.body).map_err(|_| PayError::InsufficientFunds)?;
    if order["amount_cents"].as_i64() > Some(10_000) {
        return Err(PayError::InsufficientFunds);
    }
    println!("charged order {}", msg.keys); // charge the customer here
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let name_server = std::env::var("ROCKETMQ_NAMESRV").unwrap_or_else(|_| "127.0.0.1:9876".into());
    let topic = format!("orders-{}", idempotent::Token::random());
    let publisher = RocketMqPublisher::start(&name_server, "orders-producer").await?;
    let published = 12;
    for i in 0..published {
        let (order_id, amount) = (i % 10, if i % 10 == 7 { 99_999 } else { 500 });
        let body = format!(r#"{{"order_id":{order_id},"amount_cents":{amount}}}"#);
        publisher.publish(&topic, &order_id.to_string(), body.as_bytes()).await?;
    }
    publisher.shutdown().await;

    let store = Arc::new(MemoryStore::new());
    let counts = Arc::new(Mutex::new(HashMap::<Disposition, usize>::new()));
    let (settled, mut all_settled) = tokio::sync::mpsc::unbounded_channel();
    let consumer = RocketMqConsumer::new(&name_server, "billing", topic).from_first_offset();
    let (store2, counts2) = (store.clone(), counts.clone());
    let running = tokio::spawn(async move {
        let run = consumer.run(move |msg| {
            let (store, counts, settled) = (store2.clone(), counts2.clone(), settled.clone());
            async move {
                let result = charge(msg, &store).await;
                *counts.lock().unwrap().entry(result.disposition()).or_insert(0) += 1;
                let _ = settled.send(());
                result
            }
        });
        run.await
    });
    for _ in 0..published {
        all_settled.recv().await;
    }
    running.abort();
    let counts = counts.lock().unwrap().clone();
    println!("{published} messages: {counts:?}; failed orders are in %DLQ%billing");
    assert_eq!(counts[&Disposition::DeadLetter], 1);
    Ok(())
}
