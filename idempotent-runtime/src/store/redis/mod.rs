//! `RedisStore`: records in Redis or Redis Cluster. A claim is one `SET NX GET` (and the
//! claim script when it finds another claim in progress or released), the other
//! transitions one atomic script each.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex, RwLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{Cmd, IntoConnectionInfo, RedisError, Script};

use super::{admin, format};
use crate::{Claim, Fingerprint, Key, Store, StoreError, Token, Transition};

mod check;
mod durability;

pub use check::{MIN_VERSION, RECHECK_INTERVAL};

/// The default key prefix: records live at `idempotent:{namespace}:{id}`.
pub const DEFAULT_PREFIX: &str = "idempotent";
/// Ids longer than this many bytes are stored under their SHA-256 instead:
/// `{prefix}:{namespace}:sha256:{64 hex digits}`. So is any id that itself starts with
/// `sha256:`, so a raw id can never take a hashed id's place. The same rule for every
/// store: [`Key::stored`].
pub const MAX_RAW_ID_LEN: usize = crate::key::MAX_STORED_ID_LEN;
/// How long a command may wait for its reply before failing with a store error.
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long connecting (or reconnecting) may take.
pub const DEFAULT_CONNECTION_TIMEOUT: Duration = Duration::from_secs(2);

// A record is one string: "<state><token> <held> <attempts> <fingerprint> <result>":
// state P (in progress), R (released), D (done) or F (failed); token the claim's 32
// hex digits ("-" when released; a finished record keeps the finishing token);
// fingerprint 64 hex digits or "-"; the cached result, possibly empty, is everything
// after the fourth space. <held> is the lease as a figure relative to the key's own
// expiry: an in-progress record's lease is live while the key's PTTL is above it (the
// key is kept `claim_retention` from the claim, `held` = retention - lease). The
// deadline is thus on the server's clock, so consumers' clocks need not agree, and a
// claim on a fresh key is one `SET key record NX PX retention GET`, without a script:
// it writes the record, or answers the record that is there (Redis 7.0; older servers
// refuse the syntax and every claim then runs `CLAIM_SCRIPT`). Only a record that is
// not a plain answer (in progress under another token, released, or of the first
// format) goes on to the claim script, which reads the key's PTTL.
//
// Records of the first format, "<state> <attempts> <lease deadline ms> <token>
// <fingerprint> <result>" (a space in second place, where this format has a token
// digit or "-"), are read by the claim script and replaced at the next claim.

/// The claim script: the whole claim, for a record that the claim's `SET NX GET`
/// could not settle (and for servers before Redis 7.0, for every claim). KEYS: the
/// record. ARGV: token, lease ms, retention ms, fingerprint (or `-`). Returns
/// `{state, attempts}` with state `W` (won), `F` (failed) or `M` (fingerprint
/// mismatch), `{'P', attempts, lease ms left}` (in progress), or `{'D', attempts,
/// result}` (done; result empty when none was cached). A record in progress under the caller's own token is a win: the same
/// claim sent again (a Cluster client resends after a redirect or a lost connection)
/// answers as the first did.
pub const CLAIM_SCRIPT: &str = r"
local r = redis.call('GET', KEYS[1])
local lease = tonumber(ARGV[2])
if not r then
  redis.call('SET', KEYS[1], 'P' .. ARGV[1] .. ' ' .. (tonumber(ARGV[3]) - lease) .. ' 1 ' .. ARGV[4] .. ' ', 'PX', ARGV[3])
  return {'W', 1}
end
if string.byte(r, 1) == 35 then return redis.error_reply('IDEMPOTENT_NEWER #' .. string.sub(string.match(r, '^#(%d*)'), 1, 9)) end
local s, t, held, a, fp, result = string.match(r, '^(%u)(%S+) (%d+) (%d+) (%S+) (.*)$')
local deadline
if not s then
  s, a, deadline, t, fp, result = string.match(r, '^(%u) (%d+) (%d+) (%S+) (%S+) (.*)$')
  if not s then return redis.error_reply('IDEMPOTENT_UNREADABLE record written by another program') end
end
a = tonumber(a)
if s == 'P' and t == ARGV[1] then return {'W', a} end
if fp ~= '-' and ARGV[4] ~= '-' and fp ~= ARGV[4] then return {'M', a} end
if s == 'D' then return {'D', a, result} end
if s == 'F' then return {'F', a} end
local pttl = redis.call('PTTL', KEYS[1])
if s == 'P' then
  if not deadline then
    if pttl > tonumber(held) then return {'P', a, pttl - tonumber(held)} end
  else
    local now = redis.call('TIME')
    local left = tonumber(deadline) - (tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000))
    if left > 0 then return {'P', a, left} end
  end
end
a = a + 1
if fp == '-' then fp = ARGV[4] end
local keep = math.max(tonumber(ARGV[3]), pttl)
redis.call('SET', KEYS[1], 'P' .. ARGV[1] .. ' ' .. (keep - lease) .. ' ' .. a .. ' ' .. fp .. ' ', 'PX', keep)
return {'W', a}
";

/// The complete and fail script. ARGV: token, final state (`D` or `F`), ttl ms,
/// result (empty for none). Returns 1 if applied, 0 if the lease was lost. The
/// finished record keeps the finishing token, so the same call sent again answers 1.
/// It reads no field but the head (state and token): the rest of the record is
/// carried over as it is.
pub const FINISH_SCRIPT: &str = r"
local r = redis.call('GET', KEYS[1])
if not r then return 0 end
local head = string.sub(r, 1, 33)
if head ~= 'P' .. ARGV[1] then return head == ARGV[2] .. ARGV[1] and 1 or 0 end
redis.call('SET', KEYS[1], ARGV[2] .. string.sub(r, 2) .. ARGV[4], 'PX', ARGV[3])
return 1
";

/// The release script. ARGV: token, and `1` to also take back the claim's attempt
/// (for a claim whose reply was lost: its handler never ran). Returns 1 if applied, 0
/// if the lease was lost. Keeps the attempt count, the fingerprint and the expiry.
/// The released record keeps the releasing token, so the same release sent again (a
/// Cluster client resends after a redirect or a lost connection) answers 1.
pub const RELEASE_SCRIPT: &str = r"
local r = redis.call('GET', KEYS[1])
if not r then return 0 end
local head = string.sub(r, 1, 33)
if head == 'R' .. ARGV[1] then return 1 end
if head ~= 'P' .. ARGV[1] then return 0 end
local a, fp = string.match(r, '^%d+ (%d+) (%S+) ', 35)
a = tonumber(a)
if ARGV[2] == '1' and a > 0 then a = a - 1 end
redis.call('SET', KEYS[1], 'R' .. ARGV[1] .. ' 0 ' .. a .. ' ' .. fp .. ' ', 'KEEPTTL')
return 1
";

/// The renew script. ARGV: token, lease ms, retention ms (the record is kept at least
/// that long from now). Returns 1 if applied, 0 if the lease was lost.
pub const RENEW_SCRIPT: &str = r"
local r = redis.call('GET', KEYS[1])
if not r or string.sub(r, 1, 33) ~= 'P' .. ARGV[1] then return 0 end
local keep = math.max(tonumber(ARGV[3]), redis.call('PTTL', KEYS[1]))
local rest = string.find(r, ' ', 35, true)
redis.call('SET', KEYS[1], string.sub(r, 1, 34) .. (keep - tonumber(ARGV[2])) .. string.sub(r, rest), 'PX', keep)
return 1
";

/// [`Admin::inspect`](admin::Admin::inspect)'s script: a record's head (its first 256
/// bytes, which hold every field but the cached result), its length, its PTTL and the
/// server's time in ms (for first-format lease deadlines). Returns an empty array for
/// no key and `{'T'}` for a key that is not a string.
pub const INSPECT_SCRIPT: &str = r"
local t = redis.call('TYPE', KEYS[1])['ok']
if t == 'none' then return {} end
if t ~= 'string' then return {'T'} end
local now = redis.call('TIME')
return {redis.call('GETRANGE', KEYS[1], 0, 255), redis.call('STRLEN', KEYS[1]),
  redis.call('PTTL', KEYS[1]), tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)}
";

/// [`Admin::release_record`](admin::Admin::release_record)'s script: deletes the record unless it is
/// DONE or in progress with a live lease, or whatever it holds when `ARGV[1]` is `1`
/// (force). Returns `{'X'}` (deleted), `{'N'}` (no record), `{'D'}` (done), `{'P', lease
/// ms left}` or `{'U'}` (unreadable). Reads both record formats.
pub const ADMIN_RELEASE_SCRIPT: &str = r"
local r = redis.call('GET', KEYS[1])
if not r then return {'N'} end
local head = string.sub(r, 1, 256)
local s, t, held = string.match(head, '^(%u)(%S+) (%d+) %d+ %S+ ')
local deadline
if not s then
  s, deadline = string.match(head, '^(%u) %d+ (%d+) %S+ %S+ ')
end
if ARGV[2] ~= '' and s ~= ARGV[2] then return {'C', s or ''} end
if ARGV[1] ~= '1' then
  if not s then return {'U'} end
  if s == 'D' then return {'D'} end
  if s == 'P' then
    local left
    if deadline then
      local now = redis.call('TIME')
      left = tonumber(deadline) - (tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000))
    else
      left = redis.call('PTTL', KEYS[1]) - tonumber(held)
    end
    if left > 0 then return {'P', left} end
  end
end
redis.call('DEL', KEYS[1])
return {'X'}
";

