//! Exactly-once consume-transform-produce against Apache Kafka, judged from outside:
//! a `read_committed` reader of the output and dead-letter topics, and the group's
//! committed offsets. A consumer process SIGKILLed mid-transaction leaves nothing of
//! that transaction visible; a zombie (stopped past its session timeout, then resumed)
//! cannot commit; 10,000 records with duplicates, retryable and terminal failures, and
//! a member joining mid-stream, give each output exactly once.

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotent::consume::kafka::{
    ExactlyOnceConsumer, KafkaContext, KafkaMessage, OutputRecord, Produced,
};
use idempotent::testing::{self, block_on};
use idempotent::{Classify, RedisStore, idempotent};
use kafka::Broker;
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, FutureRecord};

#[path = "support/kafka.rs"]
mod kafka;

const PARTITIONS: i32 = 3;

#[derive(Debug, thiserror::Error, Classify)]
enum Fault {
    #[error("database timed out")]
    #[idempotent(retryable)]
    Flaky,
    #[error("order rejected")]
    #[idempotent(terminal)]
    Rejected,
}

fn rejected(id: u64) -> bool {
    id % 100 == 13
}

fn flaky(id: u64) -> bool {
    id % 50 == 7
}

fn order_id(body: &[u8]) -> u64 {
    std::str::from_utf8(body).unwrap().trim().parse().unwrap()
}

/// What the handlers saw: how often each order's handler started.
#[derive(Default)]
struct Seen {
    starts: Mutex<HashMap<u64, u32>>,
}

/// The transform: one invoice per order, to `out`; rejected orders fail for good,
/// flaky ones fail their first attempt. `hold`: the order at which the handler prints
/// `holding` and waits, to be stopped there. `stall`: the order whose invoice goes with
/// a record to `{out}.missing`, a topic the test creates later: the transaction
/// waits for it, its other records produced and not committed.
#[idempotent(key = "{message_id}", store = store, namespace = "invoice", cache = true, max_attempts = 5, lease = 5)]
async fn invoice(
    msg: KafkaMessage,
    store: &RedisStore,
    seen: &Seen,
    out: &str,
    hold: Option<u64>,
    stall: Option<u64>,
) -> Result<Produced, Fault> {
    let id = order_id(&msg.payload);
    let start = {
        let mut starts = seen.starts.lock().unwrap();
        let n = starts.entry(id).or_default();
        *n += 1;
        *n
    };
    if rejected(id) {
        return Err(Fault::Rejected);
    }
    if flaky(id) && start == 1 {
        return Err(Fault::Flaky);
    }
    if hold == Some(id) {
        println!("holding {id}");
        // Long enough to be killed or stopped here; short enough that a stopped
        // member resumes within its transaction's timeout (20 s).
        tokio::time::sleep(Duration::from_secs(12)).await;
    }
    let record = OutputRecord::to(out).key(id.to_string()).payload(format!("invoice {id}"));
    let mut produced = Produced::by(&msg).record(record);
    if stall == Some(id) {
        produced = produced.record(OutputRecord::to(format!("{out}.missing")).payload("audit"));
    }
    Ok(produced)
}

/// Publishes order `ids` to `topic` keyed by order id, each with a `message-id` that
/// a duplicate repeats (the producer sent the same business message again), unique to
/// the topic (the machine's Redis keeps the records of every run).
async fn publish(broker: &Broker, topic: &str, ids: impl IntoIterator<Item = u64>) {
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

/// The orders published: `unique` orders, every tenth message repeating an earlier one.
fn orders(unique: u64) -> Vec<u64> {
    let mut ids = Vec::new();
    for id in 0..unique {
        ids.push(id);
        if id % 9 == 8 {
            ids.push(id / 2);
        }
    }
    ids
}

/// The machine's Redis, which outlives a killed member, as a production store does.
async fn redis_store() -> RedisStore {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    RedisStore::connect(url.as_str()).await.unwrap_or_else(|e| panic!("Redis at {url}: {e}"))
}

fn member(broker_address: &str, group: &str, topic: &str) -> StreamConsumer<KafkaContext> {
    let consumer: StreamConsumer<KafkaContext> = ClientConfig::new()
        .set("bootstrap.servers", broker_address)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "500")
        .create_with_context(KafkaContext::default())
        .unwrap();
    consumer.subscribe(&[topic]).unwrap();
    consumer
}

