//! The `redis` configuration: `RedisStore` and a Redis Streams consumer group, the
//! store outside the effect (a line appended to the consumer's ledger file). The
//! controller runs a `redis-server` of its own, so it can restart and pause it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use idempotent::consume::redis_streams::{StreamConsumer, StreamMessage};
use idempotent::{RedisStore, idempotent};
use redis::aio::ConnectionManager;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::Opts;
use crate::faults::{FaultKind, FaultLog, Rng};
use crate::ledger::{AppendFile, Effect, effect_line, now_ns, read_effects};
use crate::proxy::Proxy;

/// How long a command of the controller's may take (a paused server answers late).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(8);

/// The run's `redis-server` process: append-only file fsynced at every write.
pub struct RedisServer {
    /// Its port.
    pub port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl RedisServer {
    /// Starts a server on a free port, keeping its files in `dir`.
    pub async fn start(dir: &Path) -> Result<RedisServer, String> {
        let ok = Command::new("redis-server")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if !ok {
            return Err("the redis config needs the `redis-server` binary on PATH \
                        (Debian: apt-get install redis-server)"
                .into());
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("no free port: {e}"))?
            .port();
        let dir = dir.join("redis");
        std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let mut server = RedisServer { port, dir, child: None };
        server.spawn().await?;
        Ok(server)
    }

    async fn spawn(&mut self) -> Result<(), String> {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--appendonly", "yes", "--appendfsync", "always", "--save", ""])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("starting redis-server: {e}"))?;
        self.child = Some(child);
        for _ in 0..200 {
            if ping(self.port).await {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(format!("redis-server on port {} did not answer PING within 10 s", self.port))
    }

    /// The server's pid.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends `signal` (`TERM`, `STOP`, `CONT`) to the server.
    pub fn signal(&self, signal: &str) {
        if let Some(pid) = self.pid() {
            let _ = Command::new("kill").arg(format!("-{signal}")).arg(pid.to_string()).status();
        }
    }

    /// SIGTERM, wait for the exit (SIGKILL after 15 s), start again on the same files.
    pub async fn restart(&mut self) -> Result<(), String> {
        self.signal("TERM");
        if let Some(mut child) = self.child.take() {
            for _ in 0..300 {
                if child.try_wait().ok().flatten().is_some() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            if child.try_wait().ok().flatten().is_none() {
                tracing::warn!("redis-server ignored SIGTERM for 15 s; killing it");
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        self.spawn().await
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.signal("CONT");
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Whether a server on `port` answers `PING` (not while it loads its files).
async fn ping(port: u16) -> bool {
    let attempt = async {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
        stream.write_all(b"PING\r\n").await.ok()?;
        let mut reply = [0u8; 16];
        let n = stream.read(&mut reply).await.ok()?;
        Some(reply[..n].starts_with(b"+PONG"))
    };
    tokio::time::timeout(Duration::from_secs(1), attempt).await.ok().flatten().unwrap_or(false)
}

/// What the controller holds for a `redis` run.
pub struct RedisWorld {
    server: tokio::sync::Mutex<RedisServer>,
    proxy: Proxy,
    admin: ConnectionManager,
    /// The stream messages are published to.
    pub stream: String,
    prefix: String,
    dir: PathBuf,
}

/// The consumer group's name.
const GROUP: &str = "soak";

impl RedisWorld {
    /// Starts the server and the proxy in front of it.
    pub async fn start(run: &str, dir: &Path) -> Result<RedisWorld, String> {
        let server = RedisServer::start(dir).await?;
        let upstream = SocketAddr::from(([127, 0, 0, 1], server.port));
        let proxy = Proxy::start(upstream).await.map_err(|e| format!("starting the proxy: {e}"))?;
        let admin = connect(&direct_url(server.port)).await?;
        Ok(RedisWorld {
            server: tokio::sync::Mutex::new(server),
            proxy,
            admin,
            stream: format!("soak-{run}:messages"),
            prefix: format!("soak-{run}"),
            dir: dir.to_owned(),
        })
    }

    /// The arguments after `consume` for consumer slot `slot`.
    pub fn consumer_args(&self) -> impl Fn(usize) -> Vec<String> + Send + 'static {
        let (url, stream, prefix, dir) = (
            format!("redis://127.0.0.1:{}", self.proxy.port),
            self.stream.clone(),
            self.prefix.clone(),
            self.dir.clone(),
        );
        move |slot| {
            [
                ("--config", "redis".to_owned()),
                ("--url", url.clone()),
                ("--stream", stream.clone()),
                ("--prefix", prefix.clone()),
                ("--name", format!("c{slot}")),
                ("--ledger", dir.join(format!("ledger-{slot}.txt")).display().to_string()),
                ("--events", dir.join(format!("events-{slot}.txt")).display().to_string()),
            ]
            .into_iter()
            .flat_map(|(k, v)| [k.to_owned(), v])
            .collect()
        }
    }

    /// A connection for the publisher, straight to the server.
    pub async fn publisher(&self) -> Result<ConnectionManager, String> {
        connect(&direct_url(self.server.lock().await.port)).await
    }

    /// Injects one fault of `kind` (not a consumer kill), waiting out its span.
    pub async fn inject(&self, kind: FaultKind, rng: &mut Rng, log: &FaultLog) {
        match kind {
            FaultKind::Restart => {
                let mut server = self.server.lock().await;
                log.record(kind, format!("redis-server pid {:?}", server.pid()), None);
                if let Err(error) = server.restart().await {
                    tracing::error!(%error, "restarting redis-server failed");
                }
            }
            FaultKind::Pause => {
                let span = rng.millis(3_000, 5_000);
                let server = self.server.lock().await;
                log.record(kind, format!("redis-server for {} ms", span.as_millis()), None);
                server.signal("STOP");
                tokio::time::sleep(span).await;
                server.signal("CONT");
            }
            FaultKind::ClientKill => {
                let mut admin = self.admin.clone();
                let mut kill = redis::cmd("CLIENT");
                kill.arg("KILL").arg("TYPE").arg("normal");
                // The admin connection may have been dropped by an earlier restart: the
                // manager reconnects after the first failure, so try a few times.
                let mut target = String::new();
                for _ in 0..5 {
                    let killed =
                        tokio::time::timeout(COMMAND_TIMEOUT, kill.query_async::<i64>(&mut admin));
                    match killed.await {
                        Ok(Ok(n)) => {
                            target = format!("{n} connections");
                            break;
                        }
                        Ok(Err(e)) => target = format!("failed: {e}"),
                        Err(_) => target = "timed out".to_owned(),
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                log.record(kind, target, None);
            }
            FaultKind::NetCut => {
                let span = rng.millis(1_000, 5_000);
                log.record(kind, format!("proxy for {} ms", span.as_millis()), None);
                self.proxy.cut(span);
                tokio::time::sleep(span).await;
                self.proxy.heal();
            }
            FaultKind::Kill | FaultKind::BackendKill => unreachable!("not a redis fault"),
        }
    }

    /// The effects the consumers have appended so far.
    pub fn effects(&self) -> Vec<Effect> {
        read_effects(&self.dir)
    }

    /// Whether the group has nothing pending and nothing unread.
    pub async fn settled(&self) -> bool {
        let mut admin = self.admin.clone();
        let check = async {
            let pending: Vec<redis::Value> =
                redis::cmd("XPENDING").arg(&self.stream).arg(GROUP).query_async(&mut admin).await?;
            let pending: u64 = redis::from_redis_value(pending[0].clone())?;
            let groups: Vec<HashMap<String, redis::Value>> =
                redis::cmd("XINFO").arg("GROUPS").arg(&self.stream).query_async(&mut admin).await?;
            let lag: Option<u64> = redis::from_redis_value(groups[0]["lag"].clone()).ok();
            redis::RedisResult::Ok(pending == 0 && lag == Some(0))
        };
        matches!(tokio::time::timeout(COMMAND_TIMEOUT, check).await, Ok(Ok(true)))
    }

    /// Makes sure the server runs and the proxy forwards (after the last fault).
    pub async fn heal(&self) {
        self.server.lock().await.signal("CONT");
        self.proxy.heal();
    }

    /// Stops the server and removes its files.
    pub async fn cleanup(self) {
        let server = self.server.into_inner();
        let dir = server.dir.clone();
        drop(server);
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Publishes message `id`, published at `at_ns`, to `stream` with its id as the
/// message id.
pub async fn publish(
    conn: &mut ConnectionManager,
    stream: &str,
    id: u64,
    at_ns: u64,
) -> Result<(), String> {
    let body = format!(r#"{{"id":{id},"published_ns":{at_ns}}}"#);
    let fields: [(&str, &[u8]); 1] = [("payload", body.as_bytes())];
    let message_id = id.to_string();
    let sent =
        idempotent::publish::redis_streams::publish(conn, stream, &fields, Some(&message_id));
    match tokio::time::timeout(COMMAND_TIMEOUT, sent).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("timed out".into()),
    }
}

fn direct_url(port: u16) -> String {
    format!("redis://127.0.0.1:{port}")
}

async fn connect(url: &str) -> Result<ConnectionManager, String> {
    let client = redis::Client::open(url).map_err(|e| e.to_string())?;
    ConnectionManager::new(client).await.map_err(|e| format!("connecting to Redis at {url}: {e}"))
}

/// What a consumer's handler needs.
struct Ctx {
    store: RedisStore,
    ledger: AppendFile,
    events: AppendFile,
    pid: u32,
}

/// The effect: one ledger line, outside the store.
#[idempotent(key = "{message_id}", store = ctx.store, namespace = "soak", lease = "2s", ttl = "1h",
             max_attempts = 1000, backoff = "100ms..2s")]
async fn apply(msg: StreamMessage, ctx: &Ctx) -> Result<(), std::io::Error> {
    let id: u64 = msg.message_id.parse().map_err(std::io::Error::other)?;
    ctx.ledger.append(&effect_line(id, ctx.pid, now_ns()))
}

/// The consumer process of a `redis` run: polls the group for ever.
pub async fn consume(opts: &Opts) -> Result<(), String> {
    let url = opts.required("--url")?;
    let stream = opts.required("--stream")?;
    let prefix = opts.required("--prefix")?;
    let name = opts.required("--name")?;
    let ledger =
        AppendFile::open(Path::new(opts.required("--ledger")?)).map_err(|e| e.to_string())?;
    let events =
        AppendFile::open(Path::new(opts.required("--events")?)).map_err(|e| e.to_string())?;
    let store = loop {
        match RedisStore::connect(url).await {
            Ok(store) => break store.with_prefix(prefix.to_owned()),
            Err(error) => tracing::warn!(%error, "connecting the store; trying again"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let client = redis::Client::open(url).map_err(|e| e.to_string())?;
    let consumer = loop {
        match StreamConsumer::new(&client, stream, GROUP, name).await {
            Ok(consumer) => break consumer,
            Err(error) => tracing::warn!(%error, "joining the group; trying again"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let consumer = consumer
        .batch(16)
        .concurrency(8)
        .block(Duration::from_millis(200))
        .reclaim_idle(Duration::from_secs(3));
    let ctx = Ctx { store, ledger, events, pid: std::process::id() };
    loop {
        let polled = consumer
            .poll(|msg| {
                let id = msg.message_id.clone();
                let ctx = &ctx;
                async move {
                    let result = apply(msg, ctx).await;
                    crate::note(&ctx.events, ctx.pid, &id, &result);
                    result
                }
            })
            .await;
        if let Err(error) = polled {
            tracing::warn!(%error, "poll failed; polling again");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
