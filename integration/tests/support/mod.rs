//! Real Redis servers for the tests: the machine's shared one, and private
//! `redis-server` processes (standalone or a 3-master Cluster) that a test can kill
//! and restart. Private servers listen on free loopback ports, keep their files in a
//! fresh temporary directory and are killed when dropped.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idempotent::RedisStore;

mod fault_proxy;
#[allow(unused_imports)] // Used by the tests that fault the network, not by every test.
pub use fault_proxy::FaultProxy;

/// The machine's Redis (`REDIS_URL`, default `redis://127.0.0.1:6379`). `None`, with a
/// printed reason, when it is unreachable outside CI; under `CI` a missing server
/// fails the test.
pub async fn shared_store() -> Option<RedisStore> {
    let url = redis_url();
    match RedisStore::connect(url.as_str()).await {
        Ok(store) => Some(store),
        Err(e) => {
            assert!(std::env::var_os("CI").is_none(), "CI needs Redis at {url}: {e}");
            eprintln!("skipped: no Redis at {url} ({e}); set REDIS_URL or start redis-server");
            None
        }
    }
}

/// The machine's Redis: `REDIS_URL`, default `redis://127.0.0.1:6379`.
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// Whether `redis-server` can be run; outside CI a missing binary skips the test.
pub fn have_redis_server() -> bool {
    let ok =
        Command::new("redis-server").arg("--version").output().is_ok_and(|o| o.status.success());
    if !ok {
        assert!(std::env::var_os("CI").is_none(), "CI needs the redis-server binary");
        eprintln!("skipped: redis-server is not installed");
    }
    ok
}

/// A `redis-server` process of this test's own.
pub struct RedisServer {
    pub port: u16,
    dir: PathBuf,
    args: Vec<String>,
    child: Option<Child>,
}

impl RedisServer {
    /// Starts a server that keeps nothing on disk.
    pub fn start() -> RedisServer {
        RedisServer::start_with(&["--save", "", "--appendonly", "no"])
    }

    /// Starts a server that writes every command to its append-only file before
    /// answering, so a killed and restarted server still has its records.
    pub fn start_persistent() -> RedisServer {
        RedisServer::start_with(&["--save", "", "--appendonly", "yes", "--appendfsync", "always"])
    }

