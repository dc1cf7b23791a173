//! `RedisStore`: records in Redis or Redis Cluster, one atomic script per transition.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{IntoConnectionInfo, RedisError, Script};

use crate::{Claim, Fingerprint, Key, Store, StoreError, Token, Transition};

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

// A record is one string: "<state> <attempts> <lease deadline ms> <token> <fingerprint>
// <result>": state P (in progress), R (released), D (done) or F (failed); deadline 0
// and token "-" when not in progress; fingerprint 64 hex digits or "-"; the cached
// result, possibly empty, is everything after the fifth space. Deadlines use the
// server's TIME, so consumers' clocks need not agree. A string lets a claim on a
// fresh key be a single `SET NX PX`. Needs Redis 6.0 or newer (`SET ... KEEPTTL`).

/// The claim script. KEYS: the record. ARGV: token, lease ms, retention ms,
/// fingerprint (or `-`). Returns `{state, attempts}` with state `W` (won), `P` (in
/// progress), `F` (failed) or `M` (fingerprint mismatch), or `{'D', attempts,
/// result}` (done; result empty when none was cached). A record in progress under the
/// caller's own token is a win: the same claim sent again (a Cluster client resends
/// after a redirect or a lost connection) answers as the first did.
pub const CLAIM_SCRIPT: &str = r"
local now = redis.call('TIME')
now = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local deadline = string.format('%.0f', now + tonumber(ARGV[2]))
local fp = ARGV[4]
if redis.call('SET', KEYS[1], 'P 1 ' .. deadline .. ' ' .. ARGV[1] .. ' ' .. fp .. ' ', 'PX', ARGV[3], 'NX') then
  return {'W', 1}
end
local s, a, l, t, held, result = string.match(redis.call('GET', KEYS[1]) or '', '^(%u) (%d+) (%d+) (%S+) (%S+) (.*)$')
if not s then return redis.error_reply('IDEMPOTENT_UNREADABLE record written by another program or another version') end
a = tonumber(a)
if s == 'P' and t == ARGV[1] then return {'W', a} end
if held ~= '-' and fp ~= '-' and held ~= fp then return {'M', a} end
if s == 'D' then return {'D', a, result} end
if s == 'F' then return {'F', a} end
if s == 'P' and tonumber(l) > now then return {'P', a} end
a = a + 1
if held == '-' then held = fp end
local keep = math.max(tonumber(ARGV[3]), redis.call('PTTL', KEYS[1]))
redis.call('SET', KEYS[1], 'P ' .. a .. ' ' .. deadline .. ' ' .. ARGV[1] .. ' ' .. held .. ' ', 'PX', keep)
return {'W', a}
";

/// The complete and fail script. ARGV: token, final state (`D` or `F`), ttl ms,
/// result (empty for none). Returns 1 if applied, 0 if the lease was lost. The
/// finished record keeps the finishing token, so the same call sent again answers 1.
pub const FINISH_SCRIPT: &str = r"
local s, a, t, fp = string.match(redis.call('GET', KEYS[1]) or '', '^(%u) (%d+) %d+ (%S+) (%S+) ')
if s == ARGV[2] and t == ARGV[1] then return 1 end
if s ~= 'P' or t ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2] .. ' ' .. a .. ' 0 ' .. t .. ' ' .. fp .. ' ' .. ARGV[4], 'PX', ARGV[3])
return 1
";

/// The release script. ARGV: token, and `1` to also take back the claim's attempt
/// (for a claim whose reply was lost: its handler never ran). Returns 1 if applied, 0
/// if the lease was lost. Keeps the attempt count, the fingerprint and the expiry.
pub const RELEASE_SCRIPT: &str = r"
local s, a, t, fp = string.match(redis.call('GET', KEYS[1]) or '', '^(%u) (%d+) %d+ (%S+) (%S+) ')
if s ~= 'P' or t ~= ARGV[1] then return 0 end
a = tonumber(a)
if ARGV[2] == '1' and a > 0 then a = a - 1 end
redis.call('SET', KEYS[1], 'R ' .. a .. ' 0 - ' .. fp .. ' ', 'KEEPTTL')
return 1
";

