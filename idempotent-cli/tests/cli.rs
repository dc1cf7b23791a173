//! The `idempotent` binary against the real stores: records written the way handlers
//! write them, then `list`, `inspect`, `release` (one key, refused, bulk with a dry
//! run and a confirmation), `stats` and `purge`, and a released key processes again.
//! On Redis, PostgreSQL, MariaDB (as `mariadb://`) and ZooKeeper. Bad URLs and
//! unreachable stores give their exit codes, and no password shows.

use std::process::{Command, Output};
use std::time::Duration;

use idempotent_runtime::{
    Claim, Key, MysqlStore, PostgresStore, RedisStore, Store, Token, Transition, ZooKeeperStore,
    zookeeper_store,
};

const LEASE: Duration = Duration::from_secs(60);
const TTL: Duration = Duration::from_secs(600);

/// Runs the binary with `args` after `--store url` (and `--at at`).
fn idempotent(url: &str, at: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idempotent"))
        .args(["--store", url, "--at", at])
        .args(args)
        .env_remove("IDEMPOTENT_STORE")
        .output()
        .expect("the binary runs")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn code(output: &Output) -> i32 {
    output.status.code().expect("an exit code")
}

fn fresh(prefix: &str) -> String {
    use std::hash::{BuildHasher as _, RandomState};
    let n = RandomState::new().hash_one(std::time::SystemTime::now()) as u32;
    format!("{prefix}{n:08x}")
}

async fn won<S: Store>(store: &S, key: &Key) -> Token {
    match store.claim(key, LEASE, TTL, None).await.unwrap() {
        Claim::Won { token, .. } => token,
        other => panic!("{key}: {other:?}"),
    }
}

/// DONE `order:1`, FAILED `order:2`, `order:4` and `order:5`, in progress `order:3`.
async fn write_records<S: Store>(store: &S, namespace: &str) {
    let key = |id: &str| Key::new(namespace, id).unwrap();
    let token = won(store, &key("order:1")).await;
    let done = store.complete(&key("order:1"), token, TTL, Some(b"{\"charged\":500}")).await;
    assert_eq!(done.unwrap(), Transition::Applied);
    for id in ["order:2", "order:4", "order:5"] {
        let token = won(store, &key(id)).await;
        assert_eq!(store.fail(&key(id), token, TTL).await.unwrap(), Transition::Applied);
    }
    won(store, &key("order:3")).await;
}

/// The session every store goes through.
async fn session<S: Store>(store: &S, url: &str, at: &str) {
    let namespace = fresh("cli");
    write_records(store, &namespace).await;
    let ns = namespace.as_str();

    let listed = idempotent(url, at, &["list", "--namespace", ns]);
    assert_eq!(code(&listed), 0, "{listed:?}");
    let table = stdout(&listed);
    assert!(table.starts_with("KEY"), "{table}");
    assert_eq!(table.lines().count(), 6, "a header and five records:\n{table}");
    assert!(table.contains(&format!("{ns}:order:1")) && table.contains("done"), "{table}");
    assert!(table.contains("in_progress"), "{table}");

    let json = idempotent(url, at, &["--json", "list", "--namespace", ns, "--state", "failed"]);
    let lines: Vec<serde_json::Value> =
        stdout(&json).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 3, "{}", stdout(&json));
    assert!(lines.iter().all(|l| l["state"] == "failed" && l["attempts"] == 1), "{lines:?}");

    let limited = idempotent(url, at, &["--json", "list", "--namespace", ns, "--limit", "2"]);
    assert_eq!(stdout(&limited).lines().count(), 2);

    let inspected = idempotent(url, at, &["inspect", ns, "order:1"]);
    assert_eq!(code(&inspected), 0);
    let text = stdout(&inspected);
    assert!(text.contains("state         done"), "{text}");
    assert!(text.contains("cached result 15 bytes"), "{text}");
    let missing = idempotent(url, at, &["inspect", ns, "order:9"]);
    assert_eq!(code(&missing), 1, "no such record: exit 1");

    let refused = idempotent(url, at, &["release", ns, "order:1"]);
    assert_eq!(code(&refused), 4, "a DONE key needs --force: {}", stdout(&refused));
    let held = idempotent(url, at, &["release", ns, "order:3"]);
    assert_eq!(code(&held), 4, "a live claim needs --force: {}", stdout(&held));

    let released = idempotent(url, at, &["release", ns, "order:2"]);
    assert_eq!(code(&released), 0, "{released:?}");
    let key = Key::new(ns, "order:2").unwrap();
    match store.claim(&key, LEASE, TTL, None).await.unwrap() {
        Claim::Won { attempt: 1, token, .. } => {
            assert_eq!(store.complete(&key, token, TTL, None).await.unwrap(), Transition::Applied);
        }
        other => panic!("the released key processes again from attempt 1, not {other:?}"),
    }

    let dry =
        idempotent(url, at, &["release", "--namespace", ns, "--state", "failed", "--dry-run"]);
    assert_eq!(code(&dry), 0);
    assert!(stdout(&dry).contains("2 record(s)"), "{}", stdout(&dry));
    // No terminal to ask on: nothing is released without --yes.
    let unconfirmed = idempotent(url, at, &["release", "--namespace", ns, "--state", "failed"]);
    assert_eq!(code(&unconfirmed), 5);
    let bulk = idempotent(
        url,
        at,
        &["--json", "release", "--namespace", ns, "--state", "failed", "--yes"],
    );
    assert_eq!(code(&bulk), 0, "{bulk:?}");
    let summary: serde_json::Value = serde_json::from_str(stdout(&bulk).trim()).unwrap();
    assert_eq!(summary["released"], 2, "{summary}");

    let stats = idempotent(url, at, &["--json", "stats", "--namespace", ns]);
    let counts: serde_json::Value = serde_json::from_str(stdout(&stats).trim()).unwrap();
    let count = |state: &str| {
        (counts.as_array().unwrap().iter())
            .find(|row| row["state"] == state)
            .map_or(0, |row| row["count"].as_u64().unwrap())
    };
    assert_eq!((count("done"), count("in_progress"), count("failed")), (2, 1, 0), "{counts}");

    // Nothing reads the output any more (`idempotent list | head -0`): a quiet end,
    // not a panic.
    let mut child = Command::new(env!("CARGO_BIN_EXE_idempotent"))
        .args(["--store", url, "--at", at, "--json", "list", "--namespace", ns])
        .env_remove("IDEMPOTENT_STORE")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let closed = child.wait_with_output().unwrap();
    assert_eq!(code(&closed), 0, "{}", String::from_utf8_lossy(&closed.stderr));

    let purged = idempotent(url, at, &["purge"]);
    assert_eq!(code(&purged), 0, "{purged:?}");
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

/// Outside CI a missing server skips the test; under CI it fails it.
fn unreachable(what: &str, error: impl std::fmt::Display) {
    assert!(std::env::var_os("CI").is_none(), "CI needs {what}: {error}");
    eprintln!("skipped: no {what} ({error})");
}

#[test]
fn a_session_on_redis() {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    runtime().block_on(async {
        let store = match RedisStore::connect(url.as_str()).await {
            Ok(store) => store,
            Err(error) => return unreachable("Redis", error),
        };
        let prefix = fresh("cli-");
        session(&store.with_prefix(prefix.as_str()), &url, &prefix).await;
    });
}

/// The same session through a Redis Sentinel of the test's own that monitors the
/// machine's Redis: the command asks the Sentinel for the master and works there.
#[test]
fn a_session_through_sentinel() {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let master =
        url.trim_start_matches("redis://").split('/').next().unwrap_or_default().to_owned();
    let Some((host, port)) = master.rsplit_once(':') else { panic!("REDIS_URL {url} has no port") };
    let sentinel_port =
        std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let dir = std::env::temp_dir().join(format!("idempotent-cli-sentinel-{sentinel_port}"));
    std::fs::create_dir_all(&dir).unwrap();
    let conf = dir.join("sentinel.conf");
    std::fs::write(
        &conf,
        format!(
            "port {sentinel_port}\nbind 127.0.0.1\ndir {}\nsentinel monitor cli-orders {host} {port} 1\n",
            dir.display()
        ),
    )
    .unwrap();
    let child = Command::new("redis-server").arg(&conf).arg("--sentinel").spawn();
    let Ok(child) = child else { return unreachable("redis-server", "not installed") };
    struct Killed(std::process::Child, std::path::PathBuf);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
            let _ = std::fs::remove_dir_all(&self.1);
        }
    }
    let _sentinel = Killed(child, dir);
    runtime().block_on(async {
        let store = match RedisStore::connect(url.as_str()).await {
            Ok(store) => store,
            Err(error) => return unreachable("Redis", error),
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", sentinel_port)).is_err() {
            assert!(std::time::Instant::now() < deadline, "the Sentinel did not start");
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let prefix = fresh("cli-sentinel-");
        let through = format!("redis+sentinel://127.0.0.1:{sentinel_port}/cli-orders");
        session(&store.with_prefix(prefix.as_str()), &through, &prefix).await;
    });
}

