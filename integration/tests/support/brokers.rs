//! Apache Kafka and Apache RocketMQ servers of a test's own, run from the jars that
//! `.ci/services` caches (the scripts in `.ci/brokers/` fetch them from Maven Central
//! if they are missing), each in a fresh directory under `/dev/shm`, on free loopback
//! ports. A server can be killed (SIGKILL, as a crash) and restarted on its data.
//! Outside CI a machine without Java skips the test with a message; under `CI` it
//! fails.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Whether the broker scripts can run here: Java is installed.
pub fn have_java() -> bool {
    let ok = Command::new("java").arg("-version").output().is_ok_and(|o| o.status.success());
    if !ok {
        assert!(std::env::var_os("CI").is_none(), "CI needs Java to run the brokers");
        eprintln!("skipped: no Java to run the brokers; run `bash .ci/services`");
    }
    ok
}

/// A fresh directory for a server's data and logs, in memory where possible.
pub fn fresh_dir(name: &str) -> PathBuf {
    let base = if Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let dir = base.join(format!("idempotent-{name}-{}", idempotent::publish::message_id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A loopback port nothing listens on now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `count` free ports in a row (`p`, `p + 1`, ...), for a server that takes its
/// neighbours too.
pub fn free_ports(count: u16) -> u16 {
    loop {
        let first = free_port();
        if first < 60_000 && (1..count).all(|i| TcpListener::bind(("127.0.0.1", first + i)).is_ok())
        {
            return first;
        }
    }
}

/// One server process run by a script of `.ci/brokers/`, its output in `log`.
pub struct Server {
    script: &'static str,
    args: Vec<String>,
    log: PathBuf,
    /// The line its log shows once it serves.
    ready: &'static str,
    child: Option<Child>,
    starts: u32,
}

impl Server {
    /// Runs `.ci/brokers/{script} args…` and waits until its log shows `ready`.
    pub fn start(
        script: &'static str,
        args: Vec<String>,
        log: PathBuf,
        ready: &'static str,
    ) -> Server {
        let mut server = Server { script, args, log, ready, child: None, starts: 0 };
        server.restart();
        server
    }

    /// Kills the server at once (SIGKILL): no shutdown, no flush, as a crash.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on its directory and ports, and waits until it serves.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "kill the server before restarting it");
        self.starts += 1;
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.ci/brokers").join(self.script);
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).unwrap();
        let child = Command::new(&script)
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap_or_else(|e| panic!("{} does not run: {e}", script.display()));
        self.child = Some(child);
        // A cold machine fetches the jars first.
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            if text.matches(self.ready).count() >= self.starts as usize {
                return;
            }
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                panic!("{} exited ({status}):\n{}", self.script, tail(&text));
            }
            assert!(Instant::now() < deadline, "{} did not start:\n{}", self.script, tail(&text));
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }
}

fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}
