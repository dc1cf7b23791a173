//! Exactly-once consume-transform-produce on Kafka: orders in, one invoice out for
//! each, the invoices and the consumed offsets committed in one Kafka transaction.
//! Orders 0 and 1 are published twice (the store turns the second into a duplicate
//! that produces nothing); a failed order goes to the dead-letter topic in the same
//! transaction. A `read_committed` reader then sees each invoice once.
//! `cargo run -p idempotent-integration --example kafka_exactly_once` (Apache Kafka at
//! `KAFKA_BROKERS`, default `127.0.0.1:9092`, as `bash .ci/services` starts it).

use std::time::{Duration, Instant};

use idempotent::consume::kafka::{
    ExactlyOnceConsumer, KafkaContext, KafkaMessage, OutputRecord, Produced,
};
use idempotent::{Classify, MemoryStore, idempotent};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, FutureRecord};

#[derive(Debug, thiserror::Error, Classify)]
enum InvoiceError {
    #[error("amount over the limit")]
    #[idempotent(terminal)]
    OverLimit,
}

// `cache = true`: a duplicate replays the invoice it produced, and the consumer
// produces it again only if the first one's transaction never committed.
#[idempotent(key = "order:{/order_id}", store = store, ttl = "1h", cache = true)]
async fn invoice(
    msg: KafkaMessage,
    store: &MemoryStore,
    invoices: &str,
) -> Result<Produced, InvoiceError> {
    let order: idempotent::serde_json::Value =
        idempotent::serde_json::from_slice(&msg.payload).expect("the key was read from this JSON");
    if order["amount_cents"].as_i64() > Some(10_000) {
        return Err(InvoiceError::OverLimit);
    }
    let invoice =
        format!(r#"{{"order_id":{},"due_cents":{}}}"#, order["order_id"], order["amount_cents"]);
    let record = OutputRecord::to(invoices).key(order["order_id"].to_string());
    Ok(Produced::by(&msg).record(record.payload(invoice)))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", &brokers);
    let run = idempotent::Token::random();
    let topic = format!("example-orders-{run}");
    let (invoices, dead) = (format!("{topic}.invoices"), format!("{topic}.dead"));
    let admin: AdminClient<_> = config.create()?;
    let topics =
        [&topic, &invoices, &dead].map(|t| NewTopic::new(t, 1, TopicReplication::Fixed(1)));
    for created in admin.create_topics(&topics, &AdminOptions::new()).await? {
        created.map_err(|(name, e)| format!("creating {name}: {e}"))?;
    }
    let producer: FutureProducer = config.create()?;
    let mut orders = 0;
    for i in 0..12 {
        let (order_id, amount) = (i % 10, if i % 10 == 7 { 99_999 } else { 500 });
        let body = format!(r#"{{"order_id":{order_id},"amount_cents":{amount}}}"#);
        let key = order_id.to_string();
        producer
            .send(FutureRecord::to(&topic).key(&key).payload(&body), Duration::from_secs(10))
            .await
            .map_err(|(e, _)| e)?;
        orders += 1;
    }

    let member: StreamConsumer<KafkaContext> = config
        .clone()
        .set("group.id", format!("invoicing-{run}"))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create_with_context(KafkaContext::default())?;
    member.subscribe(&[&topic])?;
    // One transactional id per process: the group's generation fences a zombie.
    let mut transactional = config.clone();
    transactional.set("transactional.id", format!("invoicing-{run}"));
    let consumer = ExactlyOnceConsumer::new(member, &transactional, &dead)?;
    let store = MemoryStore::new();
    // Runs until every order is committed, then stops.
    let done = async {
        let probe: BaseConsumer =
            config.clone().set("group.id", format!("invoicing-{run}")).create()?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let mut list = rdkafka::TopicPartitionList::new();
            list.add_partition(&topic, 0);
            let committed = probe.committed_offsets(list, Duration::from_secs(5))?;
            let offset = committed.find_partition(&topic, 0).map(|e| e.offset());
            if offset == Some(rdkafka::Offset::Offset(orders)) || Instant::now() > deadline {
                return Ok::<_, Box<dyn std::error::Error>>(());
            }
        }
    };
    tokio::select! {
        ran = consumer.run(|msg| invoice(msg, &store, &invoices)) => ran?,
        done = done => done?,
    }

    // What a downstream reader sees: committed records only.
    let read = |topic: &str| -> Result<Vec<String>, Box<dyn std::error::Error>> {
        let reader: BaseConsumer = config
            .clone()
            .set("group.id", format!("audit-{run}"))
            .set("isolation.level", "read_committed")
            .set("auto.offset.reset", "earliest")
            .create()?;
        reader.subscribe(&[topic])?;
        let mut seen = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Some(record) = reader.poll(Duration::from_millis(200)) {
                seen.push(String::from_utf8_lossy(record?.payload().unwrap_or_default()).into());
            }
        }
        Ok(seen)
    };
    let (invoiced, failed) = (read(&invoices)?, read(&dead)?);
    for invoice in &invoiced {
        println!("invoice: {invoice}");
    }
    println!("{orders} orders, {} invoices, {} dead letters", invoiced.len(), failed.len());
    assert_eq!(
        (invoiced.len(), failed.len()),
        (9, 1),
        "9 good orders (2 sent twice), 1 over the limit"
    );
    Ok(())
}