/// The scripts, hashed once; run with EVALSHA, loaded on NOSCRIPT.
struct Scripts {
    claim: Script,
    finish: Script,
    release: Script,
    renew: Script,
    inspect: Script,
    admin_release: Script,
}

static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    claim: Script::new(CLAIM_SCRIPT),
    finish: Script::new(FINISH_SCRIPT),
    release: Script::new(RELEASE_SCRIPT),
    renew: Script::new(RENEW_SCRIPT),
    inspect: Script::new(INSPECT_SCRIPT),
    admin_release: Script::new(ADMIN_RELEASE_SCRIPT),
});

/// Records in Redis (standalone or Cluster), built on the `redis` crate's
/// auto-reconnecting connections.
///
/// * A claim is one `SET key record NX PX retention GET`, no script: it takes a fresh
///   key, or answers the record that is there, which settles a duplicate (DONE,
///   FAILED, payload mismatch) in the same round trip. A record in progress under
///   another token, or released, goes on to [`CLAIM_SCRIPT`] (a second round trip),
///   which tells a live lease from a lapsed one and takes the key over. Before Redis
///   7.0 (which refuses `NX` with `GET`) every claim runs the script.
/// * The other transitions (complete, release, fail, renew) are one Lua script each,
///   run with `EVALSHA` (loaded on `NOSCRIPT`): one round trip, atomic on the server.
/// * A record is one string at `{prefix}:{namespace}:{id}` holding state, claim token,
///   lease, attempt count and fingerprint, so it lives whole in one Cluster hash slot.
///   Redis 6.0 or newer. Ids are binary-safe; ids over [`MAX_RAW_ID_LEN`] bytes are
///   stored under their SHA-256.
/// * An in-progress record's lease is measured on the server's clock, against the
///   key's own expiry: the record is kept for
///   [`claim_retention`](crate::claim_retention) from its claim (so the attempt count
///   survives a consumer that died mid-handler) and holds how much of that is left
///   when the lease ends. DONE and FAILED records are kept for `ttl`.
/// * The connection reconnects by itself: while Redis is down, calls fail with a
///   store error (the handler does not run) and succeed again once it is back,
///   without restarting the consumer. A standalone server that answers `READONLY`
///   (a master demoted behind the same address: a switchover behind a virtual IP,
///   a proxy or a moved DNS name) makes the store open a new connection, which
///   reaches the new master.
/// * Connecting checks the server ([`check`](RedisStore::check)): a replica, a
///   server that may evict records, one older than [`MIN_VERSION`] or a user without
///   the permissions the store needs is refused with
///   [`StoreError::Misconfigured`]. A server that turns so at run time (a user's
///   permissions revoked, a command renamed) answers claims with that error, which
///   a consumer retries (never dead-letters), until the server passes the check
///   again; see [`RECHECK_INTERVAL`].
///
/// Clones share the connection.
#[derive(Clone)]
pub struct RedisStore {
    connection: Connection,
    prefix: Arc<str>,
    /// Set once the server refused `SET ... NX ... GET` (before Redis 7.0): claims
    /// then go to the claim script.
    claim_by_script: Arc<AtomicBool>,
    tolerance: check::Tolerance,
    refusal: Arc<check::Refusal>,
    durability: Option<durability::Durability>,
}

#[derive(Clone)]
enum Connection {
    Standalone(Standalone),
    Cluster(ClusterConnection),
}

/// A standalone server's connection, which the store replaces when the server it
/// reaches was demoted to a replica.
#[derive(Clone)]
struct Standalone {
    manager: Arc<RwLock<ConnectionManager>>,
    /// How to open a new one: `None` for a connection manager the caller made.
    reopen: Option<Arc<Reopen>>,
}

struct Reopen {
    target: Target,
    /// Through Sentinel: the connection was lost since it was opened, so the server
    /// its manager reconnects to may no longer be the master (an old master restarted
    /// empty, before the Sentinels demote it). No call goes through it until the
    /// Sentinels have named the master again.
    in_doubt: AtomicBool,
    config: ConnectionManagerConfig,
    /// When a new connection was last asked for: at most one a second.
    last: Mutex<Option<Instant>>,
    /// Which request for a new connection is the latest: only its connection is put
    /// in place, so a slow one that ends late can't replace a newer one.
    latest: std::sync::atomic::AtomicU64,
}

/// Where a new connection goes.
enum Target {
    /// The address the store was given.
    Address(redis::Client),
    /// The master the Sentinels name now, once it answers `ROLE` as a master.
    Sentinel(tokio::sync::Mutex<SentinelClient>),
}

impl Target {
    async fn client(&self) -> Result<redis::Client, RedisError> {
        match self {
            Target::Address(client) => Ok(client.clone()),
            Target::Sentinel(sentinel) => sentinel.lock().await.async_get_client().await,
        }
    }

    fn follows_sentinel(&self) -> bool {
        matches!(self, Target::Sentinel(_))
    }
}

impl Reopen {
    async fn open(&self) -> Result<ConnectionManager, RedisError> {
        let client = self.target.client().await?;
        ConnectionManager::new_with_config(client, self.config.clone()).await
    }
}

impl Standalone {
    fn manager(&self) -> ConnectionManager {
        self.manager.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The connection for one call: refused, through Sentinel, while the master is
    /// in doubt (a new connection to the one the Sentinels name is on its way).
    fn connection(&self) -> Result<ConnectionManager, RedisError> {
        if self.reopen.as_ref().is_some_and(|reopen| reopen.in_doubt.load(Ordering::SeqCst)) {
            self.reopen("the connection to the master was lost");
            return Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::NotConnected,
                "the connection to the Redis master was lost; the store is asking the Sentinels which server is the master now",
            )));
        }
        Ok(self.manager())
    }

    /// Notes what a call's `result` says about the connection.
    fn observed<T>(&self, result: Result<T, RedisError>) -> Result<T, RedisError> {
        if let (Err(error), Some(reopen)) = (&result, &self.reopen) {
            if reopen.target.follows_sentinel() && lost(error) {
                reopen.in_doubt.store(true, Ordering::SeqCst);
            }
        }
        result
    }

    async fn query<T: redis::FromRedisValue>(&self, cmd: &Cmd) -> Result<T, RedisError> {
        let result = cmd.query_async(&mut self.connection()?).await;
        self.observed(result)
    }

    async fn invoke<T: redis::FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<T, RedisError> {
        let result = invocation.invoke_async(&mut self.connection()?).await;
        self.observed(result)
    }

    /// What `error` calls for: a new connection after a `READONLY` answer (the server
    /// was demoted), and, through Sentinel, after a lost connection too (the master
    /// may be gone, and the connection manager would only ever retry its address).
    fn after(&self, error: &RedisError, denial: Option<Denied>) {
        let Some(reopen) = &self.reopen else { return };
        let lost = lost(error);
        if denial == Some(Denied::ReadOnly) || (lost && reopen.target.follows_sentinel()) {
            self.reopen(if lost { "the connection to the master was lost" } else { "READONLY" });
        }
    }

    /// Opens a new connection in the background.
    fn reopen(&self, why: &'static str) {
        let Some(reopen) = self.reopen.clone() else { return };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        {
            let mut last = reopen.last.lock().unwrap_or_else(|e| e.into_inner());
            if last.is_some_and(|at| at.elapsed() < Duration::from_secs(1)) {
                return;
            }
            *last = Some(Instant::now());
        }
        let manager = self.manager.clone();
        let request = reopen.latest.fetch_add(1, Ordering::SeqCst) + 1;
        runtime.spawn(async move {
            match reopen.open().await {
                Ok(_) if reopen.latest.load(Ordering::SeqCst) != request => {}
                Ok(fresh) => {
                    *manager.write().unwrap_or_else(|e| e.into_inner()) = fresh;
                    reopen.in_doubt.store(false, Ordering::SeqCst);
                    if reopen.target.follows_sentinel() {
                        tracing::warn!(reason = why, "the store connected to the master the Sentinels name");
                    } else {
                        tracing::warn!(
                            "the Redis server answered READONLY (it was demoted to a replica): the store opened a new connection to its address"
                        );
                    }
                }
                Err(error) => {
                    tracing::warn!(%error, reason = why, "opening a new Redis connection failed; the next failed call tries again");
                }
            }
        });
    }
}

/// Whether `error` says the connection to the server was lost.
fn lost(error: &RedisError) -> bool {
    error.is_io_error()
        || error.is_connection_refusal()
        || error.is_connection_dropped()
        || error.is_timeout()
}

/// How a [`RedisStore`] connects, and what it accepts of its server beyond the
/// requirements [`RedisStore::check`] enforces.
///
/// ```no_run
/// # async fn run() -> Result<(), idempotent_runtime::StoreError> {
/// use idempotent_runtime::redis_store::RedisStore;
///
/// let store = RedisStore::options().prefix("billing").connect("redis://redis.internal/").await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RedisOptions {
    tolerance: check::Tolerance,
    durability: Option<durability::Durability>,
    prefix: String,
    response_timeout: Duration,
    connection_timeout: Duration,
    master_credentials: Option<(String, String)>,
}

impl std::fmt::Debug for RedisOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the master's password: options end up in logs.
        let master_user = self.master_credentials.as_ref().map(|(user, _)| user.as_str());
        f.debug_struct("RedisOptions")
            .field("tolerance", &self.tolerance)
            .field("durability", &self.durability)
            .field("prefix", &self.prefix)
            .field("response_timeout", &self.response_timeout)
            .field("connection_timeout", &self.connection_timeout)
            .field("master_user", &master_user)
            .finish()
    }
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            tolerance: check::Tolerance::default(),
            durability: None,
            prefix: DEFAULT_PREFIX.to_owned(),
            response_timeout: DEFAULT_RESPONSE_TIMEOUT,
            connection_timeout: DEFAULT_CONNECTION_TIMEOUT,
            master_credentials: None,
        }
    }
}