#[test]
fn a_session_on_postgres() {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    runtime().block_on(async {
        let store = match PostgresStore::connect(&url).await {
            Ok(store) => store,
            Err(error) => return unreachable("PostgreSQL", error),
        };
        let table = fresh("cli_");
        let store = store.with_table(&table).unwrap();
        store.migrate().await.unwrap();
        session(&store, &url, &table).await;
        sqlx_drop(&store, &table).await;
    });
}

async fn sqlx_drop(store: &PostgresStore, table: &str) {
    let drop = sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")));
    drop.execute(store.pool()).await.unwrap();
}

#[test]
fn a_session_on_mysql() {
    let url = std::env::var("MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
    runtime().block_on(async {
        let store = match MysqlStore::connect(&url).await {
            Ok(store) => store,
            Err(error) => return unreachable("MySQL or MariaDB", error),
        };
        let table = fresh("cli_");
        let store = store.with_table(&table).unwrap();
        store.migrate().await.unwrap();
        // The same server under MariaDB's scheme.
        let mariadb = url.replacen("mysql://", "mariadb://", 1);
        session(&store, &mariadb, &table).await;
        let drop = sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")));
        drop.execute(store.pool()).await.unwrap();
    });
}

#[test]
fn a_session_on_zookeeper() {
    let hosts = std::env::var("ZOOKEEPER_HOSTS").unwrap_or_else(|_| "127.0.0.1:2181".to_owned());
    runtime().block_on(async {
        let root = format!("/idempotent-cli-test/{}", fresh("run-"));
        let timeout = zookeeper_store::DEFAULT_SESSION_TIMEOUT;
        let store = match ZooKeeperStore::connect_with(&hosts, &root, timeout).await {
            Ok(store) => store,
            Err(error) => return unreachable("ZooKeeper", error),
        };
        session(&store, &format!("zk://{hosts}"), &root).await;
    });
}

#[test]
fn bad_urls_and_unreachable_stores_say_so_without_the_password() {
    let run = |url: &str| {
        Command::new(env!("CARGO_BIN_EXE_idempotent"))
            .args(["--store", url, "stats"])
            .env_remove("IDEMPOTENT_STORE")
            .output()
            .unwrap()
    };
    let unknown = run("ftp://host/x");
    assert_eq!(code(&unknown), 2);
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("redis://"), "{unknown:?}");

    let down = run("redis://admin:hunter2@127.0.0.1:1/0");
    assert_eq!(code(&down), 3, "{down:?}");
    let said = String::from_utf8_lossy(&down.stderr);
    assert!(said.contains("redis://admin:***@127.0.0.1:1/0"), "{said}");
    assert!(!said.contains("hunter2"), "{said}");

    // A password that was not percent-encoded, and a URL without its scheme.
    for url in [
        "redis://:hun/ter2@127.0.0.1:1/0",
        "postgres://app:hun?ter2@127.0.0.1:1/db",
        "admin:hunter2@db:6379",
    ] {
        let failed = run(url);
        assert!([2, 3].contains(&code(&failed)), "{failed:?}");
        let said = String::from_utf8_lossy(&failed.stderr);
        assert!(!said.contains("ter2"), "{said}");
    }

    let sentinel_down = run("redis+sentinel://app:hunter2@127.0.0.1:1/orders");
    assert_eq!(code(&sentinel_down), 3, "{sentinel_down:?}");
    assert!(!String::from_utf8_lossy(&sentinel_down.stderr).contains("hunter2"));
    let no_master = run("redis+sentinel://127.0.0.1:1");
    assert_eq!(code(&no_master), 2, "{no_master:?}");
    assert!(String::from_utf8_lossy(&no_master.stderr).contains("/master-name"), "{no_master:?}");

    let pg_down = run("postgres://app:hunter2@127.0.0.1:1/db");
    assert_eq!(code(&pg_down), 3);
    assert!(!String::from_utf8_lossy(&pg_down.stderr).contains("hunter2"));

    let mysql_down = run("mysql://app:hunter2@127.0.0.1:1/db");
    assert_eq!(code(&mysql_down), 3, "{mysql_down:?}");
    assert!(!String::from_utf8_lossy(&mysql_down.stderr).contains("hunter2"));

    let zk_parameters = run("zk://127.0.0.1:2181/idempotent?timeout=5");
    assert_eq!(code(&zk_parameters), 2, "{zk_parameters:?}");

    let none = Command::new(env!("CARGO_BIN_EXE_idempotent"))
        .arg("stats")
        .env_remove("IDEMPOTENT_STORE")
        .output()
        .unwrap();
    assert_eq!(code(&none), 2);
}
