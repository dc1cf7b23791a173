//! A ZooKeeper server of the test's own (Debian's package, run with `java` directly
//! so that killing it kills the server), on a free loopback port, with TTL nodes on,
//! its files in a fresh directory; killed when dropped.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const JAR: &str = "/usr/share/java/zookeeper.jar";

pub struct ZooKeeperServer {
    child: Option<Child>,
    dir: PathBuf,
    /// JVM system properties the server runs with (`-Dname=value`), besides TTL nodes.
    properties: Vec<String>,
    pub port: u16,
}

impl ZooKeeperServer {
    /// Starts a server with a 200 ms tick (sessions of 0.4 to 4 s); `None` outside CI
    /// when ZooKeeper is not installed.
    pub fn start() -> Option<ZooKeeperServer> {
        ZooKeeperServer::start_with(&["-Dznode.container.checkIntervalMs=500"])
    }

    /// Starts a server as [`start`](ZooKeeperServer::start) does, with these JVM system
    /// properties (`-Dname=value`) instead of its reaper settings.
    pub fn start_with(properties: &[&str]) -> Option<ZooKeeperServer> {
        if !std::path::Path::new(JAR).exists() {
            assert!(std::env::var_os("CI").is_none(), "CI needs ZooKeeper ({JAR})");
            eprintln!("skipped: ZooKeeper is not installed (apt-get install zookeeper)");
            return None;
        }
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let dir = std::env::temp_dir().join(format!("idempotent-zk-{port}-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("data")).unwrap();
        let config = format!(
            "tickTime=200\ndataDir={}\nclientPort={port}\nclientPortAddress=127.0.0.1\n\
             admin.enableServer=false\nmaxClientCnxns=0\n4lw.commands.whitelist=ruok,mntr\nforceSync=no\n",
            dir.join("data").display()
        );
        std::fs::write(dir.join("zoo.cfg"), config).unwrap();
        let properties = properties.iter().map(|p| p.to_string()).collect();
        let mut server = ZooKeeperServer { child: None, dir, properties, port };
        server.restart();
        Some(server)
    }

    pub fn hosts(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Kills the server at once (`SIGKILL`), as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server (again, on the same port and files) and waits for it.
    pub fn restart(&mut self) {
        self.kill();
        let child = Command::new("java")
            .arg("-Dzookeeper.extendedTypesEnabled=true")
            .args(&self.properties)
            .args(["-cp", &format!("/etc/zookeeper/conf:{JAR}")])
            .arg("org.apache.zookeeper.server.ZooKeeperServerMain")
            .arg(self.dir.join("zoo.cfg"))
            .current_dir(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            assert!(Instant::now() < deadline, "ZooKeeper did not start");
            if ruok(self.port) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Connects to a server the test started, trying again for up to 10 s: a JVM that
/// has just answered `ruok` may still take longer than a short session's timeout to
/// open its first sessions on a loaded machine.
pub async fn connect(hosts: &str, root: &str, session: Duration) -> idempotent::ZooKeeperStore {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match idempotent::ZooKeeperStore::connect_with(hosts, root, session).await {
            Ok(store) => return store,
            Err(e) if Instant::now() < deadline => {
                eprintln!("connecting to ZooKeeper at {hosts}: {e}; trying again");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("ZooKeeper at {hosts}: {e}"),
        }
    }
}

/// Whether the server answers `ruok` with `imok`.
fn ruok(port: u16) -> bool {
    four_letter(port, "ruok").is_some_and(|answer| answer == "imok")
}

/// The server's answer to a four-letter command, `None` when it can't be had.
fn four_letter(port: u16, command: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    stream.write_all(command.as_bytes()).ok()?;
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    Some(answer)
}

impl ZooKeeperServer {
    /// The server's `mntr` figures (`zk_znode_count`, `zk_approximate_data_size`…),
    /// read from outside the store, as an operator's monitoring does.
    pub fn mntr(&self) -> std::collections::HashMap<String, String> {
        let answer = four_letter(self.port, "mntr").unwrap_or_default();
        answer
            .lines()
            .filter_map(|line| line.split_once('\t'))
            .map(|(name, value)| (name.to_owned(), value.trim().to_owned()))
            .collect()
    }

    /// The server process's resident memory, in KiB (`VmRSS`), when it runs.
    pub fn resident_kib(&self) -> Option<u64> {
        let pid = self.child.as_ref()?.id();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let line = status.lines().find(|line| line.starts_with("VmRSS:"))?;
        line.split_whitespace().nth(1)?.parse().ok()
    }
}

impl Drop for ZooKeeperServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
