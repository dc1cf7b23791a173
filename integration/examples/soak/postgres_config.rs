//! The `postgres` configuration: a transactional `PostgresStore` handler consuming
//! from RabbitMQ, its effect an `INSERT` committed with the DONE record. Consumers
//! reach PostgreSQL through the controller's proxy; RabbitMQ directly.

use std::net::ToSocketAddrs;
use std::path::Path;
use std::time::Duration;

use idempotent::consume::rabbitmq::{RabbitConsumer, RabbitMessage, declare_with_dead_letter};
use idempotent::publish::rabbitmq::RabbitPublisher;
use idempotent::{PostgresStore, idempotent};
use lapin::options::{BasicQosOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool, Postgres, Transaction};

use crate::Opts;
use crate::faults::{FaultKind, FaultLog, Rng};
use crate::ledger::{AppendFile, Effect, now_ns};
use crate::proxy::Proxy;

/// PostgreSQL: `DATABASE_URL`, default `postgres://postgres@127.0.0.1:5432/test`.
fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// RabbitMQ: `AMQP_URL`, default `amqp://guest:guest@127.0.0.1:5672/%2f`.
fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// What the controller holds for a `postgres` run.
pub struct PgWorld {
    admin: PgPool,
    amqp: Connection,
    channel: Channel,
    proxy: Proxy,
    /// The queue messages are published to.
    pub queue: String,
    dead: String,
    records: String,
    effects: String,
    /// The `application_name` prefix of the run's consumers.
    app_prefix: String,
    dir: std::path::PathBuf,
}

impl PgWorld {
    /// Creates the run's tables and queue and starts the proxy.
    pub async fn start(run: &str, dir: &Path) -> Result<PgWorld, String> {
        let url = database_url();
        let options: PgConnectOptions =
            url.parse().map_err(|e| format!("DATABASE_URL {url} is not a PostgreSQL URL: {e}"))?;
        let upstream = (options.get_host(), options.get_port())
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| format!("cannot resolve PostgreSQL's host {}", options.get_host()))?;
        let admin = PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options.application_name(&format!("soak-{run}-admin")))
            .await
            .map_err(|e| {
                format!("the postgres config needs PostgreSQL at {url} (DATABASE_URL): {e}")
            })?;
        let amqp =
            Connection::connect(&amqp_url(), ConnectionProperties::default()).await.map_err(
                |e| format!("the postgres config needs RabbitMQ at {} (AMQP_URL): {e}", amqp_url()),
            )?;
        let channel = amqp.create_channel().await.map_err(|e| e.to_string())?;

        let suffix = run.replace('-', "_");
        let (records, effects) =
            (format!("soak_records_{suffix}"), format!("soak_effects_{suffix}"));
        let store = PostgresStore::from_pool(admin.clone())
            .with_table(&records)
            .map_err(|e| e.to_string())?;
        store.migrate().await.map_err(|e| format!("creating {records}: {e}"))?;
        let create = format!(
            "CREATE TABLE {effects} (msg_id bigint NOT NULL, pid integer NOT NULL, at_ns bigint NOT NULL)"
        );
        sqlx::query(AssertSqlSafe(create)).execute(&admin).await.map_err(|e| e.to_string())?;
        let queue = format!("soak-{run}");
        let dead = declare_with_dead_letter(&channel, &queue).await.map_err(|e| e.to_string())?;
        let proxy = Proxy::start(upstream).await.map_err(|e| format!("starting the proxy: {e}"))?;
        Ok(PgWorld {
            admin,
            amqp,
            channel,
            proxy,
            queue,
            dead,
            records,
            effects,
            app_prefix: format!("soak-{run}-c"),
            dir: dir.to_owned(),
        })
    }

    /// The arguments after `consume` for consumer slot `slot`.
    pub fn consumer_args(&self) -> impl Fn(usize) -> Vec<String> + Send + 'static {
        let (port, queue, records, effects, prefix, dir) = (
            self.proxy.port,
            self.queue.clone(),
            self.records.clone(),
            self.effects.clone(),
            self.app_prefix.clone(),
            self.dir.clone(),
        );
        move |slot| {
            [
                ("--config", "postgres".to_owned()),
                ("--pg-port", port.to_string()),
                ("--app", format!("{prefix}{slot}")),
                ("--queue", queue.clone()),
                ("--records", records.clone()),
                ("--effects", effects.clone()),
                ("--events", dir.join(format!("events-{slot}.txt")).display().to_string()),
            ]
            .into_iter()
            .flat_map(|(k, v)| [k.to_owned(), v])
            .collect()
        }
    }

    /// A publisher on a channel of its own.
    pub async fn publisher(&self) -> Result<RabbitPublisher, String> {
        let channel = self.amqp.create_channel().await.map_err(|e| e.to_string())?;
        RabbitPublisher::new(&channel).await.map_err(|e| e.to_string())
    }

    /// Injects one fault of `kind` (not a consumer kill), waiting out its span.
    pub async fn inject(&self, kind: FaultKind, rng: &mut Rng, log: &FaultLog) {
        match kind {
            FaultKind::BackendKill => {
                let sql = "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                           WHERE left(application_name, length($1)) = $1";
                let killed: Result<i64, _> =
                    sqlx::query_scalar(sql).bind(&self.app_prefix).fetch_one(&self.admin).await;
                let target = match killed {
                    Ok(n) => format!("{n} backends of {}*", self.app_prefix),
                    Err(e) => format!("failed: {e}"),
                };
                log.record(kind, target, None);
            }
            FaultKind::NetCut => {
                let span = rng.millis(1_000, 5_000);
                log.record(kind, format!("proxy for {} ms", span.as_millis()), None);
                self.proxy.cut(span);
                tokio::time::sleep(span).await;
                self.proxy.heal();
            }
            other => unreachable!("not a postgres fault: {other}"),
        }
    }

    /// The effects committed so far.
    pub async fn effects(&self) -> Result<Vec<Effect>, String> {
        let sql = format!("SELECT msg_id, pid, at_ns FROM {}", self.effects);
        let rows: Vec<(i64, i32, i64)> = sqlx::query_as(AssertSqlSafe(sql))
            .fetch_all(&self.admin)
            .await
            .map_err(|e| e.to_string())?;
        Ok(rows
            .into_iter()
            .map(|(id, pid, at)| Effect { id: id as u64, pid: pid as u32, at_ns: at as u64 })
            .collect())
    }

    /// Whether the queue has no message ready (those unacked are not counted).
    pub async fn settled(&self) -> bool {
        let passive = QueueDeclareOptions { passive: true, ..Default::default() };
        let declared =
            self.channel.queue_declare(self.queue.as_str().into(), passive, FieldTable::default());
        matches!(declared.await, Ok(q) if q.message_count() == 0)
    }

    /// Makes sure the proxy forwards (after the last fault).
    pub async fn heal(&self) {
        self.proxy.heal();
    }

    /// Drops the run's tables, queues and exchange.
    pub async fn cleanup(self) {
        let sql = format!("DROP TABLE IF EXISTS {}, {}", self.records, self.effects);
        if let Err(error) = sqlx::query(AssertSqlSafe(sql)).execute(&self.admin).await {
            tracing::error!(%error, "dropping the run's tables");
        }
        for queue in [&self.queue, &self.dead] {
            let _ = self.channel.queue_delete(queue.as_str().into(), Default::default()).await;
        }
        let dlx = format!("{}.dlx", self.queue);
        let _ = self.channel.exchange_delete(dlx.as_str().into(), Default::default()).await;
        let _ = self.amqp.close(200, "done".into()).await;
        self.admin.close().await;
    }
}