fn transactional_producer(broker_address: &str, id: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", broker_address)
        .set("transactional.id", id)
        .set("transaction.timeout.ms", "20000");
    config
}

/// Reads `topic` from the start with `isolation` until `want` records came, then 2 s
/// more for any extra one; answers each record's order id and, for a dead letter,
/// the input record it came from.
fn read(broker: &str, topic: &str, isolation: &str, want: usize) -> Vec<(u64, Option<String>)> {
    read_until(broker, topic, isolation, |records| records.len() >= want)
}

/// Reads `topic` from the start with `isolation` until `enough` holds of what came,
/// then 2 s more for any extra record.
fn read_until(
    broker: &str,
    topic: &str,
    isolation: &str,
    enough: impl Fn(&[(u64, Option<String>)]) -> bool,
) -> Vec<(u64, Option<String>)> {
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
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut quiet_from: Option<Instant> = None;
    while Instant::now() < deadline {
        match reader.poll(Duration::from_millis(200)) {
            Some(Ok(record)) => {
                let text = String::from_utf8_lossy(record.payload().unwrap_or_default());
                let id = text.trim_start_matches("invoice ").parse().unwrap_or(u64::MAX);
                let source = record.headers().and_then(|headers| {
                    use rdkafka::message::Headers;
                    let header = |name: &str| {
                        headers
                            .iter()
                            .find(|h| h.key == name)
                            .and_then(|h| h.value)
                            .map(|v| String::from_utf8_lossy(v).into_owned())
                    };
                    Some(format!(
                        "{}/{}/{}",
                        header("idempotent-source-topic")?,
                        header("idempotent-source-partition")?,
                        header("idempotent-source-offset")?
                    ))
                });
                records.push((id, source));
                quiet_from = None;
            }
            Some(Err(error)) => panic!("reading {topic}: {error}"),
            None => {}
        }
        if enough(&records) {
            let since = *quiet_from.get_or_insert_with(Instant::now);
            if since.elapsed() > Duration::from_secs(2) {
                break;
            }
        }
    }
    records
}

