//! A soak runner with fault injection: consumers run as separate processes for minutes
//! while the controller kills them, restarts and pauses the store, kills its
//! connections and cuts the network; then every published message is accounted for.
//!
//! ```text
//! soak run --config <redis|postgres> [--minutes M | --seconds S] [--consumers N]
//!          [--rate MSGS_PER_S] [--seed SEED]
//! soak run --short            both configurations, about a minute each
//! soak consume ...            a consumer process (started by `run`)
//! ```
//!
//! `redis`: `RedisStore` and a Redis Streams group on a `redis-server` of the run's own;
//! the effect is a line in the consumer's ledger file, outside the store, so a fault
//! between the effect and DONE may repeat it: every repeat must have such a fault
//! behind it. `postgres`: a `transactional` handler on PostgreSQL consuming from
//! RabbitMQ; the effect is a row committed with DONE, so nothing may repeat. In both,
//! nothing may be lost. The summary is a markdown table on stdout; logs go to stderr.

mod faults;
mod ledger;
mod postgres_config;
mod procs;
mod proxy;
mod redis_config;
mod world;

use std::collections::HashMap;
use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use faults::{FaultKind, FaultLog, Rng, Schedule};
use idempotent::{Error, Outcome};
use ledger::{AppendFile, now_ns};
use procs::Consumers;
use world::{World, publish_all};

/// Command-line options after the role: `--name value` pairs and bare flags.
pub struct Opts(HashMap<String, Option<String>>);

impl Opts {
    fn parse(args: &[String]) -> Result<Opts, String> {
        let mut opts = HashMap::new();
        let mut args = args.iter().peekable();
        while let Some(arg) = args.next() {
            if !arg.starts_with("--") {
                return Err(format!("unexpected argument `{arg}`"));
            }
            let value = args.next_if(|next| !next.starts_with("--")).cloned();
            opts.insert(arg.clone(), value);
        }
        Ok(Opts(opts))
    }

    /// The value of `--name`, which must be given.
    pub fn required(&self, name: &str) -> Result<&str, String> {
        self.get(name).ok_or_else(|| format!("{name} is required"))
    }

    fn get(&self, name: &str) -> Option<&str> {
        self.0.get(name).and_then(|v| v.as_deref())
    }

    fn flag(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }

    fn number<T: std::str::FromStr>(&self, name: &str, default: T) -> Result<T, String> {
        match self.get(name) {
            None if self.flag(name) => Err(format!("{name} needs a value")),
            None => Ok(default),
            Some(v) => v.parse().map_err(|_| format!("{name}: `{v}` is not a number")),
        }
    }
}

/// Writes an event line for a call that recorded DONE (`done`: its effect must not
/// repeat), or whose effect may repeat: its `complete` answered lease-lost, or the
/// effect ran and DONE could not be written.
pub fn note<E: std::fmt::Display>(
    events: &AppendFile,
    pid: u32,
    id: &str,
    result: &Result<Outcome<()>, Error<E>>,
) {
    let kind = match result {
        Ok(Outcome::Processed(_)) => "done",
        Err(Error::LeaseLost { .. }) => "lease_lost",
        Err(Error::Store { handler_ran: true, .. }) => "done_unrecorded",
        _ => return,
    };
    if let Err(Error::Store { error, .. }) = result {
        tracing::warn!(id, %error, "the effect ran but DONE was not written");
    }
    let _ = events.append(&format!("{id} {pid} {} {kind}\n", now_ns()));
}

/// One configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Config {
    Redis,
    Postgres,
}

impl Config {
    fn name(self) -> &'static str {
        match self {
            Config::Redis => "redis",
            Config::Postgres => "postgres",
        }
    }

    /// The faults this configuration injects.
    fn kinds(self) -> &'static [FaultKind] {
        match self {
            Config::Redis => &[
                FaultKind::Kill,
                FaultKind::Restart,
                FaultKind::Pause,
                FaultKind::ClientKill,
                FaultKind::NetCut,
            ],
            Config::Postgres => &[FaultKind::Kill, FaultKind::BackendKill, FaultKind::NetCut],
        }
    }
}

