//! `idempotent`: look at and repair the records of idempotent's stores without
//! knowing their format. `idempotent --help` lists the commands; the crate's README
//! has a session.
//!
//! Exit codes: 0 done; 1 no such record; 2 a usage error (bad arguments, bad store
//! URL); 3 the store failed or could not be reached; 4 a release refused (the key is
//! DONE, or another consumer holds it: `--force` overrides); 5 a bulk release not
//! confirmed.

mod connect;
mod output;

use std::io::{BufRead as _, IsTerminal as _, Write as _};
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use idempotent_runtime::Key;
use idempotent_runtime::store::admin::{self, Admin, Filter, Released};

/// Look at and repair the records of idempotent's stores.
#[derive(Debug, Parser)]
#[command(name = "idempotent", version, max_term_width = 100)]
struct Cli {
    /// Where the records are: redis://host:port/db, rediss://..., redis+cluster://host:port,host:port,
    /// redis+sentinel://[user:password@]host:port,host:port/master-name, postgres://user@host/db, mysql://user@host/db, zk://[user:password@]host:port,host:port/root.
    #[arg(long, env = "IDEMPOTENT_STORE", global = true, hide_env_values = true)]
    store: Option<String>,
    /// Where in the store, when not the default: the Redis key prefix (idempotent), the
    /// SQL table (idempotent_records) or the ZooKeeper root (/idempotent); also given as
    /// the URL's `?at=` parameter.
    #[arg(long, global = true, value_name = "PREFIX|TABLE|ROOT")]
    at: Option<String>,
    /// JSON instead of tables: one object per line for `list`, one object otherwise.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// One record: state, attempts, lease and ttl left, fingerprint, cached result size.
    Inspect {
        /// The handler's namespace (its function name unless `namespace = "..."`).
        namespace: String,
        /// The key's id: what the key template rendered, after the namespace.
        id: String,
    },
    /// Records, read a page at a time (SCAN on Redis, keyset pages in SQL, the root's
    /// buckets in turn on ZooKeeper), so a store with millions of them is not loaded
    /// whole.
    List {
        /// Only this namespace.
        #[arg(long)]
        namespace: Option<String>,
        /// Only records in this state.
        #[arg(long)]
        state: Option<State>,
        /// At most this many records.
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Make a FAILED or stuck key processable again: its record is deleted, attempts
    /// and all. A DONE key, or one another consumer holds (a live lease), is refused
    /// unless `--force`. Bulk: `release --namespace N --state failed`.
    Release {
        /// The key's namespace (one key; leave out for a bulk release).
        #[arg(requires = "id", conflicts_with_all = ["bulk_namespace", "state"])]
        namespace: Option<String>,
        /// The key's id.
        id: Option<String>,
        /// Bulk: release every record of this namespace in `--state`.
        #[arg(long = "namespace", value_name = "NAMESPACE", requires = "state")]
        bulk_namespace: Option<String>,
        /// Bulk: the state of the records to release.
        #[arg(long, requires = "bulk_namespace")]
        state: Option<State>,
        /// Release even a DONE key (it will be processed again) or one another
        /// consumer holds (it may then run twice at once).
        #[arg(long)]
        force: bool,
        /// Bulk: show what would be released, release nothing.
        #[arg(long)]
        dry_run: bool,
        /// Bulk: do not ask for confirmation.
        #[arg(long, short)]
        yes: bool,
    },
    /// Drop expired records now (Redis and ZooKeeper expire records by themselves).
    Purge,
    /// Counts of records by namespace and state.
    Stats {
        /// Only this namespace.
        #[arg(long)]
        namespace: Option<String>,
    },
}

/// A record's state, as the command line spells it.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum State {
    InProgress,
    Released,
    Done,
    Failed,
}

impl From<State> for admin::State {
    fn from(state: State) -> admin::State {
        match state {
            State::InProgress => admin::State::InProgress,
            State::Released => admin::State::Released,
            State::Done => admin::State::Done,
            State::Failed => admin::State::Failed,
        }
    }
}

/// How a command ended, as an exit code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Exit {
    Done = 0,
    NotFound = 1,
    Usage = 2,
    Store = 3,
    Refused = 4,
    NotConfirmed = 5,
}

/// A command that could not finish: what to print, and the exit code.
struct Failure(Exit, String);

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => return fail(Failure(Exit::Store, format!("cannot start: {error}"))),
    };
    match runtime.block_on(run(cli)) {
        Ok(exit) => ExitCode::from(exit as u8),
        Err(failure) => fail(failure),
    }
}

fn fail(Failure(exit, message): Failure) -> ExitCode {
    eprintln!("idempotent: {message}");
    ExitCode::from(exit as u8)
}

