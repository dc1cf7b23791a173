//! An idempotent Kafka consumer: publishes orders (every fifth twice) to a topic,
//! consumes them in a consumer group, commits each offset only after the outcome is
//! recorded, sends failed orders to a dead-letter topic.
//! `cargo run -p idempotent-integration --example kafka` (a Kafka broker at
//! `KAFKA_BROKERS`, default `127.0.0.1:9092`, as `bash .ci/services` starts it).

use std::time::Duration;

use idempotent::consume::kafka::{KafkaConsumer, KafkaContext, KafkaMessage};
use idempotent::{Classify, Disposition, MemoryStore, idempotent};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::producer::{FutureProducer, FutureRecord};

#[derive(Debug, thiserror::Error, Classify)]
enum PayError {
    #[error("insufficient funds")]
    #[idempotent(terminal)]
    InsufficientFunds,
}

#[idempotent(key = "order:{/order_id}", store = store, ttl = "1h")]
async fn charge(msg: KafkaMessage, store: &MemoryStore) -> Result<(), PayError> {
    let order: idempotent::serde_json::Value =
        idempotent::serde_json::from_slice(&msg.payload).expect("the key was read from this JSON");
    if order["amount_cents"].as_i64() > Some(10_000) {
        return Err(PayError::InsufficientFunds);
    }
    println!(
        "charged order {} (partition {}, offset {})",
        order["order_id"], msg.partition, msg.offset
    );
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", &brokers);
    let topic = format!("example-orders-{}", idempotent::Token::random());
    let dead = format!("{topic}.dead");
    let topics = [&topic, &dead].map(|t| NewTopic::new(t, 1, TopicReplication::Fixed(1)));
    let admin: AdminClient<_> = config.create()?;
    admin.create_topics(&topics, &AdminOptions::new()).await?;
    let producer: FutureProducer = config.create()?;
    let published = 12;
    for i in 0..published {
        let (order_id, amount) = (i % 10, if i % 10 == 7 { 99_999 } else { 500 });
        let body = format!(r#"{{"order_id":{order_id},"amount_cents":{amount}}}"#);
        let record = FutureRecord::to(&topic).key("orders").payload(&body);
        producer.send(record, Duration::from_secs(10)).await.map_err(|(e, _)| e)?;
    }

    let mut group = config.clone();
    group.set("group.id", "billing").set("enable.auto.commit", "false");
    let member: StreamConsumer<KafkaContext> =
        group.set("auto.offset.reset", "earliest").create_with_context(KafkaContext::default())?;
    member.subscribe(&[&topic])?;
    let mut consumer = KafkaConsumer::new(member, producer, &dead);
    let store = MemoryStore::new();
    let mut counts = std::collections::HashMap::new();
    while counts.values().sum::<i32>() < published {
        if let Some(disposition) = consumer.next(|msg| charge(msg, &store)).await? {
            *counts.entry(disposition).or_insert(0) += 1;
        }
    }
    println!("{published} records: {counts:?}; failed orders are on {dead}");
    assert_eq!(counts[&Disposition::DeadLetter], 1);
    Ok(())
}
