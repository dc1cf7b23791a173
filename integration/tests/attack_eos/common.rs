//! Shared helpers of the attack_eos_* probes (copied from kafka_exactly_once.rs).
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use idempotent::consume::kafka::{KafkaContext, KafkaMessage, OutputRecord, Produced};
use idempotent::testing;
use idempotent::{Classify, RedisStore, idempotent};
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use super::kafka::Broker;

#[derive(Debug, thiserror::Error, Classify)]
pub enum Fault {
    #[error("database timed out")]
    #[idempotent(retryable)]
    Flaky,
    #[error("order rejected")]
    #[idempotent(terminal)]
    Rejected,
}

pub fn order_id(body: &[u8]) -> u64 {
    std::str::from_utf8(body).unwrap().trim().parse().unwrap()
}

/// What the handler does, per order id and per start.
#[derive(Default)]
pub struct Ctl {
    pub starts: Mutex<HashMap<u64, u32>>,
    /// order -> how many first starts fail Flaky
    pub flaky: Mutex<HashMap<u64, u32>>,
    pub rejected: Mutex<std::collections::HashSet<u64>>,
    /// order -> sleep ms on every start
    pub sleep: Mutex<HashMap<u64, u64>>,
    pub handled: std::sync::atomic::AtomicU64,
}

#[idempotent(key = "{message_id}", store = store, namespace = "atk", cache = true, max_attempts = 50, lease = 30)]
pub async fn invoice(
    msg: KafkaMessage,
    store: &RedisStore,
    ctl: &Ctl,
    out: &str,
) -> Result<Produced, Fault> {
    let id = order_id(&msg.payload);
    let start = {
        let mut starts = ctl.starts.lock().unwrap();
        let n = starts.entry(id).or_default();
        *n += 1;
        *n
    };
    let sleep = ctl.sleep.lock().unwrap().get(&id).copied();
    if let Some(ms) = sleep {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if ctl.rejected.lock().unwrap().contains(&id) {
        return Err(Fault::Rejected);
    }
    let flaky = ctl.flaky.lock().unwrap().get(&id).copied().unwrap_or(0);
    if start <= flaky {
        return Err(Fault::Flaky);
    }
    let record = OutputRecord::to(out).key(id.to_string()).payload(format!("invoice {id}"));
    Ok(Produced::by(&msg).record(record))
}

/// Publishes order ids, each with message-id `{topic}/{id}` (a repeated id is a
/// duplicate business message).
pub async fn publish(broker: &Broker, topic: &str, ids: impl IntoIterator<Item = u64>) {
    use rdkafka::message::{Header, OwnedHeaders};
    let producer: FutureProducer = broker.config().set("linger.ms", "5").create().unwrap();
    let mut sends = Vec::new();
    for id in ids {
        let (key, body, message_id) = (id.to_string(), id.to_string(), format!("{topic}/{id}"));
        let headers =
            OwnedHeaders::new().insert(Header { key: "message-id", value: Some(&message_id) });
        let record = FutureRecord::to(topic).key(&key).payload(&body).headers(headers);
        sends.push(producer.send_result(record).map_err(|(e, _)| e).unwrap());
    }
    for send in sends {
        send.await.unwrap().map_err(|(e, _)| e).unwrap();
    }
}

/// Publishes (partition, id) pairs to explicit partitions.
pub async fn publish_to(broker: &Broker, topic: &str, items: &[(i32, u64)]) {
    use rdkafka::message::{Header, OwnedHeaders};
    let producer: FutureProducer = broker.config().set("linger.ms", "5").create().unwrap();
    let mut sends = Vec::new();
    for (partition, id) in items {
        let (key, body, message_id) = (id.to_string(), id.to_string(), format!("{topic}/{id}"));
        let headers =
            OwnedHeaders::new().insert(Header { key: "message-id", value: Some(&message_id) });
        let record =
            FutureRecord::to(topic).partition(*partition).key(&key).payload(&body).headers(headers);
        sends.push(producer.send_result(record).map_err(|(e, _)| e).unwrap());
    }
    for send in sends {
        send.await.unwrap().map_err(|(e, _)| e).unwrap();
    }
}

pub async fn redis_store() -> RedisStore {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    RedisStore::connect(url.as_str()).await.unwrap_or_else(|e| panic!("Redis at {url}: {e}"))
}

pub fn member_with(
    broker_address: &str,
    group: &str,
    topic: &str,
    settings: &[(&str, &str)],
) -> StreamConsumer<KafkaContext> {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", broker_address)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest");
    if !settings.contains(&("group.protocol", "consumer")) {
        config.set("session.timeout.ms", "6000").set("heartbeat.interval.ms", "500");
    }
    for (k, v) in settings {
        config.set(*k, *v);
    }
    let consumer: StreamConsumer<KafkaContext> =
        config.create_with_context(KafkaContext::default()).unwrap();
    consumer.subscribe(&[topic]).unwrap();
    consumer
}