impl RedisOptions {
    /// Connects to a server whose `maxmemory-policy` is not `noeviction`, which
    /// [`check`](RedisStore::check) otherwise refuses. The cost: under memory
    /// pressure Redis evicts records (any policy but `noeviction` evicts keys with an
    /// expiry, and every record has one), and the duplicate of a message whose DONE
    /// record was evicted runs its handler again; an in-progress record evicted
    /// mid-handler lets a redelivery run beside it and resets the attempt count, so
    /// `max_attempts` no longer bounds the runs. Measured in the README ("Running
    /// Redis for idempotency"). Only for handlers whose effects are idempotent
    /// themselves, or guarded in the business data.
    pub fn allow_eviction(mut self) -> Self {
        self.tolerance.eviction = true;
        self
    }

    /// Answers a claim as won, and DONE or FAILED as recorded, only once the write
    /// reached `replicas` replicas (Redis `WAIT`), waiting up to `timeout`; a write
    /// that did not is a store error (the handler does not run, or DONE is tried
    /// again, fenced by its token, within half the lease). Without it, a failover to
    /// an asynchronous replica loses the writes the old master acknowledged last,
    /// and duplicates of those messages run again. The cost: a round trip to the
    /// replicas on every claim, renewal and DONE (measured in the README, "Running
    /// Redis for idempotency"). A renewal that did not reach them is not counted, so a
    /// handler whose replicas stop answering is stopped when its lease runs out. `WAIT` counts the writes of the connection it is sent on;
    /// should the connection drop between a write and its `WAIT`, the wait covers
    /// the new connection only.
    pub fn wait_for_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        let local_fsync = self.durability.is_some_and(|d| d.local_fsync);
        self.durability = Some(durability::Durability { replicas, local_fsync, timeout });
        self
    }

    /// Also waits until the master wrote the record to its own append-only file
    /// (`WAITAOF`, Redis 7.2, `appendonly yes`; checked at connect), up to `timeout`:
    /// with `appendfsync everysec` a crash of the master otherwise loses up to a
    /// second of records.
    pub fn wait_for_local_fsync(mut self, timeout: Duration) -> Self {
        let replicas = self.durability.map_or(0, |d| d.replicas);
        self.durability = Some(durability::Durability { replicas, local_fsync: true, timeout });
        self
    }

    /// Puts records under `prefix` instead of [`DEFAULT_PREFIX`] (and checks that the
    /// user may write there).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How long a command may wait for its reply ([`DEFAULT_RESPONSE_TIMEOUT`]).
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// The user and password the store logs in with on the master it finds through
    /// [`sentinel`](RedisOptions::sentinel) (`"default"` for the default user); the
    /// Sentinels' own credentials go in their URLs.
    pub fn master_credentials(
        mut self,
        username: impl Into<String>,
        password: impl Into<String>,
    ) -> Self {
        self.master_credentials = Some((username.into(), password.into()));
        self
    }

    /// How long connecting may take ([`DEFAULT_CONNECTION_TIMEOUT`]).
    pub fn connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = timeout;
        self
    }

    /// Connects to a standalone Redis (`redis://host:port/db`, or `rediss://` with the
    /// `redis-tls` feature) and [checks](RedisStore::check) it.
    ///
    /// With `redis-tls`, connecting installs ring as rustls' process-wide crypto
    /// provider unless the application installed one: the `redis` crate's TLS takes
    /// the process default, which rustls cannot pick by itself when another dependency
    /// compiles in its aws-lc-rs provider too.
    pub async fn connect(self, url: impl IntoConnectionInfo) -> Result<RedisStore, StoreError> {
        #[cfg(feature = "redis-tls")]
        ensure_crypto_provider();
        let client = redis::Client::open(url).map_err(unavailable)?;
        self.connect_client(client).await
    }

    /// [`connect`](RedisOptions::connect) over TLS with the certificates given; see
    /// [`RedisStore::connect_with_tls`].
    #[cfg(feature = "redis-tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis-tls")))]
    pub async fn connect_with_tls(
        self,
        url: impl IntoConnectionInfo,
        certificates: redis::TlsCertificates,
    ) -> Result<RedisStore, StoreError> {
        ensure_crypto_provider();
        let client = redis::Client::build_with_tls(url, certificates).map_err(unavailable)?;
        self.connect_client(client).await
    }

    async fn connect_client(self, client: redis::Client) -> Result<RedisStore, StoreError> {
        self.connect_target(Target::Address(client)).await
    }

    /// Connects through Redis Sentinel to the master it names `service_name`, and
    /// [checks](RedisStore::check) it. `sentinels` are the Sentinels' URLs
    /// (`redis://[user:password@]host:26379`, with the Sentinels' own credentials);
    /// the master's come from [`master_credentials`](RedisOptions::master_credentials).
    ///
    /// The store follows failovers: when the connection to the master is lost, or
    /// the server answers `READONLY` (a master demoted), it asks the Sentinels again
    /// (at most once a second) and connects to the master they name once that server
    /// answers `ROLE` as a master. Meanwhile calls fail with a store error, so no
    /// handler runs and the consumer retries. A failover to an asynchronous replica
    /// still loses the records it had not received: pair Sentinel with
    /// [`wait_for_replicas`](RedisOptions::wait_for_replicas) (measured in the README,
    /// "Running Redis for idempotency").
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), idempotent_runtime::StoreError> {
    /// use std::time::Duration;
    /// use idempotent_runtime::redis_store::RedisStore;
    ///
    /// let sentinels = ["redis://sentinel-1:26379", "redis://sentinel-2:26379", "redis://sentinel-3:26379"];
    /// let store = RedisStore::options()
    ///     .master_credentials("orders", "secret")
    ///     .wait_for_replicas(1, Duration::from_millis(500))
    ///     .sentinel(sentinels, "orders-master")
    ///     .await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn sentinel<I>(
        self,
        sentinels: I,
        service_name: impl Into<String>,
    ) -> Result<RedisStore, StoreError>
    where
        I: IntoIterator,
        I::Item: IntoConnectionInfo,
    {
        #[cfg(feature = "redis-tls")]
        ensure_crypto_provider();
        let sentinels = sentinels.into_iter().collect::<Vec<_>>();
        if sentinels.is_empty() {
            return Err(StoreError::Misconfigured(
                "no Sentinel address was given: pass the URLs of the Sentinels that monitor the master".to_owned(),
            ));
        }
        let mut master = redis::RedisConnectionInfo::default();
        if let Some((username, password)) = &self.master_credentials {
            master = master.set_username(username).set_password(password);
        }
        let node = SentinelNodeConnectionInfo::default().set_redis_connection_info(master);
        let client = SentinelClient::build(
            sentinels,
            service_name.into(),
            Some(node),
            SentinelServerType::Master,
        )
        .map_err(unavailable)?;
        self.connect_target(Target::Sentinel(tokio::sync::Mutex::new(client))).await
    }

    async fn connect_target(self, target: Target) -> Result<RedisStore, StoreError> {
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(self.response_timeout))
            .set_connection_timeout(Some(self.connection_timeout));
        let reopen = Reopen {
            target,
            in_doubt: AtomicBool::new(false),
            config,
            last: Mutex::new(None),
            latest: Default::default(),
        };
        let manager = reopen.open().await.map_err(unavailable)?;
        let connection = Connection::Standalone(Standalone {
            manager: Arc::new(RwLock::new(manager)),
            reopen: Some(Arc::new(reopen)),
        });
        self.checked(connection).await
    }

    /// Connects to a Redis Cluster through any of its nodes and
    /// [checks](RedisStore::check) every master.
    pub async fn cluster<I>(self, nodes: I) -> Result<RedisStore, StoreError>
    where
        I: IntoIterator,
        I::Item: IntoConnectionInfo,
    {
        #[cfg(feature = "redis-tls")]
        ensure_crypto_provider();
        let client = redis::cluster::ClusterClientBuilder::new(nodes)
            .response_timeout(self.response_timeout)
            .connection_timeout(self.connection_timeout)
            .build()
            .map_err(unavailable)?;
        let connection = client.get_async_connection().await.map_err(unavailable)?;
        self.checked(Connection::Cluster(connection)).await
    }

    async fn checked(self, connection: Connection) -> Result<RedisStore, StoreError> {
        let store = RedisStore {
            connection,
            prefix: self.prefix.into(),
            claim_by_script: Arc::new(AtomicBool::new(false)),
            tolerance: self.tolerance,
            refusal: Arc::default(),
            durability: self.durability,
        };
        store.check().await?;
        Ok(store)
    }
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.connection {
            Connection::Standalone(_) => "standalone",
            Connection::Cluster(_) => "cluster",
        };
        f.debug_struct("RedisStore").field("kind", &kind).field("prefix", &self.prefix).finish()
    }
}

impl RedisStore {
    /// How to connect, and what to accept of the server: see [`RedisOptions`].
    pub fn options() -> RedisOptions {
        RedisOptions::default()
    }