/// The renew script. ARGV: token, lease ms, retention ms (the record is kept at least
/// that long from now). Returns 1 if applied, 0 if the lease was lost.
pub const RENEW_SCRIPT: &str = r"
local s, a, t, fp = string.match(redis.call('GET', KEYS[1]) or '', '^(%u) (%d+) %d+ (%S+) (%S+) ')
if s ~= 'P' or t ~= ARGV[1] then return 0 end
local now = redis.call('TIME')
now = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local lease = tonumber(ARGV[2])
local deadline = string.format('%.0f', now + lease)
redis.call('SET', KEYS[1], 'P ' .. a .. ' ' .. deadline .. ' ' .. t .. ' ' .. fp .. ' ', 'KEEPTTL')
local keep = tonumber(ARGV[3])
if redis.call('PTTL', KEYS[1]) < keep then redis.call('PEXPIRE', KEYS[1], keep) end
return 1
";

/// The scripts, hashed once; run with EVALSHA, loaded on NOSCRIPT.
struct Scripts {
    claim: Script,
    finish: Script,
    release: Script,
    renew: Script,
}

static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    claim: Script::new(CLAIM_SCRIPT),
    finish: Script::new(FINISH_SCRIPT),
    release: Script::new(RELEASE_SCRIPT),
    renew: Script::new(RENEW_SCRIPT),
});

/// Records in Redis (standalone or Cluster), built on the `redis` crate's
/// auto-reconnecting connections.
///
/// * Each transition (claim, complete, release, fail, renew) is one Lua script run
///   with `EVALSHA` (loaded on `NOSCRIPT`): one round trip, atomic on the server.
/// * A record is one string at `{prefix}:{namespace}:{id}` holding state, attempt
///   count, lease deadline and claim token, so it lives whole in one Cluster hash slot,
///   and a claim on a fresh key is a single `SET NX PX` inside the script. Redis 6.0
///   or newer.
///   Ids are binary-safe; ids over [`MAX_RAW_ID_LEN`] bytes are stored under their
///   SHA-256.
/// * An in-progress record's lease deadline is kept in the record, measured on the
///   server's clock; the record itself is kept for
///   [`claim_retention`](crate::claim_retention) from its claim, so the attempt count
///   survives a consumer that died mid-handler. DONE and FAILED
///   records are kept for `ttl`.
/// * The connection reconnects by itself: while Redis is down, calls fail with a
///   store error (the handler does not run) and succeed again once it is back,
///   without restarting the consumer.
///
/// Clones share the connection.
#[derive(Clone)]
pub struct RedisStore {
    connection: Connection,
    prefix: Arc<str>,
}

#[derive(Clone)]
enum Connection {
    Standalone(ConnectionManager),
    Cluster(ClusterConnection),
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
    /// Connects to a standalone Redis (`redis://host:port/db`, or `rediss://` with the
    /// `redis-tls` feature), with [`DEFAULT_RESPONSE_TIMEOUT`] and
    /// [`DEFAULT_CONNECTION_TIMEOUT`].
    pub async fn connect(url: impl IntoConnectionInfo) -> Result<RedisStore, StoreError> {
        let client = redis::Client::open(url).map_err(unavailable)?;
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(DEFAULT_RESPONSE_TIMEOUT))
            .set_connection_timeout(Some(DEFAULT_CONNECTION_TIMEOUT));
        let manager =
            ConnectionManager::new_with_config(client, config).await.map_err(unavailable)?;
        Ok(RedisStore::from_connection_manager(manager))
    }

    /// Connects to a Redis Cluster through any of its nodes.
    pub async fn cluster<I>(nodes: I) -> Result<RedisStore, StoreError>
    where
        I: IntoIterator,
        I::Item: IntoConnectionInfo,
    {
        let client = redis::cluster::ClusterClientBuilder::new(nodes)
            .response_timeout(DEFAULT_RESPONSE_TIMEOUT)
            .connection_timeout(DEFAULT_CONNECTION_TIMEOUT)
            .build()
            .map_err(unavailable)?;
        let connection = client.get_async_connection().await.map_err(unavailable)?;
        Ok(RedisStore::from_cluster_connection(connection))
    }

    /// Uses a connection manager configured by the caller.
    pub fn from_connection_manager(manager: ConnectionManager) -> RedisStore {
        RedisStore { connection: Connection::Standalone(manager), prefix: DEFAULT_PREFIX.into() }
    }

    /// Uses a Cluster connection configured by the caller.
    pub fn from_cluster_connection(connection: ClusterConnection) -> RedisStore {
        RedisStore { connection: Connection::Cluster(connection), prefix: DEFAULT_PREFIX.into() }
    }

    /// The standalone connection, to send other commands over it (`None` for a
    /// Cluster store).
    pub fn connection_manager(&self) -> Option<&ConnectionManager> {
        match &self.connection {
            Connection::Standalone(manager) => Some(manager),
            Connection::Cluster(_) => None,
        }
    }

    /// Puts records under `prefix` instead of [`DEFAULT_PREFIX`].
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
        let mut invocation = script.prepare_invoke();
        invocation.key(self.redis_key(key));
        for arg in args {
            invocation.arg(*arg);
        }
        let reply = match &self.connection {
            Connection::Standalone(c) => invocation.invoke_async(&mut c.clone()).await,
            Connection::Cluster(c) => invocation.invoke_async(&mut c.clone()).await,
        };
        reply.map_err(unavailable)
    }

    /// Releases `token`'s claim and takes its attempt back, on the current Tokio
    /// runtime, without waiting.
    fn give_back_in_background(&self, key: &Key, token: Token) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let (store, key) = (self.clone(), key.clone());
        runtime.spawn(async move {
            let token = token.to_string();
            let args: [&[u8]; 2] = [token.as_bytes(), b"1"];
            if let Err(error) = store.transition(&SCRIPTS.release, &key, &args).await {
                tracing::warn!(key = %key, %error, "giving back a claim whose reply was lost failed; its lease will run out");
            }
        });
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