    /// Starts a server with `extra` arguments (and no `--save` or `--appendonly` of
    /// its own: pass them).
    pub fn start_with(extra: &[&str]) -> RedisServer {
        let port = free_port();
        let dir = temp_dir(&format!("redis-{port}"));
        let mut args: Vec<String> =
            ["--port", &port.to_string(), "--bind", "127.0.0.1", "--dir", dir.to_str().unwrap()]
                .iter()
                .map(|s| s.to_string())
                .collect();
        args.extend(["--logfile".to_owned(), dir.join("server.log").display().to_string()]);
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut server = RedisServer { port, dir, args, child: None };
        server.restart();
        server
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The server's log file, in its directory.
    pub fn log(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    /// Kills the server at once (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends `signal` (`-STOP`, `-CONT`, ...) to the server's process.
    pub fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("the server runs").id().to_string();
        let status = Command::new("kill").args([signal, &pid]).status().expect("kill runs");
        assert!(status.success(), "kill {signal} {pid}");
    }

    /// Starts the server again on the same port and directory.
    pub fn restart(&mut self) {
        self.restart_with(&[]);
    }

    /// Starts the server again as a replica of `master`, as a supervisor that asks the
    /// Sentinels for the master before starting a node does.
    pub fn restart_replica_of(&mut self, master: u16) {
        self.restart_with(&["--replicaof", "127.0.0.1", &master.to_string()]);
    }

    fn restart_with(&mut self, extra: &[&str]) {
        assert!(self.child.is_none(), "kill the server before restarting it");
        // Another test's server given this port while it was down would answer for it.
        assert!(
            std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err(),
            "port {} was taken while its server was down",
            self.port
        );
        let child = Command::new("redis-server")
            .args(&self.args)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server starts");
        self.child = Some(child);
        self.wait_for_ping();
    }

    /// Waits until the server answers, failing at once if its process exited (a port
    /// taken, a bad argument) rather than taking another process's answer for it.
    fn wait_for_ping(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        // A server that asks for a password answers NOAUTH: it is up too.
        while !["PONG", "NOAUTH"].iter().any(|up| cli(self.port, &["ping"]).contains(up)) {
            let child = self.child.as_mut().expect("the server was started");
            if let Ok(Some(status)) = child.try_wait() {
                let log = std::fs::read_to_string(self.log()).unwrap_or_default();
                panic!("redis-server on {} exited ({status}); its log:\n{log}", self.port);
            }
            assert!(Instant::now() < deadline, "redis-server on {} did not start", self.port);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Runs `redis-cli` against this server and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        cli(self.port, args)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Three Redis Sentinels of the test's own on loopback, monitoring a master as
/// [`SENTINEL_SERVICE`] with quorum 2, declaring it down after 1 s of silence.
pub struct RedisSentinels {
    pub nodes: Vec<RedisServer>,
}

/// The name the Sentinels monitor the master under.
pub const SENTINEL_SERVICE: &str = "orders";

impl RedisSentinels {
    /// Starts them on `master_port`; `password` is the master's and its replicas'
    /// `requirepass`, if any.
    pub fn start(master_port: u16, password: Option<&str>) -> RedisSentinels {
        let nodes = (0..3)
            .map(|_| {
                let port = free_port();
                let dir = temp_dir(&format!("sentinel-{port}"));
                let mut conf = format!(
                    "port {port}\nbind 127.0.0.1\ndir {dir}\n\
                     sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {master_port} 2\n\
                     sentinel down-after-milliseconds {SENTINEL_SERVICE} 1000\n\
                     sentinel failover-timeout {SENTINEL_SERVICE} 10000\n\
                     logfile {dir}/server.log\n",
                    dir = dir.display()
                );
                if let Some(password) = password {
                    conf += &format!("sentinel auth-pass {SENTINEL_SERVICE} {password}\n");
                }
                let file = dir.join("sentinel.conf");
                std::fs::write(&file, conf).expect("write sentinel.conf");
                let args = vec![file.display().to_string(), "--sentinel".to_owned()];
                let mut sentinel = RedisServer { port, dir, args, child: None };
                sentinel.restart();
                sentinel
            })
            .collect();
        let sentinels = RedisSentinels { nodes };
        // Each has found the others and the replicas before the test goes on.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ready = sentinels.nodes.iter().all(|node| {
                let info = node.cli(&["SENTINEL", "MASTER", SENTINEL_SERVICE]);
                let field = |name: &str| {
                    let mut lines = info.lines();
                    lines.find(|line| *line == name).and(lines.next()).map(str::to_owned)
                };
                field("num-other-sentinels").as_deref() == Some("2")
                    && field("num-slaves").is_some_and(|n| n != "0")
            });
            if ready {
                return sentinels;
            }
            assert!(Instant::now() < deadline, "the Sentinels never found each other");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The port of the master the first Sentinel names now.
    pub fn master_port(&self) -> u16 {
        let reply = self.nodes[0].cli(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", SENTINEL_SERVICE]);
        reply.lines().nth(1).and_then(|port| port.trim().parse().ok()).expect("a master")
    }
}

/// A 3-master Redis Cluster of this test's own.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start() -> RedisCluster {
        RedisCluster::start_nodes(3, 0, "5000")
    }

    /// Three masters with a replica each; a master silent for 2 s is failed over.
    pub fn with_replicas() -> RedisCluster {
        let cluster = RedisCluster::start_nodes(6, 1, "2000");
        let deadline = Instant::now() + Duration::from_secs(20);
        for node in &cluster.nodes {
            while node.cli(&["ROLE"]).starts_with("slave")
                && !node.cli(&["INFO", "replication"]).contains("master_link_status:up")
            {
                assert!(Instant::now() < deadline, "a replica never synced");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        cluster
    }

    fn start_nodes(nodes: usize, replicas: usize, node_timeout: &str) -> RedisCluster {
        let nodes: Vec<RedisServer> = (0..nodes)
            .map(|_| {
                RedisServer::start_with(&[
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    node_timeout,
                ])
            })
            .collect();
        let addresses: Vec<String> =
            nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        let mut create = vec!["--cluster", "create"];
        create.extend(addresses.iter().map(String::as_str));
        let replicas = replicas.to_string();
        create.extend(["--cluster-replicas", &replicas, "--cluster-yes"]);
        let out = cli(nodes[0].port, &create);
        assert!(out.contains("[OK] All 16384 slots covered"), "cluster create failed: {out}");
        let deadline = Instant::now() + Duration::from_secs(20);
        for node in &nodes {
            while !node.cli(&["cluster", "info"]).contains("cluster_state:ok") {
                assert!(Instant::now() < deadline, "cluster never became ready");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        RedisCluster { nodes }
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }
}

pub fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli runs");
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

/// A loopback port that is free, and whose Cluster bus port (+10000) is free too.
fn free_port() -> u16 {
    loop {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
        let port = listener.local_addr().expect("local address").port();
        if port < 55_000 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("idempotent-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create a temporary directory");
    dir
}