    /// Connects to a standalone Redis (`redis://host:port/db`, or `rediss://` with the
    /// `redis-tls` feature), with [`DEFAULT_RESPONSE_TIMEOUT`] and
    /// [`DEFAULT_CONNECTION_TIMEOUT`], and [checks](RedisStore::check) the server.
    ///
    /// With `redis-tls`, connecting installs ring as rustls' process-wide crypto
    /// provider unless the application installed one: the `redis` crate's TLS takes
    /// the process default, which rustls cannot pick by itself when another dependency
    /// compiles in its aws-lc-rs provider too.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] when the server can't be reached;
    /// [`StoreError::Misconfigured`] when it can't keep the store's promise.
    pub async fn connect(url: impl IntoConnectionInfo) -> Result<RedisStore, StoreError> {
        RedisOptions::default().connect(url).await
    }

    /// Connects to a standalone Redis over TLS (`rediss://host:port/db`) with the
    /// certificates given instead of the platform's: `root_cert` for a server whose
    /// certificate a private CA signed (only that CA is trusted then), `client_tls` for
    /// a server that asks for client certificates. The server's certificate is still
    /// verified, against its host name or IP address. Same timeouts, check and rustls
    /// crypto provider as [`connect`](RedisStore::connect).
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), idempotent_runtime::StoreError> {
    /// use idempotent_runtime::redis_store::RedisStore;
    ///
    /// let ca = std::fs::read("/etc/redis/tls/ca.crt").expect("the CA certificate (PEM)");
    /// let certificates = redis::TlsCertificates { client_tls: None, root_cert: Some(ca) };
    /// let store =
    ///     RedisStore::connect_with_tls("rediss://:password@redis.internal:6380", certificates)
    ///         .await?;
    /// # Ok(())
    /// # }
    /// ```
    #[cfg(feature = "redis-tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis-tls")))]
    pub async fn connect_with_tls(
        url: impl IntoConnectionInfo,
        certificates: redis::TlsCertificates,
    ) -> Result<RedisStore, StoreError> {
        RedisOptions::default().connect_with_tls(url, certificates).await
    }

    /// Connects to a Redis Cluster through any of its nodes, and
    /// [checks](RedisStore::check) every master.
    pub async fn cluster<I>(nodes: I) -> Result<RedisStore, StoreError>
    where
        I: IntoIterator,
        I::Item: IntoConnectionInfo,
    {
        RedisOptions::default().cluster(nodes).await
    }

    /// Uses a connection manager configured by the caller. Nothing is checked: call
    /// [`check`](RedisStore::check). A `READONLY` answer can't open a new connection
    /// (the store does not know how the manager was made): the calls fail until the
    /// manager reaches a master again.
    pub fn from_connection_manager(manager: ConnectionManager) -> RedisStore {
        RedisStore::with_connection(Connection::Standalone(Standalone {
            manager: Arc::new(RwLock::new(manager)),
            reopen: None,
        }))
    }

    /// Uses a Cluster connection configured by the caller. Nothing is checked: call
    /// [`check`](RedisStore::check).
    pub fn from_cluster_connection(connection: ClusterConnection) -> RedisStore {
        RedisStore::with_connection(Connection::Cluster(connection))
    }

    fn with_connection(connection: Connection) -> RedisStore {
        RedisStore {
            connection,
            prefix: DEFAULT_PREFIX.into(),
            claim_by_script: Arc::new(AtomicBool::new(false)),
            tolerance: check::Tolerance::default(),
            refusal: Arc::default(),
            durability: None,
        }
    }

    /// Sends every claim through [`CLAIM_SCRIPT`], as on a server before Redis 7.0
    /// (where this is found out by itself at the first claim).
    #[doc(hidden)]
    pub fn with_claims_by_script(mut self) -> RedisStore {
        self.claim_by_script = Arc::new(AtomicBool::new(true));
        self
    }

    /// The standalone connection, to send other commands over it (`None` for a
    /// Cluster store).
    pub fn connection_manager(&self) -> Option<ConnectionManager> {
        match &self.connection {
            Connection::Standalone(standalone) => Some(standalone.manager()),
            Connection::Cluster(_) => None,
        }
    }

    /// Runs `cmd` (standalone, or routed by its key on a Cluster).
    async fn query<T: redis::FromRedisValue>(&self, cmd: &Cmd) -> Result<T, RedisError> {
        match &self.connection {
            Connection::Standalone(c) => c.query(cmd).await,
            Connection::Cluster(c) => cmd.query_async(&mut c.clone()).await,
        }
    }

    /// Runs `cmd` on the standalone server, or on the Cluster master serving `node`.
    async fn query_on<T: redis::FromRedisValue>(
        &self,
        node: Option<u16>,
        cmd: &Cmd,
    ) -> Result<T, RedisError> {
        match (&self.connection, node) {
            (Connection::Cluster(c), Some(node)) => {
                use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
                let route = SingleNodeRoutingInfo::SpecificNode(Route::new(node, SlotAddr::Master));
                let value =
                    c.clone().route_command(cmd.clone(), RoutingInfo::SingleNode(route)).await?;
                Ok(redis::from_redis_value(value)?)
            }
            _ => self.query(cmd).await,
        }
    }

    /// A failed command's error as a store error, after what it calls for: a new
    /// connection for `READONLY`, claims refused for a misconfiguration.
    ///
    /// Only a command the user may not run, or the server does not know, stops the
    /// claims: the next claim could win and run its handler without a way to record
    /// DONE. A key outside the user's patterns fails that key's calls only (its claim
    /// is refused too, so no handler runs).
    fn failed(&self, error: RedisError) -> StoreError {
        let denial = denied(&error);
        if let Connection::Standalone(standalone) = &self.connection {
            standalone.after(&error, denial);
        }
        let error = unavailable(error);
        if let (Some(Denied::Command), StoreError::Misconfigured(reason)) = (denial, &error) {
            self.refusal.begin(reason);
        }
        error
    }

    /// Puts records under `prefix` instead of [`DEFAULT_PREFIX`]. The check made at
    /// connect probed the prefix it was given: prefer
    /// [`RedisOptions::prefix`], or call [`check`](RedisStore::check) again.
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> RedisStore {
        self.prefix = prefix.into().into();
        self
    }

    /// The Redis key a record lives at.
    ///
    /// ```
    /// use idempotent_runtime::{Key, redis_store::RedisStore};
    ///
    /// let key = Key::new("payments", "order:42").unwrap();
    /// assert_eq!(RedisStore::redis_key_with("idempotent", &key), b"idempotent:payments:order:42");
    /// ```
    pub fn redis_key(&self, key: &Key) -> Vec<u8> {
        RedisStore::redis_key_with(&self.prefix, key)
    }

    /// [`redis_key`](RedisStore::redis_key) for a given prefix.
    pub fn redis_key_with(prefix: &str, key: &Key) -> Vec<u8> {
        let stored = key.stored();
        let mut out = Vec::with_capacity(prefix.len() + 1 + stored.len());
        out.extend_from_slice(prefix.as_bytes());
        out.push(b':');
        out.extend_from_slice(&stored);
        out
    }

    async fn invoke<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        key: &Key,
        args: &[&[u8]],
    ) -> Result<T, StoreError> {
        self.invoke_at(script, &self.redis_key(key), args).await
    }

    /// [`invoke`](RedisStore::invoke) on a Redis key as it is.
    async fn invoke_at<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        redis_key: &[u8],
        args: &[&[u8]],
    ) -> Result<T, StoreError> {
        let mut invocation = script.prepare_invoke();
        invocation.key(redis_key);
        for arg in args {
            invocation.arg(*arg);
        }
        let reply = match &self.connection {
            Connection::Standalone(c) => c.invoke(&invocation).await,
            Connection::Cluster(c) => invocation.invoke_async(&mut c.clone()).await,
        };
        reply.map_err(|error| self.failed(error))
    }

    /// A claim: `SET NX GET`, and the claim script for what that can't settle.
    async fn claim_with(&self, key: &Key, claim: &Claiming) -> Result<Claim, StoreError> {
        self.claims_allowed().await?;
        if !self.claim_by_script.load(Ordering::Relaxed) {
            let mut set = redis::cmd("SET");
            set.arg(self.redis_key(key))
                .arg(claim.fresh_record())
                .arg("NX")
                .arg("PX")
                .arg(claim.retention)
                .arg("GET");
            let reply: Result<Option<Vec<u8>>, RedisError> = self.query(&set).await;
            match reply {
                Ok(None) => return Ok(Claim::Won { token: claim.token, attempt: 1, fence: None }),
                Ok(Some(record)) => {
                    if let Some(answer) = claim.settle(&record) {
                        return Ok(answer);
                    }
                }
                Err(error) if refuses_set_nx_get(&error) => {
                    tracing::info!(%error, "Redis before 7.0: claims go through the claim script");
                    self.claim_by_script.store(true, Ordering::Relaxed);
                }
                Err(error) => return Err(self.failed(error)),
            }
        }
        let (lease, retention) = (claim.lease.to_string(), claim.retention.to_string());
        let args: [&[u8]; 4] = [
            claim.token_text.as_bytes(),
            lease.as_bytes(),
            retention.as_bytes(),
            claim.fingerprint.as_bytes(),
        ];
        let reply: Vec<redis::Value> = self.invoke(&SCRIPTS.claim, key, &args).await?;
        let field = |i: usize| reply.get(i).cloned().unwrap_or(redis::Value::Nil);
        let parse_error = |e: redis::ParsingError| StoreError::Protocol(e.to_string());
        let state: String = redis::from_redis_value(field(0)).map_err(parse_error)?;
        let attempts: u32 = redis::from_redis_value(field(1)).map_err(parse_error)?;
        match state.as_str() {
            "W" => Ok(Claim::Won { token: claim.token, attempt: attempts, fence: None }),
            "D" => {
                let result: Vec<u8> = redis::from_redis_value(field(2)).map_err(parse_error)?;
                Ok(if result.is_empty() { Claim::Done } else { Claim::Cached(result) })
            }
            "P" => {
                let left: Option<u64> = redis::from_redis_value(field(2)).map_err(parse_error)?;
                Ok(Claim::InProgress { lease_left: left.map(Duration::from_millis) })
            }
            "F" => Ok(Claim::Failed { attempts }),
            "M" => Ok(Claim::Mismatch),
            other => Err(StoreError::Protocol(format!("claim script returned state {other:?}"))),
        }
    }

    /// Releases `token`'s claim and takes its attempt back, on the current Tokio
    /// runtime, without waiting.
    fn give_back_in_background(
        &self,
        key: &Key,
        token: Token,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        let (store, key) = (self.clone(), key.clone());
        Some(runtime.spawn(async move {
            let token = token.to_string();
            let args: [&[u8]; 2] = [token.as_bytes(), b"1"];
            if let Err(error) = store.transition(&SCRIPTS.release, &key, &args).await {
                tracing::warn!(key = %key.logged(), %error, "giving back a claim whose reply was lost failed; its lease will run out");
            }
        }))
    }

    /// [`transition`](RedisStore::transition), answered as applied only once it is as
    /// durable as asked: for DONE and FAILED, which a lost write would undo, and for
    /// renewals, since a renewal lost at a failover leaves the promoted master's lease
    /// shorter than the one its consumer goes on by (a takeover would run beside it).
    async fn durable_transition(
        &self,
        script: &Script,
        key: &Key,
        args: &[&[u8]],
    ) -> Result<Transition, StoreError> {
        let applied = self.transition(script, key, args).await?;
        if applied == Transition::Applied {
            self.made_durable(&self.redis_key(key)).await?;
        }
        Ok(applied)
    }

    async fn transition(
        &self,
        script: &Script,
        key: &Key,
        args: &[&[u8]],
    ) -> Result<Transition, StoreError> {
        match self.invoke::<i64>(script, key, args).await? {
            1 => Ok(Transition::Applied),
            0 => Ok(Transition::LeaseLost),
            other => Err(StoreError::Protocol(format!("transition script returned {other}"))),
        }
    }
}

