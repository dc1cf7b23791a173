//! The controller's hold on one configuration's servers, and the publisher.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::Config;
use crate::faults::{FaultKind, FaultLog, Rng};
use crate::ledger::{Effect, now_ns};
use crate::postgres_config::{self, PgWorld};
use crate::redis_config::{self, RedisWorld};

/// The controller's hold on one configuration's servers.
pub enum World {
    /// A `redis` run.
    Redis(RedisWorld),
    /// A `postgres` run.
    Postgres(Box<PgWorld>),
}

impl World {
    pub async fn start(config: Config, run: &str, dir: &Path) -> Result<World, String> {
        Ok(match config {
            Config::Redis => World::Redis(RedisWorld::start(run, dir).await?),
            Config::Postgres => World::Postgres(Box::new(PgWorld::start(run, dir).await?)),
        })
    }

    pub fn consumer_args(&self) -> Box<dyn Fn(usize) -> Vec<String> + Send> {
        match self {
            World::Redis(w) => Box::new(w.consumer_args()),
            World::Postgres(w) => Box::new(w.consumer_args()),
        }
    }

    pub async fn inject(&self, kind: FaultKind, rng: &mut Rng, log: &FaultLog) {
        match self {
            World::Redis(w) => w.inject(kind, rng, log).await,
            World::Postgres(w) => w.inject(kind, rng, log).await,
        }
    }

    pub async fn effects(&self) -> Result<Vec<Effect>, String> {
        match self {
            World::Redis(w) => Ok(w.effects()),
            World::Postgres(w) => w.effects().await,
        }
    }

    pub async fn settled(&self) -> bool {
        match self {
            World::Redis(w) => w.settled().await,
            World::Postgres(w) => w.settled().await,
        }
    }

    pub async fn heal(&self) {
        match self {
            World::Redis(w) => w.heal().await,
            World::Postgres(w) => w.heal().await,
        }
    }

    pub async fn cleanup(self) {
        match self {
            World::Redis(w) => w.cleanup().await,
            World::Postgres(w) => (*w).cleanup().await,
        }
    }
}

/// Publishes `0..` at `rate` a second until `stop`, each id again until it is
/// stored; answers each id's publish time (Unix ns, its first attempt).
pub async fn publish_all(
    world: Arc<World>,
    rate: u64,
    stop: Arc<AtomicBool>,
) -> Result<Vec<u64>, String> {
    enum Publisher {
        Redis(redis::aio::ConnectionManager, String),
        Rabbit(idempotent::publish::rabbitmq::RabbitPublisher, String),
    }
    let mut publisher = match &*world {
        World::Redis(w) => Publisher::Redis(w.publisher().await?, w.stream.clone()),
        World::Postgres(w) => Publisher::Rabbit(w.publisher().await?, w.queue.clone()),
    };
    let start = Instant::now();
    let mut published = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        let due = (start.elapsed().as_secs_f64() * rate as f64) as u64;
        if published.len() as u64 >= due {
            tokio::time::sleep(Duration::from_millis(2)).await;
            continue;
        }
        let id = published.len() as u64;
        let at = now_ns();
        let mut failures = 0u32;
        loop {
            let sent = match &mut publisher {
                Publisher::Redis(conn, stream) => redis_config::publish(conn, stream, id, at).await,
                Publisher::Rabbit(p, queue) => postgres_config::publish(p, queue, id, at).await,
            };
            match sent {
                Ok(()) => break,
                Err(error) => {
                    failures += 1;
                    if failures % 20 == 1 {
                        tracing::warn!(id, %error, "publishing failed; sending it again");
                    }
                    if failures > 1_200 {
                        return Err(format!(
                            "publishing message {id} failed for 2 minutes: {error}"
                        ));
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        published.push(at);
    }
    Ok(published)
}