async fn run(cli: Cli) -> Result<Exit, Failure> {
    let Some(url) = cli.store.as_deref() else {
        return Err(Failure(
            Exit::Usage,
            "no store: pass --store URL or set IDEMPOTENT_STORE (redis://, postgres://, \
             mysql://, zk://, ...)"
                .to_owned(),
        ));
    };
    let store = connect::connect(url, cli.at.as_deref()).await?;
    let out = output::Output::new(cli.json);
    match cli.command {
        Command::Inspect { namespace, id } => {
            let key = key(&namespace, &id)?;
            match timed(store.inspect(&key)).await? {
                Some(record) => {
                    out.record(&record);
                    Ok(Exit::Done)
                }
                None => {
                    out.missing(&key);
                    Ok(Exit::NotFound)
                }
            }
        }
        Command::List { namespace, state, limit } => {
            let filter = Filter { namespace, state: state.map(Into::into) };
            list(&*store, &filter, limit, &out).await
        }
        Command::Release { namespace: Some(namespace), id: Some(id), force, .. } => {
            let key = key(&namespace, &id)?;
            let released = timed(store.release_key(&key, force)).await?;
            out.released_one(&key, &released);
            Ok(match released {
                Released::Released => Exit::Done,
                Released::NotFound => Exit::NotFound,
                Released::Refused(_) => Exit::Refused,
            })
        }
        Command::Release {
            bulk_namespace: Some(namespace),
            state: Some(state),
            force,
            dry_run,
            yes,
            ..
        } => {
            let filter = Filter { namespace: Some(namespace), state: Some(state.into()) };
            release_all(&*store, &filter, force, dry_run, yes, &out).await
        }
        Command::Release { .. } => Err(Failure(
            Exit::Usage,
            "release what? `release NAMESPACE ID` for one key, or \
             `release --namespace NAMESPACE --state failed` for every failed key of a namespace"
                .to_owned(),
        )),
        Command::Purge => {
            let purged = timed(store.purge()).await?;
            out.purged(purged);
            Ok(Exit::Done)
        }
        Command::Stats { namespace } => {
            let filter = Filter { namespace, state: None };
            let counts = timed(store.stats(&filter)).await?;
            out.stats(&counts);
            Ok(Exit::Done)
        }
    }
}

fn key(namespace: &str, id: &str) -> Result<Key, Failure> {
    Key::new(namespace, id).map_err(|error| Failure(Exit::Usage, format!("not a key: {error}")))
}

/// How long one store operation may take: a release can wait for a row lock an
/// open transaction holds, and a command must not hang on it.
const OPERATION_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// A store operation, as a command's failure when it fails or takes too long.
async fn timed<T>(
    operation: impl std::future::Future<Output = Result<T, idempotent_runtime::StoreError>>,
) -> Result<T, Failure> {
    match tokio::time::timeout(OPERATION_TIMEOUT, operation).await {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(error)) => Err(Failure(Exit::Store, format!("the store failed: {error}"))),
        Err(_) => Err(Failure(
            Exit::Store,
            format!(
                "the store did not answer within {OPERATION_TIMEOUT:?}; nothing more was sent \
                 (an operation still waiting on the server, such as a release waiting for a \
                 row lock, may yet apply)"
            ),
        )),
    }
}

/// Prints up to `limit` records, a page at a time.
async fn list(
    store: &dyn Admin,
    filter: &Filter,
    limit: usize,
    out: &output::Output,
) -> Result<Exit, Failure> {
    let mut table = out.records();
    let mut cursor: Option<String> = None;
    let mut left = limit;
    while left > 0 {
        let page = timed(store.list(filter, cursor.as_deref(), left.min(PAGE))).await?;
        for record in page.records.iter().take(left) {
            table.push(record);
        }
        left = left.saturating_sub(page.records.len());
        match page.next {
            Some(next) => cursor = Some(next),
            None => break,
        }
    }
    table.finish();
    Ok(Exit::Done)
}

/// Records read per round trip.
const PAGE: usize = 500;

/// Releases every record `filter` selects, after a confirmation.
async fn release_all(
    store: &dyn Admin,
    filter: &Filter,
    force: bool,
    dry_run: bool,
    yes: bool,
    out: &output::Output,
) -> Result<Exit, Failure> {
    // The keys first, then the releases: deleting while paging through the same keys
    // could skip some.
    // A set: a Redis SCAN may return a key twice, and a second release could meet a
    // claim made after the first.
    let mut keys = std::collections::BTreeSet::new();
    let mut cursor: Option<String> = None;
    loop {
        let page = timed(store.list(filter, cursor.as_deref(), PAGE)).await?;
        keys.extend(page.records.into_iter().map(|record| record.key));
        match page.next {
            Some(next) => cursor = Some(next),
            None => break,
        }
    }
    let keys: Vec<Vec<u8>> = keys.into_iter().collect();
    if dry_run || keys.is_empty() {
        out.would_release(&keys);
        return Ok(Exit::Done);
    }
    if !yes {
        let ask = format!("release {} record(s)? [y/N] ", keys.len());
        if !confirmed(&ask) {
            return Err(Failure(
                Exit::NotConfirmed,
                "nothing released (pass --yes to release without asking, --dry-run to see which)"
                    .to_owned(),
            ));
        }
    }
    // Each only if still in the state it was listed in: a stuck claim may have
    // finished since, and `--force` must not then delete its DONE record.
    let mut summary = output::Summary::default();
    for stored in &keys {
        match timed(store.release_record(stored, filter.state, force)).await {
            Ok(released) => summary.add(stored, released),
            Err(failure) => {
                // What was released so far, before the error.
                out.released_many(&summary);
                return Err(failure);
            }
        }
    }
    out.released_many(&summary);
    Ok(if summary.refused.is_empty() { Exit::Done } else { Exit::Refused })
}

/// Asks on the terminal; without one (a script), the answer is no.
fn confirmed(question: &str) -> bool {
    if !std::io::stdin().is_terminal() {
        return false;
    }
    eprint!("{question}");
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    if std::io::stdin().lock().read_line(&mut answer).is_err() {
        return false;
    }
    matches!(answer.trim(), "y" | "Y" | "yes")
}