/// Makes sure rustls has a process-wide crypto provider, which the `redis` crate's TLS
/// connections take. rustls picks one by itself only when exactly one of its providers
/// is compiled in; a build that also has aws-lc-rs (through another dependency) would
/// panic at the first `rediss://` connection. Installs ring's when none is installed,
/// and leaves one the application installed alone.
#[cfg(feature = "redis-tls")]
fn ensure_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Fails only when another thread installed one meanwhile, which serves as well.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// A Redis error as a store error. A key of another type under the store's name
/// (`WRONGTYPE`: another program's key) or a record the scripts can't read (written by
/// another program) fails the same way every time: [`StoreError::Rejected`], so the
/// message is dead-lettered instead of retried for ever. A record of a later format is
/// [`StoreError::NewerFormat`], retried. A refusal that is the server's setup, not the
/// message's (`NOPERM`: the user's ACL; a command unknown, disabled or renamed) is
/// [`StoreError::Misconfigured`], retried. Anything else (the connection, a timeout, a
/// busy or loading server, `READONLY` from a demoted master, `OOM` under `noeviction`)
/// is [`StoreError::Unavailable`].
fn unavailable(error: RedisError) -> StoreError {
    let detail = || error.detail().unwrap_or_default().to_owned();
    match denied(&error) {
        Some(Denied::Command) => {
            return StoreError::Misconfigured(format!(
                "the Redis user may not run a command the store needs, or the server does not know it ({} {}): grant the user +info, +@scripting, +@read and +@write (the scripts run GET, SET, DEL, PTTL, TIME, TYPE, GETRANGE and STRLEN)",
                error.code().unwrap_or_default(),
                detail()
            ));
        }
        Some(Denied::Key) => {
            return StoreError::Misconfigured(format!(
                "the Redis user may not access a key under the store's prefix ({} {}): grant the user the prefix's key pattern",
                error.code().unwrap_or_default(),
                detail()
            ));
        }
        Some(Denied::ReadOnly) | None => {}
    }
    match error.code() {
        Some("WRONGTYPE" | "IDEMPOTENT_UNREADABLE") => StoreError::Rejected(Box::new(error)),
        // A record of a later format (`format`): its head follows the code.
        Some("IDEMPOTENT_NEWER") => StoreError::NewerFormat(
            format::newer(error.detail().unwrap_or("#").as_bytes())
                .unwrap_or_else(|| "a record format of a later version".to_owned()),
        ),
        _ => StoreError::unavailable(error),
    }
}

/// A refusal that is the server's setup, not the message's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Denied {
    /// A command the user may not run, or the server does not know (disabled or
    /// renamed): every call needing it fails the same way.
    Command,
    /// A key outside the user's key patterns: calls on such keys fail, others may
    /// not.
    Key,
    /// A write to a replica (a master demoted behind the same address).
    ReadOnly,
}

/// Whether `error` is a refusal of the server's setup, wherever it says so: as the
/// reply's code (`NOPERM`, `READONLY`), or inside a script's error, which Redis 7
/// answers as `ERR The user executing the script can't run this command` (or `can't
/// access at least one of the keys`) and `ERR Unknown Redis command called from
/// script`, and Redis 6 as `ERR Error running script ... -NOPERM` or `-READONLY`.
fn denied(error: &RedisError) -> Option<Denied> {
    let detail = error.detail().unwrap_or_default();
    let key = || detail.contains("access one of the keys") || detail.contains("access a key");
    match error.code() {
        Some("NOPERM") if key() => Some(Denied::Key),
        Some("NOPERM") => Some(Denied::Command),
        Some("READONLY") => Some(Denied::ReadOnly),
        Some("ERR") => {
            if detail.starts_with("unknown command")
                || detail.contains("Unknown Redis command called from script")
                || detail.contains("can't run this command")
            {
                Some(Denied::Command)
            } else if detail.contains("can't access at least one of the keys") {
                Some(Denied::Key)
            } else if detail.contains("-READONLY") {
                Some(Denied::ReadOnly)
            } else if detail.contains("-NOPERM") {
                Some(if key() { Denied::Key } else { Denied::Command })
            } else {
                None
            }
        }
        _ => None,
    }
}

/// Milliseconds for a script argument: at least 1, at most `Spec::MAX_DURATION`
/// (Redis refuses an expiry past what a 64-bit millisecond clock holds).
fn millis(d: Duration) -> Vec<u8> {
    millis_u64(d).to_string().into_bytes()
}

/// [`millis`] as a number.
fn millis_u64(d: Duration) -> u64 {
    let capped = d.min(crate::execute::Spec::MAX_DURATION);
    // 100 years of milliseconds fit a u64 many times over.
    capped.as_millis().max(1) as u64
}

/// Whether `error` is a server's refusal of `SET ... NX ... GET`, which Redis accepts
/// from 7.0 on.
fn refuses_set_nx_get(error: &RedisError) -> bool {
    error.code() == Some("ERR") && error.detail().is_some_and(|d| d.contains("syntax error"))
}

/// One claim's arguments.
struct Claiming {
    token: Token,
    token_text: String,
    lease: u64,
    retention: u64,
    fingerprint: String,
}

impl Claiming {
    /// The record a claim on a fresh key writes: attempt 1, kept for the retention,
    /// its lease live while the key has more than `retention - lease` left.
    fn fresh_record(&self) -> Vec<u8> {
        let held = self.retention.saturating_sub(self.lease).to_string();
        let mut record = Vec::with_capacity(40 + held.len() + self.fingerprint.len());
        record.push(b'P');
        record.extend_from_slice(self.token_text.as_bytes());
        record.push(b' ');
        record.extend_from_slice(held.as_bytes());
        record.extend_from_slice(b" 1 ");
        record.extend_from_slice(self.fingerprint.as_bytes());
        record.push(b' ');
        record
    }

    /// The answer to this claim from the record its `SET NX GET` found, when the
    /// record alone settles it (the same answers the claim script gives): DONE,
    /// FAILED, a payload mismatch, or this claim's own record (the command was sent
    /// twice). `None` for the rest: a record in progress under another token (live or
    /// lapsed: the key's expiry tells, which the script reads), released, of the first
    /// format, or unreadable.
    fn settle(&self, record: &[u8]) -> Option<Claim> {
        let (&state, rest) = record.split_first()?;
        if !matches!(state, b'P' | b'R' | b'D' | b'F') {
            // Another program's value, or a later format's (`#`): the script says which.
            return None;
        }
        let mut fields = rest.splitn(5, |&b| b == b' ');
        let (token, held, attempts, fingerprint, result) =
            (fields.next()?, fields.next()?, fields.next()?, fields.next()?, fields.next()?);
        let digits = |f: &[u8]| !f.is_empty() && f.iter().all(u8::is_ascii_digit);
        if token.is_empty() || !digits(held) || !digits(attempts) || fingerprint.is_empty() {
            return None;
        }
        let attempts: u32 = std::str::from_utf8(attempts).ok()?.parse().ok()?;
        if state == b'P' && token == self.token_text.as_bytes() {
            return Some(Claim::Won { token: self.token, attempt: attempts, fence: None });
        }
        let mine = self.fingerprint.as_bytes();
        if fingerprint != b"-" && mine != b"-" && fingerprint != mine {
            return Some(Claim::Mismatch);
        }
        match state {
            b'D' if result.is_empty() => Some(Claim::Done),
            b'D' => Some(Claim::Cached(result.to_vec())),
            b'F' => Some(Claim::Failed { attempts }),
            _ => None,
        }
    }
}

