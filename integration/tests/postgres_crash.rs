//! `PostgresStore` across a server crash, on a PostgreSQL of the test's own (initdb
//! and pg_ctl from the machine's PostgreSQL: `pg_config --bindir`, or Debian's
//! `/usr/lib/postgresql/<version>/bin`; run as the `postgres` user when the test runs
//! as root). Outside CI a machine without them
//! skips the test with a message; under `CI` it fails.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use idempotent::{Claim, Key, PostgresStore, Store, Transition};

/// A private PostgreSQL cluster: started with a WAL writer that waits 10 s between
/// flushes, so anything committed without waiting for its flush is still only in
/// memory when the test crashes the server.
struct Server {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    as_postgres: bool,
}

impl Server {
    fn start() -> Option<Server> {
        let Some(bin) = server_binaries() else {
            assert!(std::env::var_os("CI").is_none(), "CI needs PostgreSQL's initdb and pg_ctl");
            eprintln!("skipped: PostgreSQL's server binaries (initdb, pg_ctl) are not installed");
            return None;
        };
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let dir = std::env::temp_dir().join(format!("idempotent-pg-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        // PostgreSQL refuses to run as root.
        let as_postgres = Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout == b"0\n");
        if as_postgres {
            let chown = Command::new("chown").args(["postgres:postgres"]).arg(&dir).status();
            assert!(chown.is_ok_and(|s| s.success()), "chown the data directory to postgres");
        }
        let server = Server { bin, dir, port, as_postgres };
        let data = server.dir.join("data");
        server.run("initdb", &["-D", path(&data), "-A", "trust", "-U", "postgres", "--no-sync"]);
        server.pg_ctl_start();
        Some(server)
    }

    fn run(&self, tool: &str, args: &[&str]) {
        let tool = self.bin.join(tool);
        let mut command = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&tool);
            c
        } else {
            Command::new(&tool)
        };
        let out = command.args(args).output().expect("PostgreSQL's tools run");
        assert!(
            out.status.success(),
            "{} {args:?}: {}{}",
            tool.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn pg_ctl_start(&self) {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c wal_writer_delay=10s",
            self.port,
            path(&self.dir)
        );
        let (data, log) = (self.dir.join("data"), self.dir.join("log"));
        self.run("pg_ctl", &["-D", path(&data), "-l", path(&log), "-o", &options, "-w", "start"]);
    }

    /// Stops the server without a checkpoint or a WAL flush, as a crash would.
    fn crash_and_restart(&self) {
        let data = self.dir.join("data");
        self.run("pg_ctl", &["-D", path(&data), "-m", "immediate", "-w", "stop"]);
        self.pg_ctl_start();
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let data = self.dir.join("data");
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.run("pg_ctl", &["-D", path(&data), "-m", "immediate", "stop"])
        }));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Where `initdb` and `pg_ctl` are: `pg_config --bindir`, else Debian's
/// `/usr/lib/postgresql/<version>/bin`.
fn server_binaries() -> Option<PathBuf> {
    let from_pg_config = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|out| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
    let debian = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|version| version.path().join("bin"));
    from_pg_config.into_iter().chain(debian).find(|bin| bin.join("initdb").exists())
}

fn path(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 temporary path")
}

/// A plain handler's claim survives a server crash: its handler may already have had
/// effects elsewhere, and a lost claim would make `complete` answer LeaseLost and the
/// redelivery run the handler again.
#[tokio::test]
async fn a_claim_survives_a_server_crash() {
    let Some(server) = Server::start() else { return };
    let store = PostgresStore::connect(&server.url()).await.unwrap();
    store.migrate().await.unwrap();
    let key = Key::new("crash", "order:1").unwrap();
    let (lease, ttl) = (Duration::from_secs(60), Duration::from_secs(120));
    let Claim::Won { token, attempt: 1, .. } = store.claim(&key, lease, ttl, None).await.unwrap()
    else {
        panic!("a fresh key is won")
    };
    server.crash_and_restart();
    // The pool's connections died with the server; it opens new ones.
    let mut done = store.complete(&key, token, ttl, None).await;
    for _ in 0..20 {
        if done.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        done = store.complete(&key, token, ttl, None).await;
    }
    assert_eq!(done.unwrap(), Transition::Applied, "the claim was lost in the crash");
}
