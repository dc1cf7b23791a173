//! Consume-transform-produce on Kafka, one output record per input: the exactly-once
//! consumer (outputs and offsets in one transaction per batch) against the
//! at-least-once consumer producing the same output and waiting for the broker's
//! acknowledgement before its commit, on the same broker, in the same run, rounds
//! alternating. Both handlers only build the output; no store. The clock runs from the
//! consumer's start until every input is settled (at-least-once) or committed
//! (exactly-once: its outputs visible to a `read_committed` reader).
//!
//! `cargo bench -p idempotent-integration --bench kafka_exactly_once -- [--messages N]
//! [--rounds N] [--partitions N]` (an Apache Kafka broker the bench starts, from the
//! jars `bash .ci/services` caches).

#[path = "../tests/support/kafka.rs"]
mod kafka;
mod load;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idempotent::consume::kafka::{
    ExactlyOnceConsumer, KafkaConsumer, KafkaContext, OutputRecord, Produced,
};
use idempotent::{Error, Outcome, Token};
use load::median;
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};

type Never = std::convert::Infallible;

struct Settings {
    messages: u64,
    rounds: usize,
    partitions: i32,
}

/// A topic holding the workload, an output topic and a dead-letter topic.
async fn topics(broker: &kafka::Broker, settings: &Settings) -> (String, String, String) {
    let input = format!("bench-{}", Token::random());
    let (output, dead) = (format!("{input}.out"), format!("{input}.dead"));
    let p = settings.partitions;
    broker.create_topics(&[(&input, p), (&output, p), (&dead, 1)]).await;
    let producer: FutureProducer = broker.config().set("linger.ms", "5").create().unwrap();
    let mut sends = Vec::new();
    for id in 0..settings.messages {
        let (key, payload) = (id.to_string(), format!(r#"{{"order_id":{id}}}"#));
        let record = FutureRecord::to(&input).key(&key).payload(&payload);
        sends.push(producer.send_result(record).map_err(|(e, _)| e).unwrap());
    }
    for sent in sends {
        sent.await.unwrap().map_err(|(e, _)| e).unwrap();
    }
    (input, output, dead)
}

/// The transform: an invoice for the order.
fn invoice(payload: &[u8]) -> Vec<u8> {
    let mut out = b"invoice ".to_vec();
    out.extend_from_slice(payload);
    out
}

async fn at_least_once(broker: &kafka::Broker, settings: &Settings) -> Duration {
    let (input, output, dead) = topics(broker, settings).await;
    let producer: FutureProducer = broker.config().set("linger.ms", "1").create().unwrap();
    let member = broker.member(&format!("bench-{}", Token::random()), &input);
    let consumer = KafkaConsumer::new(member, producer.clone(), &dead);
    let settled = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let run = consumer.run(|m| {
        let (producer, output, settled) = (producer.clone(), output.clone(), settled.clone());
        async move {
            let value = invoice(&m.payload);
            let key = m.key.clone().unwrap_or_default();
            let record = FutureRecord::to(&output).key(&key).payload(&value);
            let sent = producer.send(record, Duration::from_secs(30)).await;
            settled.fetch_add(1, Ordering::Relaxed);
            sent.map(|_| Outcome::Processed(())).map_err(|(e, _)| Error::<Never>::Panicked {
                message: e.to_string(),
                attempt: 1,
                exhausted: false,
                retry_after: Duration::from_millis(100),
            })
        }
    });
    let done = async {
        while settled.load(Ordering::Relaxed) < settings.messages {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    };
    tokio::select! {
        () = done => {}
        ended = run => panic!("the consumer stopped: {ended:?}"),
    }
    start.elapsed()
}

async fn exactly_once(broker: &kafka::Broker, settings: &Settings) -> Duration {
    let (input, output, dead) = topics(broker, settings).await;
    let group = format!("bench-{}", Token::random());
    let member: StreamConsumer<KafkaContext> = broker.member(&group, &input);
    let mut transactional = broker.config();
    transactional.set("transactional.id", &group).set("linger.ms", "1");
    let consumer = ExactlyOnceConsumer::new(member, &transactional, &dead).unwrap();
    let start = Instant::now();
    let run = consumer.run(|m| {
        let record = OutputRecord::to(&output)
            .key(m.key.clone().unwrap_or_default())
            .payload(invoice(&m.payload));
        let produced = Produced::by(&m).record(record);
        async move { Ok::<_, Error<Never>>(Outcome::Processed(produced)) }
    });
    let probe: BaseConsumer = broker.config().set("group.id", &group).create().unwrap();
    let done = async {
        loop {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let mut list = TopicPartitionList::new();
            for p in 0..settings.partitions {
                list.add_partition(&input, p);
            }
            // The group's coordinator may not answer yet on a fresh broker: ask again.
            let Ok(committed) = probe.committed_offsets(list, Duration::from_secs(5)) else {
                continue;
            };
            let total: i64 = (committed.elements().iter())
                .map(|e| if let Offset::Offset(o) = e.offset() { o } else { 0 })
                .sum();
            if total >= settings.messages as i64 {
                return;
            }
        }
    };
    tokio::select! {
        () = done => {}
        ended = run => panic!("the consumer stopped: {ended:?}"),
    }
    start.elapsed()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str, default: u64| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .map_or(default, |v| v.parse().expect("a number"))
    };
    let settings = Settings {
        messages: value("--messages", 20_000),
        rounds: value("--rounds", 3) as usize,
        partitions: value("--partitions", 3) as i32,
    };
    let broker = kafka::Broker::start().expect("Java, to run Apache Kafka");
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    let (mut plain, mut transactional) = (Vec::new(), Vec::new());
    runtime.block_on(async {
        for round in 0..settings.rounds {
            let a = at_least_once(&broker, &settings).await;
            let b = exactly_once(&broker, &settings).await;
            let rate = |d: Duration| settings.messages as f64 / d.as_secs_f64();
            println!(
                "round {}: at-least-once {:.0} msg/s, exactly-once {:.0} msg/s",
                round + 1,
                rate(a),
                rate(b)
            );
            plain.push(rate(a));
            transactional.push(rate(b));
        }
    });
    let (a, b) = (median(plain), median(transactional));
    println!(
        "{} messages, {} partitions, medians of {}: at-least-once {a:.0} msg/s, \
         exactly-once {b:.0} msg/s ({:.2}x)",
        settings.messages,
        settings.partitions,
        settings.rounds,
        b / a
    );
}