/// A Redis error as a store error. A key of another type under the store's name
/// (`WRONGTYPE`: another program's key) or a record the scripts can't read (written by
/// another program or version) fails the same way every time: [`StoreError::Rejected`],
/// so the message is dead-lettered instead of retried for ever. Anything else (the
/// connection, a timeout, a busy or loading server) is [`StoreError::Unavailable`].
fn unavailable(error: RedisError) -> StoreError {
    match error.code() {
        Some("WRONGTYPE" | "IDEMPOTENT_UNREADABLE") => StoreError::Rejected(Box::new(error)),
        _ => StoreError::unavailable(error),
    }
}

/// Milliseconds for a script argument: at least 1, at most `Spec::MAX_DURATION`
/// (Redis refuses an expiry past what a 64-bit millisecond clock holds).
fn millis(d: Duration) -> Vec<u8> {
    let capped = d.min(crate::execute::Spec::MAX_DURATION);
    capped.as_millis().max(1).to_string().into_bytes()
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
        let token_text = token.to_string();
        let retention = crate::claim_retention(lease, ttl);
        let fingerprint = fingerprint.map_or_else(|| "-".to_owned(), Fingerprint::to_string);
        let args: [&[u8]; 4] =
            [token_text.as_bytes(), &millis(lease), &millis(retention), fingerprint.as_bytes()];
        let reply: Vec<redis::Value> = match self.invoke(&SCRIPTS.claim, key, &args).await {
            Ok(reply) => reply,
            Err(error) => {
                // The script may have run and its reply been lost: give such a claim
                // back, and its attempt with it, since no handler ran under it. (A
                // no-op when it did not run: the release is fenced by the token.)
                if !error.is_permanent() {
                    self.give_back_in_background(key, token);
                }
                return Err(error);
            }
        };
        let field = |i: usize| reply.get(i).cloned().unwrap_or(redis::Value::Nil);
        let parse_error = |e: redis::ParsingError| StoreError::Protocol(e.to_string());
        let state: String = redis::from_redis_value(field(0)).map_err(parse_error)?;
        let attempts: u32 = redis::from_redis_value(field(1)).map_err(parse_error)?;
        match state.as_str() {
            "W" => Ok(Claim::Won { token, attempt: attempts }),
            "D" => {
                let result: Vec<u8> = redis::from_redis_value(field(2)).map_err(parse_error)?;
                Ok(if result.is_empty() { Claim::Done } else { Claim::Cached(result) })
            }
            "P" => Ok(Claim::InProgress),
            "F" => Ok(Claim::Failed { attempts }),
            "M" => Ok(Claim::Mismatch),
            other => Err(StoreError::Protocol(format!("claim script returned state {other:?}"))),
        }
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
        self.transition(&SCRIPTS.finish, key, &args).await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<Transition, StoreError> {
        let token = token.to_string();
        self.transition(&SCRIPTS.release, key, &[token.as_bytes(), b"0"]).await
    }

    async fn fail(&self, key: &Key, token: Token, ttl: Duration) -> Result<Transition, StoreError> {
        let token = token.to_string();
        self.transition(&SCRIPTS.finish, key, &[token.as_bytes(), b"F", &millis(ttl), b""]).await
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
        self.transition(&SCRIPTS.renew, key, &[token.as_bytes(), &millis(lease), &retention]).await
    }

    /// Starts the release on the current Tokio runtime and returns at once; without
    /// a runtime, the lease runs out instead.
    fn abandon(&self, key: &Key, token: Token) {
        crate::store::release_in_background(self, key, token);
    }
}
