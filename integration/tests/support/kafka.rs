//! An Apache Kafka broker of the test's own (KRaft, one node, from the jars
//! `.ci/services` caches), on free loopback ports, its data in a fresh directory. It
//! can be killed (SIGKILL) and restarted on its data. Outside CI a machine without Java
//! skips the test with a message; under `CI` it fails.
#![allow(dead_code)]

use std::path::PathBuf;

use idempotent::consume::kafka::KafkaContext;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};

#[path = "brokers.rs"]
mod brokers;

pub struct Broker {
    server: brokers::Server,
    dir: PathBuf,
    pub address: String,
}

impl Broker {
    pub fn start() -> Option<Broker> {
        Broker::start_with(&[])
    }

    /// A broker with more `server.properties` lines.
    pub fn start_with(settings: &[(&str, &str)]) -> Option<Broker> {
        if !brokers::have_java() {
            return None;
        }
        let dir = brokers::fresh_dir("kafka");
        let port = brokers::free_ports(2);
        let mut args = vec![dir.display().to_string(), port.to_string(), (port + 1).to_string()];
        let extra: String = settings.iter().map(|(k, v)| format!("{k}={v}\n")).collect();
        std::fs::write(dir.join("extra.properties"), &extra).unwrap();
        args.push(dir.join("extra.properties").display().to_string());
        let server =
            brokers::Server::start("kafka", args, dir.join("server.log"), "Kafka Server started");
        Some(Broker { server, dir, address: format!("127.0.0.1:{port}") })
    }

    /// Kills the broker at once (SIGKILL), as a crash.
    pub fn kill(&mut self) {
        self.server.kill();
    }

    /// Starts the killed broker again on its data and port.
    pub fn restart(&mut self) {
        self.server.restart();
    }

    pub fn config(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", &self.address);
        config
    }

    /// Creates each `(topic, partitions)`. A broker just started on a busy machine may
    /// answer slowly: a request that times out is made again (a topic it did create
    /// meanwhile counts as created).
    pub async fn create_topics(&self, topics: &[(&str, i32)]) {
        use rdkafka::types::RDKafkaErrorCode;
        let admin: AdminClient<DefaultClientContext> = self.config().create().unwrap();
        let topics: Vec<NewTopic<'_>> = topics
            .iter()
            .map(|(name, partitions)| NewTopic::new(name, *partitions, TopicReplication::Fixed(1)))
            .collect();
        let wait = Some(std::time::Duration::from_secs(60));
        let options = AdminOptions::new().request_timeout(wait).operation_timeout(wait);
        for attempt in 1.. {
            match admin.create_topics(&topics, &options).await {
                Ok(created) => {
                    for result in created {
                        match result {
                            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) if attempt > 1 => {}
                            other => {
                                other.unwrap();
                            }
                        }
                    }
                    return;
                }
                Err(error) if attempt < 3 => eprintln!("creating topics: {error}; again"),
                Err(error) => panic!("creating topics: {error}"),
            }
        }
    }

    /// A member of `group` subscribed to `topic`, as `KafkaConsumer` needs it.
    pub fn member(&self, group: &str, topic: &str) -> StreamConsumer<KafkaContext> {
        self.member_with(group, topic, &[])
    }

    /// [`member`](Broker::member), with more client `settings`.
    pub fn member_with(
        &self,
        group: &str,
        topic: &str,
        settings: &[(&str, &str)],
    ) -> StreamConsumer<KafkaContext> {
        let mut config = self.config();
        config
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest");
        // Under the consumer group protocol (KIP-848) the broker sets these (6 s and
        // 1 s, in `.ci/brokers/kafka`), and the client refuses them.
        if !settings.contains(&("group.protocol", "consumer")) {
            config.set("session.timeout.ms", "6000").set("heartbeat.interval.ms", "500");
        }
        for (key, value) in settings {
            config.set(*key, *value);
        }
        let consumer: StreamConsumer<KafkaContext> =
            config.create_with_context(KafkaContext::default()).unwrap();
        consumer.subscribe(&[topic]).unwrap();
        consumer
    }
}

/// The committed offset of `group` on each of `topic`'s first `partitions` (0 where
/// none), and the end of each.
pub fn committed_and_end(
    address: &str,
    group: &str,
    topic: &str,
    partitions: i32,
) -> (Vec<i64>, Vec<i64>) {
    use rdkafka::consumer::BaseConsumer;
    use rdkafka::{Offset, TopicPartitionList};
    let timeout = std::time::Duration::from_secs(10);
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", address).set("group.id", group);
    let probe: BaseConsumer = config.create().unwrap();
    let mut list = TopicPartitionList::new();
    for p in 0..partitions {
        list.add_partition(topic, p);
    }
    let committed = probe.committed_offsets(list, timeout).unwrap();
    let committed = (0..partitions)
        .map(|p| match committed.find_partition(topic, p).map(|e| e.offset()) {
            Some(Offset::Offset(o)) => o,
            _ => 0,
        })
        .collect();
    let ends =
        (0..partitions).map(|p| probe.fetch_watermarks(topic, p, timeout).unwrap().1).collect();
    (committed, ends)
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.server.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