pub fn transactional_producer(broker_address: &str, id: &str, timeout_ms: u32) -> FutureProducer {
    ClientConfig::new()
        .set("bootstrap.servers", broker_address)
        .set("transactional.id", id)
        .set("transaction.timeout.ms", timeout_ms.to_string())
        .create()
        .unwrap()
}

/// Reads `topic` from the start until `want` records came (then `quiet` more), or
/// `limit`; answers each record's order id.
pub fn read(broker: &str, topic: &str, isolation: &str, want: usize, limit: Duration) -> Vec<u64> {
    let reader: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", broker)
        .set("group.id", format!("inspect-{}", testing::fresh_key("r").namespace()))
        .set("isolation.level", isolation)
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    reader.subscribe(&[topic]).unwrap();
    let mut records = Vec::new();
    let deadline = Instant::now() + limit;
    let mut quiet_from: Option<Instant> = None;
    while Instant::now() < deadline {
        match reader.poll(Duration::from_millis(200)) {
            Some(Ok(record)) => {
                let text = String::from_utf8_lossy(record.payload().unwrap_or_default());
                let id = text.trim_start_matches("invoice ").parse().unwrap_or(u64::MAX);
                records.push(id);
                quiet_from = None;
            }
            Some(Err(error)) => panic!("reading {topic}: {error}"),
            None => {}
        }
        if records.len() >= want {
            let since = *quiet_from.get_or_insert_with(Instant::now);
            if since.elapsed() > Duration::from_secs(2) {
                break;
            }
        }
    }
    records
}

pub fn committed_and_end(
    broker_address: &str,
    group: &str,
    topic: &str,
    partitions: i32,
) -> (Vec<i64>, Vec<i64>) {
    let probe: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", broker_address)
        .set("group.id", group)
        .create()
        .unwrap();
    let mut list = TopicPartitionList::new();
    for p in 0..partitions {
        list.add_partition(topic, p);
    }
    let committed = probe.committed_offsets(list, Duration::from_secs(10)).unwrap();
    let committed = (0..partitions)
        .map(|p| match committed.find_partition(topic, p).map(|e| e.offset()) {
            Some(Offset::Offset(o)) => o,
            _ => -1,
        })
        .collect();
    let ends = (0..partitions)
        .map(|p| probe.fetch_watermarks(topic, p, Duration::from_secs(10)).unwrap().1)
        .collect();
    (committed, ends)
}

/// Counts: (doubled ids with counts, missing ids, unexpected ids).
pub fn tally(got: &[u64], want: &[u64]) -> (Vec<(u64, usize)>, Vec<u64>, Vec<u64>) {
    let mut counts: HashMap<u64, usize> = HashMap::new();
    for id in got {
        *counts.entry(*id).or_default() += 1;
    }
    let mut doubled: Vec<_> =
        counts.iter().filter(|(_, n)| **n > 1).map(|(i, n)| (*i, *n)).collect();
    doubled.sort();
    let want_set: std::collections::HashSet<u64> = want.iter().copied().collect();
    let mut missing: Vec<_> = want.iter().copied().filter(|id| !counts.contains_key(id)).collect();
    missing.sort();
    missing.dedup();
    let mut extra: Vec<_> = counts.keys().copied().filter(|id| !want_set.contains(id)).collect();
    extra.sort();
    (doubled, missing, extra)
}

pub struct Topics {
    pub input: String,
    pub output: String,
    pub dead: String,
}

impl Topics {
    pub async fn create(broker: &Broker, partitions: i32) -> Topics {
        let input = testing::fresh_key("atk").namespace().to_owned();
        let topics =
            Topics { output: format!("{input}.invoices"), dead: format!("{input}.dead"), input };
        broker
            .create_topics(&[(&topics.input, partitions), (&topics.output, 2), (&topics.dead, 1)])
            .await;
        topics
    }
}