/// What `run` was asked to do.
struct Plan {
    configs: Vec<Config>,
    duration: Duration,
    consumers: usize,
    rate: u64,
    seed: u64,
    short: bool,
}

impl Plan {
    fn parse(opts: &Opts) -> Result<Plan, String> {
        let short = opts.flag("--short");
        let configs = match opts.get("--config") {
            Some("redis") => vec![Config::Redis],
            Some("postgres") => vec![Config::Postgres],
            Some(other) => return Err(format!("--config: `{other}` is not redis or postgres")),
            None if short => vec![Config::Redis, Config::Postgres],
            None => return Err("--config redis|postgres (or --short) is required".into()),
        };
        let duration = if let Some(s) = opts.get("--seconds") {
            Duration::from_secs(s.parse().map_err(|_| "--seconds: a number")?)
        } else if let Some(m) = opts.get("--minutes") {
            Duration::from_secs_f64(m.parse::<f64>().map_err(|_| "--minutes: a number")? * 60.0)
        } else if short {
            Duration::from_secs(60)
        } else {
            Duration::from_secs(5 * 60)
        };
        let seed = opts.number("--seed", now_ns() ^ u64::from(std::process::id()))?;
        Ok(Plan {
            configs,
            duration,
            consumers: opts.number("--consumers", 3usize)?.max(1),
            rate: opts.number("--rate", 200u64)?.max(1),
            seed,
            short,
        })
    }

    /// The gap between faults, in milliseconds.
    fn gaps(&self) -> (u64, u64) {
        if self.short || self.duration < Duration::from_secs(180) {
            (3_000, 6_000)
        } else {
            (5_000, 20_000)
        }
    }
}

/// A task aborted when dropped, so an early return leaves nothing running.
struct Task<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for Task<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One configuration's run, from start to accounting. Answers its table row and
/// whether its checks passed.
async fn run_config(config: Config, plan: &Plan, seed: u64) -> Result<(String, bool), String> {
    let mut rng = Rng::new(seed);
    let run = format!("{:08x}", rng.next_u64() as u32);
    let dir = std::env::temp_dir().join(format!("soak-{run}"));
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    tracing::info!(config = config.name(), seed, run, dir = %dir.display(), "starting");
    let world = Arc::new(World::start(config, &run, &dir).await?);
    let consumers = Consumers::start(plan.consumers, dir.clone(), world.consumer_args())
        .map_err(|e| format!("starting consumers: {e}"));
    let result = match consumers {
        Ok(consumers) => {
            let consumers = Arc::new(Mutex::new(consumers));
            // Setup, the run, up to 120 s of draining, and slack.
            let limit = plan.duration + Duration::from_secs(240);
            let body = soak(config, plan, rng, world.clone(), consumers.clone(), &dir);
            let outcome = tokio::select! {
                outcome = tokio::time::timeout(limit, body) => outcome
                    .unwrap_or_else(|_| Err(format!("the run took longer than {} s", limit.as_secs()))),
                signal = terminated() => Err(format!("stopped by {signal}")),
            };
            consumers.lock().unwrap().stop();
            outcome
        }
        Err(e) => Err(e),
    };
    world.heal().await;
    match Arc::try_unwrap(world) {
        Ok(world) => world.cleanup().await,
        Err(_) => tracing::error!("the world is still shared at cleanup; its servers stop on drop"),
    }
    match &result {
        Ok((_, true)) => {
            let _ = std::fs::remove_dir_all(&dir);
        }
        _ => tracing::warn!(dir = %dir.display(), "kept the run's ledgers, events and logs"),
    }
    result
}

