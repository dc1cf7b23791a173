//! A RocketMQ cluster of the test's own: a name server and one broker (the Rust
//! implementation, `rocketmq-namesrv-rust` and `rocketmq-broker-rust`), on free
//! loopback ports, storing in a fresh directory under `/dev/shm` (the broker refuses
//! to start on a disk over 90% full). Outside CI a machine without them skips the
//! test with a message; under `CI` it fails.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Cluster {
    name_server: Child,
    broker: Child,
    dir: PathBuf,
    /// The name server's `host:port`.
    pub name_server_address: String,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A port `p` such that `p` and `p - 2` are free: the broker also listens two below
/// its port.
fn free_broker_port() -> u16 {
    loop {
        let below = free_port();
        let port = below + 2;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

fn wait_for(what: &str, mut ready: impl FnMut() -> bool, log: &std::path::Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ready() {
        let log = std::fs::read_to_string(log).unwrap_or_default();
        assert!(Instant::now() < deadline, "{what} did not start:\n{log}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

impl Cluster {
    pub fn start() -> Option<Cluster> {
        for binary in ["rocketmq-namesrv-rust", "rocketmq-broker-rust"] {
            if which(binary).is_none() {
                assert!(std::env::var_os("CI").is_none(), "CI needs {binary}");
                eprintln!(
                    "skipped: {binary} is not installed \
                     (cargo install --locked rocketmq-namesrv rocketmq-broker)"
                );
                return None;
            }
        }
        let base = if std::path::Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!("idempotent-rocketmq-{}", idempotent::publish::message_id()));
        std::fs::create_dir_all(dir.join("store")).unwrap();

        let ns_port = free_port();
        let name_server_address = format!("127.0.0.1:{ns_port}");
        let ns_log = dir.join("namesrv.log");
        let name_server = Command::new("rocketmq-namesrv-rust")
            .args(["--listenPort", &ns_port.to_string(), "--bindAddress", "127.0.0.1"])
            .arg("--rocketmqHome")
            .arg(&dir)
            .arg("--kvConfigPath")
            .arg(dir.join("kvConfig.json"))
            .env("HOME", &dir)
            .env("ROCKETMQ_HOME", &dir)
            .stdout(Stdio::from(std::fs::File::create(&ns_log).unwrap()))
            .stderr(Stdio::from(std::fs::File::create(dir.join("namesrv.err")).unwrap()))
            .spawn()
            .unwrap();
        wait_for(
            "the name server",
            || std::net::TcpStream::connect(&name_server_address).is_ok(),
            &ns_log,
        );

        let port = free_broker_port();
        let (ha_port, health_port) = (free_port(), free_port());
        let store = dir.join("store");
        let config = format!(
            r#"[broker]
brokerIp1 = "127.0.0.1"
listenPort = {port}
namesrvAddr = "{name_server_address}"
storePathRootDir = "{store}"
authConfigPath = "{auth}"
autoCreateTopicEnable = true

[broker.brokerServerConfig]
bindAddress = "127.0.0.1"

[broker.brokerIdentity]
brokerName = "broker-a"
brokerClusterName = "DefaultCluster"
brokerId = 0

[store]
haListenPort = {ha_port}
storePathRootDir = "{store}"
mappedFileSizeCommitLog = 67108864
"#,
            store = store.display(),
            auth = dir.join("auth").display(),
        );
        let config_path = dir.join("broker.toml");
        std::fs::write(&config_path, config).unwrap();
        let broker_log = dir.join("broker.log");
        let broker = Command::new("rocketmq-broker-rust")
            .arg("-c")
            .arg(&config_path)
            .env("HOME", &dir)
            .env("ROCKETMQ_HOME", &dir)
            .env("ROCKETMQ_HEALTH_BIND_ADDR", format!("127.0.0.1:{health_port}"))
            .stdout(Stdio::from(std::fs::File::create(&broker_log).unwrap()))
            .stderr(Stdio::from(std::fs::File::create(dir.join("broker.err")).unwrap()))
            .spawn()
            .unwrap();
        let cluster = Cluster { name_server, broker, dir, name_server_address };
        wait_for("the broker", || ready(health_port), &broker_log);
        Some(cluster)
    }

    /// The directory holding the servers' logs and store.
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }
}

/// Whether the broker's health endpoint answers `/readyz` with 200.
fn ready(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else { return false };
    let request = "GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer.starts_with("HTTP/1.1 200") || answer.starts_with("HTTP/1.0 200")
}

fn which(binary: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join(binary)).find(|p| p.is_file())
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for child in [&mut self.broker, &mut self.name_server] {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