/// Checks, from outside, that every good order was invoiced exactly once, every
/// rejected one dead-lettered (each input record of it once: a duplicate of a
/// rejected order is a record of its own), and the group committed every input.
fn assert_exactly_once(broker: &str, group: &str, topics: &Topics, unique: u64) {
    let good: Vec<u64> = (0..unique).filter(|&id| !rejected(id)).collect();
    let bad: Vec<u64> = (0..unique).filter(|&id| rejected(id)).collect();
    let invoices: Vec<u64> = read(broker, &topics.output, "read_committed", good.len())
        .into_iter()
        .map(|r| r.0)
        .collect();
    assert_once(&invoices, &good, "invoices");
    let dead = read(broker, &topics.dead, "read_committed", bad.len());
    let dead_ids: HashSet<u64> = dead.iter().map(|r| r.0).collect();
    assert_eq!(dead_ids, bad.iter().copied().collect(), "the rejected orders are dead-lettered");
    let mut sources = HashSet::new();
    for (id, source) in &dead {
        let source =
            source.clone().unwrap_or_else(|| panic!("dead letter {id} without its source"));
        assert!(sources.insert(source.clone()), "input {source} dead-lettered twice");
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (committed, ends) = kafka::committed_and_end(broker, group, &topics.input, PARTITIONS);
        if committed == ends {
            break;
        }
        assert!(Instant::now() < deadline, "committed {committed:?} of {ends:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn assert_once(got: &[u64], want: &[u64], what: &str) {
    let mut counts: HashMap<u64, usize> = HashMap::new();
    for id in got {
        *counts.entry(*id).or_default() += 1;
    }
    let doubled: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).map(|(id, _)| *id).collect();
    let want_set: HashSet<u64> = want.iter().copied().collect();
    let missing: Vec<_> = want.iter().filter(|id| !counts.contains_key(id)).collect();
    let extra: Vec<_> = counts.keys().filter(|id| !want_set.contains(id)).collect();
    assert!(
        doubled.is_empty() && missing.is_empty() && extra.is_empty(),
        "{what}: {} read; doubled {doubled:?}, missing {missing:?}, unexpected {extra:?}",
        got.len()
    );
}

#[derive(Clone)]
struct Topics {
    input: String,
    output: String,
    dead: String,
}

impl Topics {
    async fn create(broker: &Broker) -> Topics {
        let input = testing::fresh_key("orders").namespace().to_owned();
        let topics =
            Topics { output: format!("{input}.invoices"), dead: format!("{input}.dead"), input };
        broker
            .create_topics(&[(&topics.input, PARTITIONS), (&topics.output, 2), (&topics.dead, 1)])
            .await;
        topics
    }
}

/// Runs one member in this process until `stop` is told.
fn spawn_member(
    broker: &str,
    group: &str,
    topics: &Topics,
    transactional_id: &str,
    store: RedisStore,
    seen: Arc<Seen>,
    handled: Arc<AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    let consumer = ExactlyOnceConsumer::new(
        member(broker, group, &topics.input),
        &transactional_producer(broker, transactional_id),
        topics.dead.clone(),
    )
    .unwrap()
    .retry_delay(Duration::from_millis(100));
    let out = topics.output.clone();
    tokio::spawn(async move {
        consumer
            .run(|msg| {
                let (store, seen, out, handled) =
                    (store.clone(), seen.clone(), out.clone(), handled.clone());
                async move {
                    let result = invoice(msg, &store, &seen, &out, None, None).await;
                    handled.fetch_add(1, Ordering::Relaxed);
                    result
                }
            })
            .await
            .expect("consuming");
    })
}

/// 10,000 orders (and a tenth again, as duplicates the producer sent), some failing
/// once, some for good; one member, then a second joining mid-stream (a rebalance),
/// then the first leaving. Each invoice appears once, each rejected order once in the
/// dead-letter topic, and every input is committed.
#[test]
fn ten_thousand_orders_with_duplicates_failures_and_a_rebalance_each_output_once() {
    let Some(broker) = Broker::start() else { return };
    block_on(async {
        let topics = Topics::create(&broker).await;
        let unique = 10_000;
        publish(&broker, &topics.input, orders(unique)).await;
        let group = format!("invoicing-{}", topics.input);
        let store = redis_store().await;
        let seen = Arc::new(Seen::default());
        let handled = Arc::new(AtomicU64::new(0));
        let address = broker.address.clone();
        let first = spawn_member(
            &address,
            &group,
            &topics,
            "invoicing-a",
            store.clone(),
            seen.clone(),
            handled.clone(),
        );
        while handled.load(Ordering::Relaxed) < 3_000 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let second =
            spawn_member(&address, &group, &topics, "invoicing-b", store, seen, handled.clone());
        while handled.load(Ordering::Relaxed) < 6_000 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The first member leaves without a word: dropped mid-batch, its transaction
        // open, until its timeout or the next member of its id.
        first.abort();
        let _ = first.await;
        let check = tokio::task::spawn_blocking({
            let group = group.clone();
            move || assert_exactly_once(&address, &group, &topics, unique)
        });
        check.await.unwrap();
        second.abort();
    });
}

/// The child process of the crash tests: one member, configured by the environment,
/// printing `holding N` when its handler reaches the order to hold at. Not a test of
/// its own.
#[test]
#[ignore = "run as a child process by the crash tests"]
fn exactly_once_member_process() {
    let env = |name: &str| std::env::var(name).unwrap();
    let (broker, group, input) = (env("EOS_BROKER"), env("EOS_GROUP"), env("EOS_INPUT"));
    let (output, dead, id) = (env("EOS_OUTPUT"), env("EOS_DEAD"), env("EOS_TRANSACTIONAL_ID"));
    let hold: Option<u64> = std::env::var("EOS_HOLD").ok().map(|h| h.parse().unwrap());
    let stall: Option<u64> = std::env::var("EOS_STALL").ok().map(|h| h.parse().unwrap());
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(async move {
        let consumer = ExactlyOnceConsumer::new(
            member(&broker, &group, &input),
            &transactional_producer(&broker, &id),
            dead,
        )
        .unwrap()
        .retry_delay(Duration::from_millis(100))
        .max_batch(50);
        let (store, seen) = (redis_store().await, Seen::default());
        println!("started");
        consumer
            .run(|msg| invoice(msg, &store, &seen, &output, hold, stall))
            .await
            .expect("consuming");
    });
}

/// A member process of the crash tests; its stdout lines go to a channel.
struct MemberProcess {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl MemberProcess {
    /// `at`: an order the member holds its handler at (`EOS_HOLD`) or stalls its
    /// transaction at (`EOS_STALL`).
    fn start(
        broker: &str,
        group: &str,
        topics: &Topics,
        id: &str,
        at: Option<(&str, u64)>,
    ) -> Self {
        let mut command = Command::new(std::env::current_exe().unwrap());
        command
            .args(["--ignored", "--exact", "exactly_once_member_process", "--nocapture"])
            .env("EOS_BROKER", broker)
            .env("EOS_GROUP", group)
            .env("EOS_INPUT", &topics.input)
            .env("EOS_OUTPUT", &topics.output)
            .env("EOS_DEAD", &topics.dead)
            .env("EOS_TRANSACTIONAL_ID", id)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some((what, order)) = at {
            command.env(what, order.to_string());
        }
        let mut child = command.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (send, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = send.send(line);
            }
        });
        MemberProcess { child, lines }
    }

    /// Waits for a line starting with `prefix`.
    fn wait_for(&self, prefix: &str) {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.starts_with(prefix) => return,
                Ok(_) => {}
                Err(e) => panic!("the member never printed {prefix:?}: {e}"),
            }
        }
    }

    fn signal(&self, signal: &str) {
        let status =
            Command::new("kill").args([signal, &self.child.id().to_string()]).status().unwrap();
        assert!(status.success(), "kill {signal}");
    }
}

