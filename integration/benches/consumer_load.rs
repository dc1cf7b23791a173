//! Each broker's consumer loop with an `#[idempotent]` handler (a `RedisStore` on the
//! local Redis) against the same loop with a plain handler: same broker, same
//! concurrency, same run, rounds alternating. The workload: `{"order_id": n}`
//! messages, every tenth a duplicate of an earlier one, a handler that only counts.
//! Publishing is not timed; the clock runs from the consumer's start until every
//! message is settled. Then the process's peak resident memory.
//!
//! `cargo bench -p idempotent-integration --bench consumer_load -- [redis-streams]
//! [rabbitmq] [nats] [kafka] [--messages N] [--rounds N] [--concurrency N]
//! [--plain-only]` (`--plain-only`: no `#[idempotent]` passes, to see the memory a
//! deep backlog takes without filling Redis with records)
//! (all four brokers by default: Redis at `REDIS_URL`, RabbitMQ at `AMQP_URL`, NATS at
//! `NATS_URL`; Kafka is an Apache Kafka broker the bench starts).

#[path = "../tests/support/kafka.rs"]
mod kafka;
mod load;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idempotent::consume::kafka::{KafkaConsumer, KafkaMessage};
use idempotent::consume::nats::{NatsConsumer, NatsMessage};
use idempotent::consume::rabbitmq::{RabbitConsumer, RabbitMessage, declare_with_dead_letter};
use idempotent::consume::redis_streams::{StreamConsumer, StreamMessage};
use idempotent::{Error, Outcome, RedisStore, Token, idempotent};
use load::median;

type Plain = Result<Outcome<()>, Error<std::convert::Infallible>>;

/// Handler calls that settled their message (not those answered `InProgress` and
/// called again), and the effects that ran.
#[derive(Default)]
struct Counts {
    settled: AtomicU64,
    effects: AtomicU64,
}