/// Publishes message `id`, published at `at_ns`, with its id as the message id.
pub async fn publish(
    publisher: &RabbitPublisher,
    queue: &str,
    id: u64,
    at_ns: u64,
) -> Result<(), String> {
    let body = format!(r#"{{"id":{id},"published_ns":{at_ns}}}"#);
    let properties = BasicProperties::default().with_message_id(id.to_string().into());
    let sent = publisher.publish("", queue, body.as_bytes(), properties);
    match tokio::time::timeout(Duration::from_secs(10), sent).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("timed out".into()),
    }
}

/// What a consumer's handler needs.
struct Ctx {
    store: PostgresStore,
    insert: String,
    events: AppendFile,
    pid: u32,
}

/// The effect: one row, committed with the DONE record.
#[idempotent(key = "{message_id}", store = ctx.store, namespace = "soak", transactional,
             lease = "2s", ttl = "1h", max_attempts = 1000, backoff = "100ms..2s")]
async fn apply(
    msg: RabbitMessage,
    ctx: &Ctx,
    tx: &mut Transaction<'_, Postgres>,
) -> Result<(), sqlx::Error> {
    let id: i64 = msg.message_id.parse().unwrap_or(-1);
    sqlx::query(AssertSqlSafe(ctx.insert.as_str()))
        .bind(id)
        .bind(ctx.pid as i32)
        .bind(now_ns() as i64)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// The consumer process of a `postgres` run: consumes the queue until its channel
/// fails (then it exits, and the controller starts it again).
pub async fn consume(opts: &Opts) -> Result<(), String> {
    let port: u16 = opts.required("--pg-port")?.parse().map_err(|_| "--pg-port: a port")?;
    let app = opts.required("--app")?;
    let queue = opts.required("--queue")?;
    let records = opts.required("--records")?;
    let effects = opts.required("--effects")?;
    let events =
        AppendFile::open(Path::new(opts.required("--events")?)).map_err(|e| e.to_string())?;
    let url = database_url();
    let options: PgConnectOptions = url.parse().map_err(|e| format!("DATABASE_URL: {e}"))?;
    let options = options.host("127.0.0.1").port(port).application_name(app);
    let pool = PgPoolOptions::new()
        .max_connections(10)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with(options);
    let store = PostgresStore::from_pool(pool).with_table(records).map_err(|e| e.to_string())?;
    let amqp = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .map_err(|e| format!("RabbitMQ: {e}"))?;
    let channel = amqp.create_channel().await.map_err(|e| e.to_string())?;
    channel.basic_qos(64, BasicQosOptions::default()).await.map_err(|e| e.to_string())?;
    let consumer = RabbitConsumer::new(&channel, queue, app).await.map_err(|e| e.to_string())?;
    let consumer = consumer.concurrency(8);
    let insert = format!("INSERT INTO {effects} (msg_id, pid, at_ns) VALUES ($1, $2, $3)");
    let ctx = Ctx { store, insert, events, pid: std::process::id() };
    let ran = consumer
        .run(|msg| {
            let id = msg.message_id.clone();
            let ctx = &ctx;
            async move {
                let result = apply(msg, ctx).await;
                crate::note(&ctx.events, ctx.pid, &id, &result);
                result
            }
        })
        .await;
    ran.map_err(|e| format!("consuming: {e}"))
}