impl Drop for MemberProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A member process is SIGKILLed mid-transaction: the transaction holding order 0
/// has produced its invoices and waits for a topic that does not exist yet (order 0
/// also writes to it). Transactions of batches before it may have committed. A new
/// process of the same `transactional.id` takes over once the topic is there. A
/// `read_committed` reader never sees the stalled transaction's invoice and, in the
/// end, sees each invoice once; the killed transaction's records are in the log,
/// aborted.
#[test]
fn a_member_killed_mid_transaction_leaves_nothing_of_it_visible() {
    let Some(broker) = Broker::start_with(&[("auto.create.topics.enable", "false")]) else {
        return;
    };
    let unique = 2_000;
    let stalled = 0;
    let topics = block_on(async {
        let topics = Topics::create(&broker).await;
        publish(&broker, &topics.input, orders(unique)).await;
        topics
    });
    let group = format!("invoicing-{}", topics.input);
    let victim = MemberProcess::start(
        &broker.address,
        &group,
        &topics,
        "invoicing-1",
        Some(("EOS_STALL", stalled)),
    );
    victim.wait_for("started");
    // The stalled transaction's invoices show to a reader of uncommitted records.
    let produced = read_until(&broker.address, &topics.output, "read_uncommitted", |records| {
        records.iter().any(|r| r.0 == stalled)
    });
    assert!(
        produced.iter().any(|r| r.0 == stalled),
        "the member never produced order {stalled}'s invoice into its transaction"
    );
    victim.signal("-KILL");
    drop(victim);
    let committed = read(&broker.address, &topics.output, "read_committed", 0);
    assert!(
        !committed.iter().any(|r| r.0 == stalled),
        "the stalled transaction's invoice was committed before the kill"
    );
    block_on(broker.create_topics(&[(&format!("{}.missing", topics.output), 1)]));
    // The next process of the same transactional id fences the dead one's
    // transaction and aborts it at once.
    let heir = MemberProcess::start(&broker.address, &group, &topics, "invoicing-1", None);
    heir.wait_for("started");
    assert_exactly_once(&broker.address, &group, &topics, unique);
    // What the killed transaction produced is in the log, aborted: a reader of
    // uncommitted records sees order 0's invoice twice.
    let all = read_until(&broker.address, &topics.output, "read_uncommitted", |records| {
        records.iter().filter(|r| r.0 == stalled).count() >= 2
    });
    let copies = all.iter().filter(|r| r.0 == stalled).count();
    assert_eq!(copies, 2, "order {stalled}'s invoice: the aborted copy and the committed one");
}