impl Counts {
    fn count(&self, result: &impl idempotent::DispositionExt) {
        if !result.is_in_progress() {
            self.settled.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Drives `run` (a consumer's loop) until `total` messages are settled.
    async fn until<E: std::fmt::Debug>(
        &self,
        total: u64,
        run: impl Future<Output = Result<(), E>>,
    ) {
        let settled = async {
            while self.settled.load(Ordering::Relaxed) < total {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        };
        tokio::select! {
            () = settled => {}
            ended = run => panic!("the consumer stopped: {ended:?}"),
        }
    }
}

#[idempotent(key = "order:{/order_id}", store = store, ttl = "1h")]
async fn stream_charge(msg: StreamMessage, store: &RedisStore, counts: &Counts) {
    let _ = msg;
    counts.effects.fetch_add(1, Ordering::Relaxed);
}

#[idempotent(key = "order:{/order_id}", store = store, ttl = "1h")]
async fn rabbit_charge(msg: RabbitMessage, store: &RedisStore, counts: &Counts) {
    let _ = msg;
    counts.effects.fetch_add(1, Ordering::Relaxed);
}

#[idempotent(key = "order:{/order_id}", store = store, ttl = "1h")]
async fn nats_charge(msg: NatsMessage, store: &RedisStore, counts: &Counts) {
    let _ = msg;
    counts.effects.fetch_add(1, Ordering::Relaxed);
}

#[idempotent(key = "order:{/order_id}", store = store, ttl = "1h")]
async fn kafka_charge(msg: KafkaMessage, store: &RedisStore, counts: &Counts) {
    let _ = msg;
    counts.effects.fetch_add(1, Ordering::Relaxed);
}

fn plain(counts: &Counts) -> Plain {
    counts.effects.fetch_add(1, Ordering::Relaxed);
    Ok(Outcome::Processed(()))
}

/// The workload's order ids, in chunks of up to 1,000: every tenth message repeats
/// an earlier order.
fn orders(messages: u64) -> impl Iterator<Item = Vec<u64>> {
    (0..messages).step_by(1_000).map(move |first| {
        (first..messages.min(first + 1_000)).map(|i| if i % 10 == 9 { i / 2 } else { i }).collect()
    })
}

/// How many distinct orders the workload has.
fn unique_orders(messages: u64) -> u64 {
    let mut seen = vec![false; messages as usize];
    orders(messages)
        .flatten()
        .filter(|&id| !std::mem::replace(&mut seen[id as usize], true))
        .count() as u64
}

fn body(order_id: u64) -> String {
    format!(r#"{{"order_id":{order_id}}}"#)
}

struct Settings {
    messages: u64,
    rounds: usize,
    concurrency: usize,
    redis_url: String,
}

/// One timed pass: a fresh queue with the workload, consumed until every message is
/// settled; messages per second.
async fn pass(broker: &str, idempotent: bool, settings: &Settings) -> f64 {
    let store = RedisStore::connect(settings.redis_url.as_str())
        .await
        .expect("Redis")
        .with_prefix(format!("bench-{}", Token::random()));
    let counts = Counts::default();
    let elapsed = match broker {
        "redis-streams" => redis_streams(&store, &counts, idempotent, settings).await,
        "rabbitmq" => rabbitmq(&store, &counts, idempotent, settings).await,
        "nats" => nats(&store, &counts, idempotent, settings).await,
        "kafka" => kafka(&store, &counts, idempotent, settings).await,
        other => panic!("unknown broker `{other}`"),
    };
    let effects = counts.effects.load(Ordering::Relaxed);
    if idempotent {
        assert_eq!(effects, unique_orders(settings.messages), "{broker}: each order once");
    }
    settings.messages as f64 / elapsed.as_secs_f64()
}

async fn redis_streams(
    store: &RedisStore,
    counts: &Counts,
    idempotent: bool,
    settings: &Settings,
) -> Duration {
    let mut conn = store.connection_manager().expect("standalone Redis").clone();
    let stream = format!("bench-{}", Token::random());
    for chunk in orders(settings.messages) {
        let mut pipe = redis::pipe();
        for &id in &chunk {
            pipe.cmd("XADD").arg(&stream).arg("*").arg("payload").arg(body(id)).ignore();
        }
        let () = pipe.query_async(&mut conn).await.unwrap();
    }
    let client = redis::Client::open(settings.redis_url.as_str()).unwrap();
    let consumer = StreamConsumer::new(&client, &stream, "bench", "bench-1")
        .await
        .unwrap()
        .batch(settings.concurrency.max(32))
        .concurrency(settings.concurrency);
    let start = Instant::now();
    while counts.settled.load(Ordering::Relaxed) < settings.messages {
        let polled = if idempotent {
            consumer
                .poll(|m| async {
                    let result = stream_charge(m, store, counts).await;
                    counts.count(&result);
                    result
                })
                .await
        } else {
            consumer
                .poll(|_| async {
                    let result = plain(counts);
                    counts.count(&result);
                    result
                })
                .await
        };
        polled.unwrap();
    }
    let elapsed = start.elapsed();
    let _: () = redis::cmd("DEL").arg(&stream).query_async(&mut conn).await.unwrap();
    elapsed
}

async fn rabbitmq(
    store: &RedisStore,
    counts: &Counts,
    idempotent: bool,
    settings: &Settings,
) -> Duration {
    use lapin::options::{BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions};
    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let connection = lapin::Connection::connect(&url, Default::default()).await.unwrap();
    let channel = connection.create_channel().await.unwrap();
    let queue = format!("bench-{}", Token::random());
    let dead = declare_with_dead_letter(&channel, &queue).await.unwrap();
    channel.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    for chunk in orders(settings.messages) {
        let mut confirms = Vec::with_capacity(chunk.len());
        for &id in &chunk {
            let confirm = channel
                .basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    body(id).as_bytes(),
                    Default::default(),
                )
                .await
                .unwrap();
            confirms.push(confirm);
        }
        for confirm in confirms {
            confirm.await.unwrap();
        }
    }
    let consuming = connection.create_channel().await.unwrap();
    let prefetch = u16::try_from(settings.concurrency * 2).unwrap_or(u16::MAX);
    consuming.basic_qos(prefetch, BasicQosOptions::default()).await.unwrap();
    let consumer = RabbitConsumer::new(&consuming, &queue, "bench")
        .await
        .unwrap()
        .concurrency(settings.concurrency);
    let start = Instant::now();
    let run = async {
        if idempotent {
            consumer
                .run(|m| async {
                    let result = rabbit_charge(m, store, counts).await;
                    counts.count(&result);
                    result
                })
                .await
        } else {
            consumer
                .run(|_| async {
                    let result = plain(counts);
                    counts.count(&result);
                    result
                })
                .await
        }
    };
    counts.until(settings.messages, run).await;
    let elapsed = start.elapsed();
    for q in [&queue, &dead] {
        channel.queue_delete(q.as_str().into(), Default::default()).await.unwrap();
    }
    connection.close(200, "done".into()).await.unwrap();
    elapsed
}

async fn nats(
    store: &RedisStore,
    counts: &Counts,
    idempotent: bool,
    settings: &Settings,
) -> Duration {
    use async_nats::jetstream::{self, consumer::pull, stream};
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
    let js = jetstream::new(async_nats::connect(&url).await.unwrap());
    let name = format!("bench_{}", Token::random());
    let subject = format!("{name}.orders");
    let config = stream::Config {
        name: name.clone(),
        subjects: vec![subject.clone(), format!("{name}.dead")],
        ..Default::default()
    };
    let created = js.get_or_create_stream(config).await.unwrap();
    for chunk in orders(settings.messages) {
        let mut acks = Vec::with_capacity(chunk.len());
        for &id in &chunk {
            acks.push(js.publish(subject.clone(), body(id).into()).await.unwrap());
        }
        for ack in acks {
            ack.await.unwrap();
        }
    }
    let config = pull::Config {
        durable_name: Some("bench".into()),
        filter_subject: subject,
        ..Default::default()
    };
    let durable = created.get_or_create_consumer("bench", config).await.unwrap();
    let consumer = NatsConsumer::new(&durable, js.clone(), format!("{name}.dead"))
        .await
        .unwrap()
        .concurrency(settings.concurrency);
    let start = Instant::now();
    let run = async {
        if idempotent {
            consumer
                .run(|m| async {
                    let result = nats_charge(m, store, counts).await;
                    counts.count(&result);
                    result
                })
                .await
        } else {
            consumer
                .run(|_| async {
                    let result = plain(counts);
                    counts.count(&result);
                    result
                })
                .await
        }
    };
    counts.until(settings.messages, run).await;
    let elapsed = start.elapsed();
    js.delete_stream(&name).await.unwrap();
    elapsed
}

async fn kafka(
    store: &RedisStore,
    counts: &Counts,
    idempotent: bool,
    settings: &Settings,
) -> Duration {
    use rdkafka::producer::{FutureProducer, FutureRecord};
    static BROKER: std::sync::OnceLock<kafka::Broker> = std::sync::OnceLock::new();
    let broker = BROKER.get_or_init(|| kafka::Broker::start().expect("Java, to run Apache Kafka"));
    let topic = format!("bench-{}", Token::random());
    let dead = format!("{topic}.dead");
    broker.create_topics(&[(&topic, 3), (&dead, 1)]).await;
    let producer: FutureProducer = broker.config().set("linger.ms", "5").create().unwrap();
    for chunk in orders(settings.messages) {
        let sends: Vec<_> = chunk
            .iter()
            .map(|&id| {
                let (key, payload) = (id.to_string(), body(id));
                let (producer, topic) = (producer.clone(), topic.as_str());
                async move {
                    let record = FutureRecord::to(topic).key(&key).payload(&payload);
                    producer.send(record, Duration::from_secs(30)).await.map_err(|(e, _)| e)
                }
            })
            .collect();
        for sent in futures_util::future::join_all(sends).await {
            sent.unwrap();
        }
    }
    let member = broker.member(&format!("bench-{}", Token::random()), &topic);
    let consumer = KafkaConsumer::new(member, producer, &dead).concurrency(settings.concurrency);
    let start = Instant::now();
    let run = async {
        if idempotent {
            consumer
                .run(|m| async {
                    let result = kafka_charge(m, store, counts).await;
                    counts.count(&result);
                    result
                })
                .await
        } else {
            consumer
                .run(|_| async {
                    let result = plain(counts);
                    counts.count(&result);
                    result
                })
                .await
        }
    };
    counts.until(settings.messages, run).await;
    start.elapsed()
}

/// The process's peak resident set, from `/proc/self/status`.
fn peak_rss() -> String {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status.lines().find(|l| l.starts_with("VmHWM:")).map(|l| l[6..].trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".to_owned())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str, default: u64| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .map_or(default, |v| v.parse().expect("a number"))
    };
    let known = ["redis-streams", "rabbitmq", "nats", "kafka"];
    let mut brokers: Vec<&str> =
        known.iter().copied().filter(|b| args.iter().any(|a| a == b)).collect();
    if brokers.is_empty() {
        brokers = known.to_vec();
    }
    let settings = Arc::new(Settings {
        messages: value("--messages", 20_000),
        rounds: value("--rounds", 3) as usize,
        concurrency: value("--concurrency", idempotent::consume::DEFAULT_CONCURRENCY as u64)
            as usize,
        redis_url: std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into()),
    });
    let plain_only = args.iter().any(|a| a == "--plain-only");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    println!(
        "{} messages (every tenth a duplicate), concurrency {}, medians of {} rounds",
        settings.messages, settings.concurrency, settings.rounds
    );
    println!("| broker | plain msg/s | `#[idempotent]` msg/s | ratio |");
    println!("| --- | --- | --- | --- |");
    for broker in brokers {
        let (mut plain, mut wrapped) = (Vec::new(), Vec::new());
        for _ in 0..settings.rounds {
            plain.push(runtime.block_on(pass(broker, false, &settings)));
            if !plain_only {
                wrapped.push(runtime.block_on(pass(broker, true, &settings)));
            }
        }
        let plain = median(plain);
        if plain_only {
            println!("| {broker} | {plain:.0} | | |");
        } else {
            let wrapped = median(wrapped);
            println!("| {broker} | {plain:.0} | {wrapped:.0} | {:.2}× |", wrapped / plain);
        }
    }
    println!("peak resident memory: {}", peak_rss());
}
