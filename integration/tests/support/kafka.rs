//! A Kafka-protocol broker of the test's own: `tansu`, on a free loopback port,
//! keeping everything in memory. Outside CI a machine without `tansu` skips the test
//! with a message; under `CI` it fails.
#![allow(dead_code)]

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idempotent::consume::kafka::KafkaContext;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};

pub struct Broker {
    child: Child,
    pub address: String,
}

impl Broker {
    pub fn start() -> Option<Broker> {
        if Command::new("tansu").arg("--help").output().is_err() {
            assert!(std::env::var_os("CI").is_none(), "CI needs the tansu broker");
            eprintln!(
                "skipped: tansu is not installed (cargo install tansu --locked --features dynostore)"
            );
            return None;
        }
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let url = format!("tcp://127.0.0.1:{port}");
        let child = Command::new("tansu")
            .args(["broker", "--listener-url", &url, "--advertised-listener-url", &url])
            .args(["--storage-engine", "memory://tansu/"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let address = format!("127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(&address).is_err() {
            assert!(Instant::now() < deadline, "tansu did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(Broker { child, address })
    }

    pub fn config(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", &self.address);
        config
    }

    /// Creates each `(topic, partitions)`.
    pub async fn create_topics(&self, topics: &[(&str, i32)]) {
        let admin: AdminClient<DefaultClientContext> = self.config().create().unwrap();
        let topics: Vec<NewTopic<'_>> = topics
            .iter()
            .map(|(name, partitions)| NewTopic::new(name, *partitions, TopicReplication::Fixed(1)))
            .collect();
        for created in admin.create_topics(&topics, &AdminOptions::new()).await.unwrap() {
            created.unwrap();
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
            .set("auto.offset.reset", "earliest")
            .set("session.timeout.ms", "6000")
            .set("heartbeat.interval.ms", "500");
        for (key, value) in settings {
            config.set(*key, *value);
        }
        let consumer: StreamConsumer<KafkaContext> =
            config.create_with_context(KafkaContext::default()).unwrap();
        consumer.subscribe(&[topic]).unwrap();
        consumer
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