/// A zombie: a member process stopped (SIGSTOP) while its handler holds an order
/// mid-transaction, past its session timeout, so the group gives its partitions to
/// another member, which handles them; then resumed (SIGCONT). The zombie's commit
/// is refused (its generation is gone) and its transaction aborted: each invoice is
/// seen once.
#[test]
fn a_zombie_cannot_commit_what_another_member_took_over() {
    let Some(broker) = Broker::start() else { return };
    let unique = 1_000;
    let topics = block_on(async {
        let topics = Topics::create(&broker).await;
        publish(&broker, &topics.input, orders(unique)).await;
        topics
    });
    let group = format!("invoicing-{}", topics.input);
    let zombie = MemberProcess::start(
        &broker.address,
        &group,
        &topics,
        "invoicing-z",
        Some(("EOS_HOLD", 300)),
    );
    zombie.wait_for("holding 300");
    zombie.signal("-STOP");
    let other = MemberProcess::start(&broker.address, &group, &topics, "invoicing-o", None);
    other.wait_for("started");
    // Past the zombie's session timeout (6 s): the group moved on without it.
    std::thread::sleep(Duration::from_secs(10));
    zombie.signal("-CONT");
    assert_exactly_once(&broker.address, &group, &topics, unique);
    drop(other);
    drop(zombie);
}

/// `run` dropped mid-batch (a timeout around it) while a handler holds an order, with
/// other orders of the batch already produced into the open transaction; then `run`
/// again on the same consumer. The next `run` aborts the left transaction and reads
/// the batch again from the committed offsets: each invoice once, every input
/// committed.
#[test]
fn a_run_dropped_mid_batch_and_run_again_produces_each_output_once() {
    let Some(broker) = Broker::start() else { return };
    let unique = 600;
    block_on(async {
        let topics = Topics::create(&broker).await;
        publish(&broker, &topics.input, orders(unique)).await;
        let group = format!("invoicing-{}", topics.input);
        let consumer = ExactlyOnceConsumer::new(
            member(&broker.address, &group, &topics.input),
            &transactional_producer(&broker.address, "invoicing-again"),
            topics.dead.clone(),
        )
        .unwrap()
        .retry_delay(Duration::from_millis(100))
        .max_batch(50);
        let (store, seen) = (redis_store().await, Seen::default());
        let first =
            consumer.run(|msg| invoice(msg, &store, &seen, &topics.output, Some(150), None));
        let dropped = tokio::time::timeout(Duration::from_secs(4), first).await;
        assert!(dropped.is_err(), "the first run ended by itself: {dropped:?}");
        let again = consumer.run(|msg| invoice(msg, &store, &seen, &topics.output, None, None));
        let address = broker.address.clone();
        let check = tokio::task::spawn_blocking({
            let (group, topics) = (group.clone(), topics.clone());
            move || assert_exactly_once(&address, &group, &topics, unique)
        });
        tokio::select! {
            ran = again => panic!("run ended: {ran:?}"),
            checked = check => checked.unwrap(),
        }
    });
}

/// The handlers' calls so far.
fn calls(seen: &Seen) -> u32 {
    seen.starts.lock().unwrap().values().sum()
}

/// `run` dropped while it gathers a batch (inside a long commit interval), after
/// earlier batches committed; then `run` again on the same consumer. The records the
/// dropped gathering had taken are read again: each invoice once.
#[test]
fn a_run_dropped_while_gathering_loses_nothing() {
    let Some(broker) = Broker::start() else { return };
    block_on(async {
        let topics = Topics::create(&broker).await;
        let group = format!("invoicing-{}", topics.input);
        let consumer = ExactlyOnceConsumer::new(
            member(&broker.address, &group, &topics.input),
            &transactional_producer(&broker.address, &format!("gathering-{}", topics.input)),
            topics.dead.clone(),
        )
        .unwrap()
        .commit_interval(Duration::from_secs(3))
        .max_batch(10_000);
        let (store, seen) = (redis_store().await, Seen::default());
        publish(&broker, &topics.input, 0..100).await;
        let dropped = async {
            while calls(&seen) < 100 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            // The batch of the first 100 commits; the next 100 arrive and are being
            // gathered when `run` is dropped, 1.5 s into its 3 s interval.
            tokio::time::sleep(Duration::from_secs(2)).await;
            publish(&broker, &topics.input, 100..200).await;
            tokio::time::sleep(Duration::from_millis(1_500)).await;
        };
        tokio::select! {
            ran = consumer.run(|msg| invoice(msg, &store, &seen, &topics.output, None, None)) => {
                panic!("run ended: {ran:?}")
            }
            () = dropped => {}
        }
        publish(&broker, &topics.input, 200..300).await;
        let check = tokio::task::spawn_blocking({
            let (address, group, topics) = (broker.address.clone(), group.clone(), topics.clone());
            move || assert_exactly_once(&address, &group, &topics, 300)
        });
        tokio::select! {
            ran = consumer.run(|msg| invoice(msg, &store, &seen, &topics.output, None, None)) => {
                panic!("run ended: {ran:?}")
            }
            checked = check => checked.unwrap(),
        }
    });
}

