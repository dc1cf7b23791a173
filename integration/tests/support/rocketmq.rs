//! An Apache RocketMQ cluster of the test's own: a name server and one broker (the
//! Java servers, from the jars `.ci/services` caches), on free loopback ports, storing
//! in a fresh directory. The broker can be killed (SIGKILL) and restarted on its
//! store. Outside CI a machine without Java skips the test with a message; under `CI`
//! it fails.
#![allow(dead_code)]

use std::path::PathBuf;

#[path = "brokers.rs"]
mod brokers;

pub struct Cluster {
    broker: brokers::Server,
    name_server: brokers::Server,
    dir: PathBuf,
    /// The name server's `host:port`.
    pub name_server_address: String,
}

impl Cluster {
    pub fn start() -> Option<Cluster> {
        if !brokers::have_java() {
            return None;
        }
        let dir = brokers::fresh_dir("rocketmq");
        let ns_port = brokers::free_port();
        let name_server_address = format!("127.0.0.1:{ns_port}");
        let name_server = brokers::Server::start(
            "rocketmq-namesrv",
            vec![dir.join("namesrv").display().to_string(), ns_port.to_string()],
            dir.join("namesrv.log"),
            "boot success",
        );
        // The broker listens on its port, two below it and one above.
        let port = brokers::free_ports(4) + 2;
        let broker = brokers::Server::start(
            "rocketmq-broker",
            vec![
                dir.join("broker").display().to_string(),
                port.to_string(),
                name_server_address.clone(),
            ],
            dir.join("broker.log"),
            "boot success",
        );
        let cluster = Cluster { broker, name_server, dir, name_server_address };
        cluster.wait_registered(1);
        Some(cluster)
    }

    /// Waits until the broker has registered with the name server `starts` times: a
    /// client that asks for a route before that is refused.
    fn wait_registered(&self, starts: usize) {
        let log = self.dir.join("broker/logs/rocketmqlogs/broker.log");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.matches("Registering current broker to name server completed").count() >= starts
            {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the broker never registered: see {}",
                log.display()
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }

    /// Kills the broker at once (SIGKILL), as a crash; the name server stays.
    pub fn kill_broker(&mut self) {
        self.broker.kill();
    }

    /// Starts the killed broker again on its store and ports.
    pub fn restart_broker(&mut self) {
        let registered =
            std::fs::read_to_string(self.dir.join("broker/logs/rocketmqlogs/broker.log"))
                .unwrap_or_default()
                .matches("Registering current broker to name server completed")
                .count();
        self.broker.restart();
        self.wait_registered(registered + 1);
    }

    /// The directory holding the servers' logs and stores.
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.broker.kill();
        self.name_server.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