/// The run proper: consumers, publisher and faults for the duration, then draining and
/// accounting.
async fn soak(
    config: Config,
    plan: &Plan,
    mut rng: Rng,
    world: Arc<World>,
    consumers: Arc<Mutex<Consumers>>,
    dir: &Path,
) -> Result<(String, bool), String> {
    let log = FaultLog::create(&dir.join("faults.txt")).map_err(|e| e.to_string())?;
    let tend = {
        let consumers = consumers.clone();
        Task(tokio::spawn(async move {
            loop {
                consumers.lock().unwrap().tend();
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }))
    };
    let stop_publishing = Arc::new(AtomicBool::new(false));
    let mut publisher =
        Task(tokio::spawn(publish_all(world.clone(), plan.rate, stop_publishing.clone())));

    let started = Instant::now();
    let end = started + plan.duration;
    let stop_faults = Arc::new(AtomicBool::new(false));
    let mut faults = {
        let (world, log, consumers, stop) =
            (world.clone(), log.clone(), consumers.clone(), stop_faults.clone());
        let (gaps, kinds) = (plan.gaps(), config.kinds());
        Task(tokio::spawn(async move {
            let mut schedule = Schedule::new(kinds, &mut rng);
            let mut next = Instant::now() + rng.millis(2_000, 4_000);
            while !stop.load(Ordering::SeqCst) {
                if Instant::now() < next {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                match schedule.next(&mut rng) {
                    FaultKind::Kill => {
                        let mut consumers = consumers.lock().unwrap();
                        let slot = rng.between(0, consumers.len() as u64 - 1) as usize;
                        let down = rng.millis(500, 2_000);
                        if let Some(pid) = consumers.kill(slot, down) {
                            let target = format!(
                                "consumer {slot} pid {pid}, back in {} ms",
                                down.as_millis()
                            );
                            log.record(FaultKind::Kill, target, Some(pid));
                        }
                    }
                    kind => world.inject(kind, &mut rng, &log).await,
                }
                next = Instant::now() + rng.millis(gaps.0, gaps.1);
            }
        }))
    };

    while Instant::now() < end {
        if publisher.0.is_finished() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop_faults.store(true, Ordering::SeqCst);
    let _ = (&mut faults.0).await;
    world.heal().await;
    stop_publishing.store(true, Ordering::SeqCst);
    let published =
        (&mut publisher.0).await.map_err(|e| format!("the publisher failed: {e}"))??;
    let ran = started.elapsed();
    consumers.lock().unwrap().respawn_all_now();
    tracing::info!(
        messages = published.len(),
        faults = log.faults().len(),
        "publishing stopped; draining"
    );

    // Drain: until every id has an effect and the broker holds nothing, or nothing
    // changes for 30 s, at most 120 s.
    let drain_end = Instant::now() + Duration::from_secs(120);
    let (mut seen, mut changed) = (0usize, Instant::now());
    loop {
        let effects = world.effects().await.unwrap_or_default();
        let mut ids: Vec<u64> = effects.iter().map(|e| e.id).collect();
        ids.sort_unstable();
        ids.dedup();
        if ids.len() != seen {
            (seen, changed) = (ids.len(), Instant::now());
        }
        if ids.len() >= published.len() && world.settled().await {
            // Whatever was still in flight settles too.
            tokio::time::sleep(Duration::from_secs(2)).await;
            break;
        }
        if changed.elapsed() > Duration::from_secs(30) || Instant::now() > drain_end {
            tracing::warn!(effected = ids.len(), published = published.len(), "draining gave up");
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    drop(tend);
    consumers.lock().unwrap().stop();

    let effects = world.effects().await?;
    let events = ledger::read_events(dir);
    let faults = log.faults();
    let accounting = ledger::account(&published, &effects, &events, &faults);
    for id in accounting.lost.iter().take(20) {
        tracing::error!(id, "lost: published, never applied");
    }
    let mut ok = accounting.lost.is_empty();
    for double in &accounting.doubles {
        let evidence: Vec<String> = double
            .effects
            .iter()
            .zip(double.reasons.iter().map(Some).chain(std::iter::once(None)))
            .map(|(e, reason)| match reason {
                Some(Some(r)) => format!("pid {} at {} ({r})", e.pid, e.at_ns),
                Some(None) => format!("pid {} at {} (UNEXPLAINED)", e.pid, e.at_ns),
                None => format!("pid {} at {}", e.pid, e.at_ns),
            })
            .collect();
        let related: Vec<String> = faults
            .iter()
            .filter(|f| {
                double.effects.iter().any(|e| {
                    f.at_ns + 10_000_000_000 >= e.at_ns && f.at_ns <= e.at_ns + 10_000_000_000
                })
            })
            .map(|f| format!("{} at {} ({})", f.kind, f.at_ns, f.target))
            .collect();
        if config == Config::Postgres || !double.explained() {
            ok = false;
            tracing::error!(id = double.id, effects = ?evidence, faults_near = ?related, "doubled, not explained");
        } else {
            tracing::info!(id = double.id, effects = ?evidence, "doubled, explained");
        }
    }
    let row = ledger::table_row(
        config.name(),
        ran.as_secs_f64() / 60.0,
        plan.consumers,
        &faults,
        &accounting,
    );
    tracing::info!(config = config.name(), ok, "{row}");
    Ok((row, ok))
}

/// Waits for SIGINT, SIGTERM or SIGHUP; answers which came.
async fn terminated() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut hup)) =
        (signal(SignalKind::terminate()), signal(SignalKind::hangup()))
    else {
        let _ = tokio::signal::ctrl_c().await;
        return "SIGINT";
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => "SIGINT",
        _ = term.recv() => "SIGTERM",
        _ = hup.recv() => "SIGHUP",
    }
}

async fn run(opts: &Opts) -> ExitCode {
    let plan = match Plan::parse(opts) {
        Ok(plan) => plan,
        Err(e) => {
            eprintln!("soak run: {e}");
            return ExitCode::from(2);
        }
    };
    tracing::info!(seed = plan.seed, "seed (rerun with --seed {})", plan.seed);
    let mut rows = Vec::new();
    let mut code = ExitCode::SUCCESS;
    for (i, config) in plan.configs.iter().enumerate() {
        let seed = plan.seed.wrapping_add(i as u64);
        match run_config(*config, &plan, seed).await {
            Ok((row, ok)) => {
                rows.push(row);
                if !ok {
                    code = ExitCode::FAILURE;
                }
            }
            Err(e) => {
                tracing::error!(config = config.name(), "the run could not complete: {e}");
                eprintln!("soak run: {} config: {e}", config.name());
                return ExitCode::from(2);
            }
        }
    }
    println!("{}", ledger::TABLE_HEADER);
    for row in rows {
        println!("{row}");
    }
    code
}

/// The consumer role: exits when the controller is gone.
async fn consume(opts: &Opts) -> ExitCode {
    let parent = std::os::unix::process::parent_id();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            if std::os::unix::process::parent_id() != parent {
                std::process::exit(0);
            }
        }
    });
    let result = match opts.get("--config") {
        Some("redis") => redis_config::consume(opts).await,
        Some("postgres") => postgres_config::consume(opts).await,
        _ => Err("--config redis|postgres is required".into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("consumer stopped: {e}");
            ExitCode::FAILURE
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let role = args.first().map(String::as_str);
    let level = if role == Some("consume") { tracing::Level::WARN } else { tracing::Level::INFO };
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .with_max_level(level)
        .init();
    let opts = match Opts::parse(args.get(1..).unwrap_or_default()) {
        Ok(opts) => opts,
        Err(e) => {
            eprintln!("soak: {e}");
            return ExitCode::from(2);
        }
    };
    match role {
        Some("run") => run(&opts).await,
        Some("consume") => consume(&opts).await,
        _ => {
            eprintln!(
                "usage: soak run (--config redis|postgres | --short) [--minutes M | --seconds S] \
                       [--consumers N] [--rate R] [--seed S]"
            );
            ExitCode::from(2)
        }
    }
}