#[async_trait]
impl Store for RedisStore {
    async fn claim(
        &self,
        key: &Key,
        lease: Duration,
        ttl: Duration,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Claim, StoreError> {
        let token = Token::random();
        let claim = Claiming {
            token,
            token_text: token.to_string(),
            lease: millis_u64(lease),
            retention: millis_u64(crate::claim_retention(lease, ttl)),
            fingerprint: fingerprint.map_or_else(|| "-".to_owned(), Fingerprint::to_string),
        };
        let answer = self.claim_with(key, &claim).await;
        if let Ok(Claim::Won { .. }) = &answer {
            if let Err(error) = self.made_durable(&self.redis_key(key)).await {
                // The claim was written and the connection answers: give it back
                // before answering, so a retry right after finds the key free
                // instead of in progress until the lease runs out. (Spawned, so a
                // caller that stops waiting still gives it back; bounded, so a
                // master that stops answering does not hold the caller.)
                if let Some(giving_back) = self.give_back_in_background(key, token) {
                    let _ = tokio::time::timeout(GIVE_BACK_WAIT, giving_back).await;
                }
                return Err(error);
            }
        }
        if let Err(error) = &answer {
            // The claim may have been written and its reply lost: give such a claim
            // back, and its attempt with it, since no handler ran under it. (A no-op
            // when it was not written: the release is fenced by the token.)
            // (A refusal, or a misconfiguration, wrote nothing.)
            if !error.is_permanent() && !matches!(error, StoreError::Misconfigured(_)) {
                self.give_back_in_background(key, token);
            }
        }
        answer
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        ttl: Duration,
        result: Option<&[u8]>,
    ) -> Result<Transition, StoreError> {
        let token = token.to_string();
        let args = [token.as_bytes(), b"D", &millis(ttl), result.unwrap_or_default()];
        self.durable_transition(&SCRIPTS.finish, key, &args).await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<Transition, StoreError> {
        let token = token.to_string();
        self.transition(&SCRIPTS.release, key, &[token.as_bytes(), b"0"]).await
    }

    async fn fail(&self, key: &Key, token: Token, ttl: Duration) -> Result<Transition, StoreError> {
        let token = token.to_string();
        self.durable_transition(&SCRIPTS.finish, key, &[token.as_bytes(), b"F", &millis(ttl), b""])
            .await
    }

    async fn renew(
        &self,
        key: &Key,
        token: Token,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Transition, StoreError> {
        let token = token.to_string();
        let retention = millis(crate::claim_retention(lease, ttl));
        let args: [&[u8]; 3] = [token.as_bytes(), &millis(lease), &retention];
        self.durable_transition(&SCRIPTS.renew, key, &args).await
    }

    /// Starts the release on the current Tokio runtime and returns at once; without
    /// a runtime, the lease runs out instead.
    fn abandon(&self, key: &Key, token: Token) {
        crate::store::release_in_background(self, key, token);
    }
}

/// How long a claim refused for want of durability waits for its give-back.
const GIVE_BACK_WAIT: Duration = Duration::from_secs(1);

/// How many SCAN calls' worth of slots (their `COUNT`s added up) one page of
/// [`Admin::list`](admin::Admin::list) looks at, at most, before it returns what it
/// found: a filter that few records pass does not make one call read the whole store.
const LIST_SCAN_BUDGET: usize = 10_000;

/// How many records one page reads at once.
const LIST_READS_IN_FLIGHT: usize = 64;

/// Where a listing stands: the node being scanned (standalone: 0; Cluster: the lowest
/// slot its master serves), its SCAN cursor, and keys a SCAN returned beyond the page.
/// `node` is `None` once every node has been scanned.
#[derive(Debug, Clone, PartialEq)]
struct ListCursor {
    node: Option<u16>,
    scan: u64,
    pending: std::collections::VecDeque<Vec<u8>>,
}

impl ListCursor {
    /// `{node}:{scan cursor}:{pending keys in hex, comma-separated}`, `-` for no node.
    fn encode(&self) -> String {
        let node = self.node.map_or_else(|| "-".to_owned(), |n| n.to_string());
        let pending: Vec<String> = self.pending.iter().map(|k| admin::hex(k)).collect();
        format!("{node}:{}:{}", self.scan, pending.join(","))
    }

    fn decode(text: &str) -> Result<ListCursor, StoreError> {
        let bad = || StoreError::Protocol(format!("`{text}` is not a cursor `list` gave"));
        let mut parts = text.splitn(3, ':');
        let (node, scan, pending) = (
            parts.next().ok_or_else(bad)?,
            parts.next().ok_or_else(bad)?,
            parts.next().ok_or_else(bad)?,
        );
        let node = match node {
            "-" => None,
            n => Some(n.parse().map_err(|_| bad())?),
        };
        let scan = scan.parse().map_err(|_| bad())?;
        let pending = pending
            .split(',')
            .filter(|k| !k.is_empty())
            .map(admin::unhex)
            .collect::<Result<_, _>>()?;
        Ok(ListCursor { node, scan, pending })
    }
}

/// A glob pattern matching `text` literally.
fn glob_escape(text: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for &b in text {
        if matches!(b, b'*' | b'?' | b'[' | b']' | b'\\') {
            out.push(b'\\');
        }
        out.push(b);
    }
    out
}

/// A record from what [`INSPECT_SCRIPT`] read: `stored` is the Redis key without the
/// prefix, `head` the record's first bytes, `len` its length, `pttl` the key's and
/// `now` the server's time in ms. `None` for a record in neither format.
fn read_record(
    stored: &[u8],
    head: &[u8],
    len: usize,
    pttl: i64,
    now: i64,
) -> Option<admin::Record> {
    let (&letter, rest) = head.split_first()?;
    let state = admin::State::from_letter(letter)?;
    let digits = |f: &[u8]| !f.is_empty() && f.len() <= 20 && f.iter().all(u8::is_ascii_digit);
    let number = |f: &[u8]| -> Option<i64> { std::str::from_utf8(f).ok()?.parse().ok() };
    let (attempts, fingerprint, lease_left, offset);
    if rest.first() == Some(&b' ') {
        // The first format: "<state> <attempts> <lease deadline ms> <token> <fingerprint> <result>".
        let mut fields = rest[1..].splitn(5, |&b| b == b' ');
        let (a, deadline, token, fp) =
            (fields.next()?, fields.next()?, fields.next()?, fields.next()?);
        fields.next()?;
        if !digits(a) || !digits(deadline) || token.is_empty() || fp.is_empty() {
            return None;
        }
        attempts = a;
        fingerprint = fp;
        lease_left = number(deadline)? - now;
        offset = 2 + a.len() + deadline.len() + token.len() + fp.len() + 4;
    } else {
        // "<state><token> <held> <attempts> <fingerprint> <result>".
        let mut fields = rest.splitn(5, |&b| b == b' ');
        let (token, held, a, fp) = (fields.next()?, fields.next()?, fields.next()?, fields.next()?);
        fields.next()?;
        if token.is_empty() || !digits(held) || !digits(a) || fp.is_empty() {
            return None;
        }
        attempts = a;
        fingerprint = fp;
        lease_left = pttl - number(held)?;
        offset = 1 + token.len() + held.len() + a.len() + fp.len() + 4;
    }
    let (namespace, id) = admin::Record::split(stored);
    let millis = |ms: i64| Duration::from_millis(u64::try_from(ms).unwrap_or(0));
    Some(admin::Record {
        key: stored.to_vec(),
        namespace,
        id,
        state,
        attempts: std::str::from_utf8(attempts).ok()?.parse().ok()?,
        lease_left: (state == admin::State::InProgress && lease_left > 0)
            .then(|| millis(lease_left)),
        ttl_left: (pttl >= 0).then(|| millis(pttl)),
        fingerprint: (fingerprint != b"-")
            .then(|| String::from_utf8_lossy(fingerprint).into_owned()),
        result_len: (state == admin::State::Done && len > offset).then(|| len - offset),
    })
}

/// What [`INSPECT_SCRIPT`] found at a key.
enum Found {
    Nothing,
    Record(admin::Record),
    /// A key of another type, or a string in no record format.
    Foreign(&'static str),
    /// A record of a later format (`format`), named.
    Newer(String),
}

impl RedisStore {
    /// Reads the record at `redis_key` (which starts with the prefix and `:`).
    async fn read_at(&self, redis_key: &[u8]) -> Result<Found, StoreError> {
        let reply: Vec<redis::Value> = self.invoke_at(&SCRIPTS.inspect, redis_key, &[]).await?;
        let parse_error = |e: redis::ParsingError| StoreError::Protocol(e.to_string());
        let field = |i: usize| reply.get(i).cloned().unwrap_or(redis::Value::Nil);
        match reply.len() {
            0 => return Ok(Found::Nothing),
            1 => return Ok(Found::Foreign("a key of another type than string")),
            _ => {}
        }
        let head: Vec<u8> = redis::from_redis_value(field(0)).map_err(parse_error)?;
        let len: usize = redis::from_redis_value(field(1)).map_err(parse_error)?;
        let pttl: i64 = redis::from_redis_value(field(2)).map_err(parse_error)?;
        let now: i64 = redis::from_redis_value(field(3)).map_err(parse_error)?;
        if pttl == -2 {
            return Ok(Found::Nothing);
        }
        let stored = redis_key.get(self.prefix.len() + 1..).unwrap_or_default();
        if let Some(what) = format::newer(&head) {
            return Ok(Found::Newer(what));
        }
        Ok(match read_record(stored, &head, len, pttl, now) {
            Some(record) => Found::Record(record),
            None => Found::Foreign("a string in no record format this version reads"),
        })
    }

    /// The nodes a listing scans, in order: `[0]` for standalone Redis; for a Cluster,
    /// each master as the lowest slot it serves.
    async fn list_nodes(&self) -> Result<Vec<u16>, StoreError> {
        let Connection::Cluster(c) = &self.connection else { return Ok(vec![0]) };
        let slots: Vec<redis::Value> = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut c.clone())
            .await
            .map_err(unavailable)?;
        let mut lowest = std::collections::BTreeMap::<Vec<u8>, u16>::new();
        for range in slots {
            let protocol = |what: &str| StoreError::Protocol(format!("CLUSTER SLOTS: {what}"));
            // [start, end, master, replicas...]: as many fields as the range has replicas.
            let range: Vec<redis::Value> =
                redis::from_redis_value(range).map_err(|e| protocol(&e.to_string()))?;
            let (Some(start), Some(master)) = (range.first(), range.get(2)) else {
                return Err(protocol("a slot range without a master"));
            };
            let start: u16 =
                redis::from_redis_value(start.clone()).map_err(|e| protocol(&e.to_string()))?;
            let master: Vec<redis::Value> =
                redis::from_redis_value(master.clone()).map_err(|e| protocol(&e.to_string()))?;
            // The master's node id (third field) names it; its address would do too.
            let id = master
                .get(2)
                .or_else(|| master.get(1))
                .cloned()
                .map(redis::from_redis_value::<Vec<u8>>)
                .transpose()
                .map_err(|e| protocol(&e.to_string()))?
                .unwrap_or_default();
            let slot = lowest.entry(id).or_insert(start);
            *slot = (*slot).min(start);
        }
        let mut nodes: Vec<u16> = lowest.into_values().collect();
        nodes.sort_unstable();
        Ok(nodes)
    }

    /// One SCAN call on `node`.
    async fn scan(
        &self,
        node: u16,
        cursor: u64,
        pattern: &[u8],
        count: usize,
    ) -> Result<(u64, Vec<Vec<u8>>), StoreError> {
        let mut scan = redis::cmd("SCAN");
        scan.arg(cursor).arg("MATCH").arg(pattern).arg("COUNT").arg(count);
        let reply: redis::Value = self.query_on(Some(node), &scan).await.map_err(unavailable)?;
        let (next, keys): (String, Vec<Vec<u8>>) =
            redis::from_redis_value(reply).map_err(|e| StoreError::Protocol(e.to_string()))?;
        let next =
            next.parse().map_err(|_| StoreError::Protocol(format!("SCAN cursor {next:?}")))?;
        Ok((next, keys))
    }
}

/// Lists with SCAN (every master of a Cluster, one after the other), reading each key
/// with [`INSPECT_SCRIPT`]; keys under the prefix that hold no record are skipped.
/// `purge` answers 0: Redis expires records by itself. `stats` scans every record.
/// SCAN may return a key twice while Redis resizes its table, so a listing taken
/// meanwhile can show a record twice and `stats` count it twice; none present
/// throughout the scan is missed.
#[async_trait]
impl admin::Admin for RedisStore {
    async fn inspect(&self, key: &Key) -> Result<Option<admin::Record>, StoreError> {
        match self.read_at(&self.redis_key(key)).await? {
            Found::Nothing => Ok(None),
            Found::Record(record) => Ok(Some(record)),
            Found::Newer(what) => Err(StoreError::NewerFormat(what)),
            Found::Foreign(what) => Err(StoreError::Rejected(
                format!("{key}: {what} (written by another program or version)").into(),
            )),
        }
    }

    async fn list(
        &self,
        filter: &admin::Filter,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<admin::Page, StoreError> {
        use futures_util::stream::{self, StreamExt, TryStreamExt};

        let nodes = self.list_nodes().await?;
        let mut at = match cursor {
            Some(text) => ListCursor::decode(text)?,
            None => {
                ListCursor { node: nodes.first().copied(), scan: 0, pending: Default::default() }
            }
        };
        let mut pattern = glob_escape(self.prefix.as_bytes());
        pattern.push(b':');
        if let Some(namespace) = &filter.namespace {
            pattern.extend(glob_escape(namespace.as_bytes()));
            pattern.push(b':');
        }
        pattern.push(b'*');
        let limit = limit.max(1);
        let mut records = Vec::new();
        let mut budget = LIST_SCAN_BUDGET;
        loop {
            while records.len() < limit && !at.pending.is_empty() {
                let take = (limit - records.len()).min(at.pending.len());
                let batch: Vec<Vec<u8>> = at.pending.drain(..take).collect();
                // Owned keys: a borrowing closure trips the `Send` check of the future.
                let found: Vec<Found> = stream::iter(batch)
                    .map(|key| async move { self.read_at(&key).await })
                    .buffered(LIST_READS_IN_FLIGHT)
                    .try_collect()
                    .await?;
                records.extend(found.into_iter().filter_map(|found| match found {
                    Found::Record(record) if record.matches(filter) => Some(record),
                    _ => None,
                }));
            }
            let Some(node) = at.node else { break };
            if records.len() >= limit || budget == 0 {
                break;
            }
            let count = (limit - records.len()).max(10).min(budget);
            budget -= count;
            let (next, keys) = self.scan(node, at.scan, &pattern, count).await?;
            at.pending.extend(keys);
            at.scan = next;
            if next == 0 {
                at.node = nodes.iter().copied().find(|&n| n > node);
            }
        }
        let next = (at.node.is_some() || !at.pending.is_empty()).then(|| at.encode());
        Ok(admin::Page { records, next })
    }

    fn record_key(&self, key: &Key) -> Vec<u8> {
        key.stored().into_owned()
    }

    async fn release_record(
        &self,
        record_key: &[u8],
        expected: Option<admin::State>,
        force: bool,
    ) -> Result<admin::Released, StoreError> {
        let force: &[u8] = if force { b"1" } else { b"0" };
        let expected_letter = expected.map(admin::State::letter);
        let expected_arg: &[u8] = expected_letter.as_ref().map_or(b"", std::slice::from_ref);
        let mut redis_key = Vec::with_capacity(self.prefix.len() + 1 + record_key.len());
        redis_key.extend_from_slice(self.prefix.as_bytes());
        redis_key.push(b':');
        redis_key.extend_from_slice(record_key);
        let reply: Vec<redis::Value> =
            self.invoke_at(&SCRIPTS.admin_release, &redis_key, &[force, expected_arg]).await?;
        let parse_error = |e: redis::ParsingError| StoreError::Protocol(e.to_string());
        let field = |i: usize| reply.get(i).cloned().unwrap_or(redis::Value::Nil);
        let answer: String = redis::from_redis_value(field(0)).map_err(parse_error)?;
        Ok(match answer.as_str() {
            "X" => admin::Released::Released,
            "N" => admin::Released::NotFound,
            "D" => admin::Released::Refused(
                admin::refusal(admin::State::Done, None).unwrap_or_default(),
            ),
            "P" => {
                let left: u64 = redis::from_redis_value(field(1)).map_err(parse_error)?;
                let left = Some(Duration::from_millis(left));
                admin::Released::Refused(
                    admin::refusal(admin::State::InProgress, left).unwrap_or_default(),
                )
            }
            "C" => {
                let now: Vec<u8> = redis::from_redis_value(field(1)).map_err(parse_error)?;
                let now = now.first().copied().and_then(admin::State::from_letter);
                admin::changed(now, expected.unwrap_or(admin::State::InProgress))
            }
            "U" => admin::Released::Refused(
                "not a record this version reads (written by another program or version): pass force to delete it"
                    .to_owned(),
            ),
            other => {
                return Err(StoreError::Protocol(format!("release script returned {other:?}")));
            }
        })
    }

    /// Redis drops expired keys by itself: nothing to do, 0.
    async fn purge(&self) -> Result<u64, StoreError> {
        Ok(0)
    }

    async fn stats(
        &self,
        filter: &admin::Filter,
    ) -> Result<Vec<(String, admin::State, u64)>, StoreError> {
        admin::stats_by_listing(self, filter).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "0123456789abcdef0123456789abcdef";
    const OTHER: &str = "fedcba9876543210fedcba9876543210";

    fn claiming(fingerprint: &str) -> Claiming {
        Claiming {
            token: Token::random(),
            token_text: TOKEN.to_owned(),
            lease: 30_000,
            retention: 90_000,
            fingerprint: fingerprint.to_owned(),
        }
    }

    #[test]
    fn a_fresh_record_holds_the_lease_against_the_retention() {
        let record = claiming("-").fresh_record();
        assert_eq!(record, format!("P{TOKEN} 60000 1 - ").into_bytes());
    }

    #[test]
    fn finished_records_and_own_claims_are_settled_without_the_script() {
        let claim = claiming("-");
        let settle = |record: String| claim.settle(record.as_bytes());
        assert_eq!(settle(format!("D{OTHER} 60000 2 - ")), Some(Claim::Done));
        assert_eq!(
            settle(format!("D{OTHER} 60000 1 - a result, with spaces ")),
            Some(Claim::Cached(b"a result, with spaces ".to_vec()))
        );
        assert_eq!(settle(format!("F{OTHER} 60000 3 - ")), Some(Claim::Failed { attempts: 3 }));
        assert_eq!(
            settle(format!("P{TOKEN} 60000 4 - ")),
            Some(Claim::Won { token: claim.token, attempt: 4, fence: None })
        );
    }

    #[test]
    fn a_different_fingerprint_is_a_mismatch_in_any_state() {
        let (mine, theirs) = ("a".repeat(64), "b".repeat(64));
        let claim = claiming(&mine);
        for state in ['D', 'F', 'P'] {
            let record = format!("{state}{OTHER} 60000 1 {theirs} ");
            assert_eq!(claim.settle(record.as_bytes()), Some(Claim::Mismatch), "{record}");
        }
        let record = format!("R- 0 1 {theirs} ");
        assert_eq!(claim.settle(record.as_bytes()), Some(Claim::Mismatch));
        assert_eq!(claim.settle(format!("D{OTHER} 1 1 {mine} ").as_bytes()), Some(Claim::Done));
        assert_eq!(claim.settle(format!("D{OTHER} 1 1 - ").as_bytes()), Some(Claim::Done));
    }

    #[test]
    fn what_needs_the_servers_clock_or_another_format_goes_to_the_script() {
        let claim = claiming("-");
        let records = [
            format!("P{OTHER} 60000 1 - "), // live or lapsed: the key's PTTL tells
            "R- 0 2 - ".to_owned(),         // released
            format!("D 2 0 {OTHER} - cached"), // the first format
            format!("P 1 1700000000000 {OTHER} - "), // the first format
            "v9|something else".to_owned(), // not a record: the script refuses it
            // A later format, even one whose fields would read as this one's.
            format!("#3 1 2 {} done", "ab".repeat(32)),
            format!("#{OTHER} 60000 1 - "),
            format!("D{OTHER} 60000 +1 - "),
            format!("D{OTHER} x 1 - "),
            "D".to_owned(),
            String::new(),
        ];
        for record in records {
            assert_eq!(claim.settle(record.as_bytes()), None, "{record:?}");
        }
        // Not a mismatch: a later format's fields mean what that version says.
        let later = format!("#3 1 2 {} done", "ab".repeat(32));
        assert_eq!(claiming(&"cd".repeat(32)).settle(later.as_bytes()), None);
    }

    #[test]
    fn admin_reads_both_record_formats() {
        let fp = "ab".repeat(32);
        let record = format!("D{TOKEN} 60000 2 {fp} a result");
        let read = read_record(b"ns:id:1", record.as_bytes(), record.len(), 50_000, 0).unwrap();
        assert_eq!((read.namespace.as_str(), read.id.as_slice()), ("ns", b"id:1".as_slice()));
        assert_eq!((read.state, read.attempts), (admin::State::Done, 2));
        assert_eq!(read.fingerprint, Some(fp));
        assert_eq!(read.result_len, Some(8));
        assert_eq!(read.ttl_left, Some(Duration::from_secs(50)));
        assert_eq!(read.lease_left, None);

        // In progress: live while the PTTL is above `held`.
        let record = format!("P{TOKEN} 60000 1 - ");
        let read = read_record(b"ns:a", record.as_bytes(), record.len(), 61_500, 0).unwrap();
        assert_eq!(read.lease_left, Some(Duration::from_millis(1_500)));
        assert_eq!(read.result_len, None);
        let read = read_record(b"ns:a", record.as_bytes(), record.len(), 59_000, 0).unwrap();
        assert_eq!(read.lease_left, None);
        let read = read_record(b"ns:a", b"R- 0 3 - ", 9, 10_000, 0).unwrap();
        assert_eq!((read.state, read.attempts, read.lease_left), (admin::State::Released, 3, None));

        // The first format: an absolute deadline against the server's time.
        let record = format!("P 4 1000500 {TOKEN} - ");
        let read = read_record(b"ns:a", record.as_bytes(), record.len(), 9_000, 1_000_000).unwrap();
        assert_eq!((read.state, read.attempts), (admin::State::InProgress, 4));
        assert_eq!(read.lease_left, Some(Duration::from_millis(500)));
        let record = format!("D 2 0 {TOKEN} - cached");
        let read = read_record(b"ns:a", record.as_bytes(), record.len(), -1, 0).unwrap();
        assert_eq!((read.result_len, read.ttl_left), (Some(6), None));

        for bad in ["", "D", "v9|something", "X- 0 1 - ", "D- x 1 - ", "D- 0 1 -"] {
            assert_eq!(read_record(b"ns:a", bad.as_bytes(), bad.len(), 1, 0), None, "{bad:?}");
        }
    }

    #[test]
    fn list_cursors_read_back() {
        let cursor = ListCursor {
            node: Some(5461),
            scan: 1234,
            pending: vec![b"idempotent:ns:a".to_vec(), b"idempotent:ns:\xff,:".to_vec()].into(),
        };
        assert_eq!(ListCursor::decode(&cursor.encode()).unwrap(), cursor);
        let done = ListCursor { node: None, scan: 0, pending: Default::default() };
        assert_eq!(ListCursor::decode(&done.encode()).unwrap(), done);
        assert!(ListCursor::decode("1:2").is_err());
        assert!(ListCursor::decode("x:2:").is_err());
        assert_eq!(glob_escape(b"a*b?[c]\\"), b"a\\*b\\?\\[c\\]\\\\".to_vec());
    }

    /// The refusals Redis 7.0 and 6.2 give (copied from real servers), and what each is.
    #[test]
    fn refusals_of_the_servers_setup_are_told_apart() {
        let error = |reply: &str| {
            redis::parse_redis_value(format!("-{reply}\r\n").as_bytes())
                .unwrap()
                .extract_error()
                .unwrap_err()
        };
        let cases = [
            (
                "NOPERM this user has no permissions to run the 'evalsha' command",
                Some(Denied::Command),
            ),
            (
                "NOPERM this user has no permissions to access one of the keys used as arguments",
                Some(Denied::Key),
            ),
            (
                "ERR The user executing the script can't run this command or subcommand script: d3c2, on @user_script:1.",
                Some(Denied::Command),
            ),
            (
                "ERR The user executing the script can't access at least one of the keys mentioned in the command arguments script: b811, on @user_script:1.",
                Some(Denied::Key),
            ),
            (
                "ERR Unknown Redis command called from script script: 7ae0, on @user_script:1.",
                Some(Denied::Command),
            ),
            ("ERR unknown command 'EVALSHA', with args beginning with: ", Some(Denied::Command)),
            ("READONLY You can't write against a read only replica.", Some(Denied::ReadOnly)),
            (
                "ERR Error running script (call to f_9a3c): @user_script:2: @user_script: 2: -READONLY You can't write against a read only replica.",
                Some(Denied::ReadOnly),
            ),
            (
                "ERR Error running script (call to f_9a3c): @user_script:2: @user_script: 2: -NOPERM this user has no permissions to run the 'get' command",
                Some(Denied::Command),
            ),
            ("OOM command not allowed when used memory > 'maxmemory'.", None),
            ("ERR syntax error", None),
            ("BUSY Redis is busy running a script.", None),
        ];
        for (reply, want) in cases {
            assert_eq!(denied(&error(reply)), want, "{reply}");
        }
        assert!(matches!(unavailable(error(cases[0].0)), StoreError::Misconfigured(_)));
        assert!(matches!(unavailable(error(cases[6].0)), StoreError::Unavailable(_)));
    }

    #[test]
    fn only_a_syntax_error_sends_claims_to_the_script() {
        let error = |detail: &str| {
            RedisError::from((
                redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError),
                "An error was signalled by the server",
                detail.to_owned(),
            ))
        };
        assert!(refuses_set_nx_get(&error("syntax error")));
        assert!(!refuses_set_nx_get(&error("OOM command not allowed")));
        let io = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(!refuses_set_nx_get(&io));
    }
}

/// The record format's decoders and encoders, for the fuzz targets (feature
/// `fuzzing`). Not part of the API.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    use super::{Claiming, ListCursor, admin, read_record};
    use crate::{Claim, StoreError, Token};

    /// A claim's arguments: `token`, `lease` and `retention` in ms, `fingerprint` as
    /// 64 hex digits or `-`.
    pub struct Claimer(Claiming);

    impl Claimer {
        /// A claim with these arguments.
        pub fn new(token: u128, lease: u64, retention: u64, fingerprint: &str) -> Claimer {
            let token = Token::from_u128(token);
            Claimer(Claiming {
                token,
                token_text: token.to_string(),
                lease,
                retention,
                fingerprint: fingerprint.to_owned(),
            })
        }

        /// The token.
        pub fn token(&self) -> Token {
            self.0.token
        }

        /// The record this claim writes on a fresh key.
        pub fn fresh_record(&self) -> Vec<u8> {
            self.0.fresh_record()
        }

        /// The answer a record found by the claim's `SET NX GET` settles, if any.
        pub fn settle(&self, record: &[u8]) -> Option<Claim> {
            self.0.settle(record)
        }
    }

    /// A record as the admin reads it: `head` its first bytes, `len` its length.
    pub fn read(
        stored: &[u8],
        head: &[u8],
        len: usize,
        pttl: i64,
        now: i64,
    ) -> Option<admin::Record> {
        read_record(stored, head, len, pttl, now)
    }

    /// A listing cursor read from its text, and written again.
    pub fn list_cursor(text: &str) -> Result<String, StoreError> {
        ListCursor::decode(text).map(|cursor| cursor.encode())
    }

    /// A listing cursor's text.
    pub fn encode_list_cursor(node: Option<u16>, scan: u64, pending: Vec<Vec<u8>>) -> String {
        ListCursor { node, scan, pending: pending.into() }.encode()
    }
}