/// Small batches, and a handler that panics once on every tenth order, so that the
/// panic often comes a few milliseconds after the previous batch's commit; `run` is
/// started again after each panic, as a supervisor would. Nothing of a panicking
/// batch is produced (no transaction begins), and each invoice appears once.
#[test]
fn panics_between_commits_lose_nothing_and_double_nothing() {
    let Some(broker) = Broker::start() else { return };
    let unique = 200;
    block_on(async {
        let topics = Topics::create(&broker).await;
        let group = format!("invoicing-{}", topics.input);
        publish(&broker, &topics.input, 0..unique).await;
        let consumer = Arc::new(
            ExactlyOnceConsumer::new(
                member(&broker.address, &group, &topics.input),
                &transactional_producer(&broker.address, &format!("panics-{}", topics.input)),
                topics.dead.clone(),
            )
            .unwrap()
            .max_batch(5),
        );
        let (store, seen) = (redis_store().await, Arc::new(Seen::default()));
        let panicked: Arc<Mutex<HashSet<u64>>> = Arc::default();
        let check = tokio::task::spawn_blocking({
            let (address, group, topics) = (broker.address.clone(), group.clone(), topics.clone());
            move || assert_exactly_once(&address, &group, &topics, unique)
        });
        let supervise = async {
            let mut panics = 0;
            loop {
                let (consumer, store, seen) = (consumer.clone(), store.clone(), seen.clone());
                let (output, panicked) = (topics.output.clone(), panicked.clone());
                let run = tokio::spawn(async move {
                    consumer
                        .run(|msg| {
                            let (store, seen) = (store.clone(), seen.clone());
                            let (output, panicked) = (output.clone(), panicked.clone());
                            async move {
                                let id = order_id(&msg.payload);
                                if id % 10 == 3 && panicked.lock().unwrap().insert(id) {
                                    panic!("a planted panic at order {id}");
                                }
                                invoice(msg, &store, &seen, &output, None, None).await
                            }
                        })
                        .await
                });
                match run.await {
                    Err(joined) if joined.is_panic() => panics += 1,
                    ended => panic!("run ended after {panics} panics: {ended:?}"),
                }
            }
        };
        tokio::select! {
            checked = check => checked.unwrap(),
            () = supervise => {}
        }
        assert_eq!(panicked.lock().unwrap().len(), 20, "every planted panic happened");
    });
}

/// Another producer takes the consumer's `transactional.id` mid-stream (initializing
/// its transactions fences the consumer's producer: a fatal error). The consumer makes
/// its producer anew, reads the batch again, and goes on: each invoice once.
#[test]
fn a_producer_fenced_by_another_with_its_id_is_made_anew() {
    let Some(broker) = Broker::start() else { return };
    let unique = 400;
    block_on(async {
        let topics = Topics::create(&broker).await;
        let group = format!("invoicing-{}", topics.input);
        publish(&broker, &topics.input, 0..unique).await;
        let id = format!("fenced-{}", topics.input);
        let consumer = ExactlyOnceConsumer::new(
            member(&broker.address, &group, &topics.input),
            &transactional_producer(&broker.address, &id),
            topics.dead.clone(),
        )
        .unwrap()
        .max_batch(10);
        let (store, seen) = (redis_store().await, Seen::default());
        let intrude = async {
            while calls(&seen) < 100 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let intruder: FutureProducer =
                transactional_producer(&broker.address, &id).create().unwrap();
            tokio::task::spawn_blocking(move || {
                use rdkafka::producer::Producer;
                intruder.init_transactions(Duration::from_secs(30)).unwrap();
            })
            .await
            .unwrap();
            let (address, group, topics) = (broker.address.clone(), group.clone(), topics.clone());
            tokio::task::spawn_blocking(move || {
                assert_exactly_once(&address, &group, &topics, unique)
            })
            .await
            .unwrap();
        };
        tokio::select! {
            ran = consumer.run(|msg| invoice(msg, &store, &seen, &topics.output, None, None)) => {
                panic!("run ended: {ran:?}")
            }
            () = intrude => {}
        }
    });
}
