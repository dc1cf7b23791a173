//! `RedisStore`: records in Redis or Redis Cluster. A claim is one `SET NX GET` (and the
//! claim script when it finds another claim in progress or released), the other
//! transitions one atomic script each.

use std::sync::atomic::{AtomicBool, Ordering};
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
local s, t, held, a, fp, result = string.match(r, '^(%u)(%S+) (%d+) (%d+) (%S+) (.*)$')
local deadline
if not s then
  s, a, deadline, t, fp, result = string.match(r, '^(%u) (%d+) (%d+) (%S+) (%S+) (.*)$')
  if not s then return redis.error_reply('IDEMPOTENT_UNREADABLE record written by another program or a newer version') end
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
pub const RELEASE_SCRIPT: &str = r"
local r = redis.call('GET', KEYS[1])
if not r or string.sub(r, 1, 33) ~= 'P' .. ARGV[1] then return 0 end
local a, fp = string.match(r, '^%d+ (%d+) (%S+) ', 35)
a = tonumber(a)
if ARGV[2] == '1' and a > 0 then a = a - 1 end
redis.call('SET', KEYS[1], 'R- 0 ' .. a .. ' ' .. fp .. ' ', 'KEEPTTL')
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
///   without restarting the consumer.
///
/// Clones share the connection.
#[derive(Clone)]
pub struct RedisStore {
    connection: Connection,
    prefix: Arc<str>,
    /// Set once the server refused `SET ... NX ... GET` (before Redis 7.0): claims
    /// then go to the claim script.
    claim_by_script: Arc<AtomicBool>,
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
        RedisStore::with_connection(Connection::Standalone(manager))
    }

    /// Uses a Cluster connection configured by the caller.
    pub fn from_cluster_connection(connection: ClusterConnection) -> RedisStore {
        RedisStore::with_connection(Connection::Cluster(connection))
    }

    fn with_connection(connection: Connection) -> RedisStore {
        RedisStore {
            connection,
            prefix: DEFAULT_PREFIX.into(),
            claim_by_script: Arc::new(AtomicBool::new(false)),
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

    /// A claim: `SET NX GET`, and the claim script for what that can't settle.
    async fn claim_with(&self, key: &Key, claim: &Claiming) -> Result<Claim, StoreError> {
        if !self.claim_by_script.load(Ordering::Relaxed) {
            let mut set = redis::cmd("SET");
            set.arg(self.redis_key(key))
                .arg(claim.fresh_record())
                .arg("NX")
                .arg("PX")
                .arg(claim.retention)
                .arg("GET");
            let reply: Result<Option<Vec<u8>>, RedisError> = match &self.connection {
                Connection::Standalone(c) => set.query_async(&mut c.clone()).await,
                Connection::Cluster(c) => set.query_async(&mut c.clone()).await,
            };
            match reply {
                Ok(None) => return Ok(Claim::Won { token: claim.token, attempt: 1 }),
                Ok(Some(record)) => {
                    if let Some(answer) = claim.settle(&record) {
                        return Ok(answer);
                    }
                }
                Err(error) if refuses_set_nx_get(&error) => {
                    tracing::info!(%error, "Redis before 7.0: claims go through the claim script");
                    self.claim_by_script.store(true, Ordering::Relaxed);
                }
                Err(error) => return Err(unavailable(error)),
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
            "W" => Ok(Claim::Won { token: claim.token, attempt: attempts }),
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
    fn give_back_in_background(&self, key: &Key, token: Token) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let (store, key) = (self.clone(), key.clone());
        runtime.spawn(async move {
            let token = token.to_string();
            let args: [&[u8]; 2] = [token.as_bytes(), b"1"];
            if let Err(error) = store.transition(&SCRIPTS.release, &key, &args).await {
                tracing::warn!(key = %key.logged(), %error, "giving back a claim whose reply was lost failed; its lease will run out");
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
        let mut fields = rest.splitn(5, |&b| b == b' ');
        let (token, held, attempts, fingerprint, result) =
            (fields.next()?, fields.next()?, fields.next()?, fields.next()?, fields.next()?);
        let digits = |f: &[u8]| !f.is_empty() && f.iter().all(u8::is_ascii_digit);
        if token.is_empty() || !digits(held) || !digits(attempts) || fingerprint.is_empty() {
            return None;
        }
        let attempts: u32 = std::str::from_utf8(attempts).ok()?.parse().ok()?;
        if state == b'P' && token == self.token_text.as_bytes() {
            return Some(Claim::Won { token: self.token, attempt: attempts });
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
        if let Err(error) = &answer {
            // The claim may have been written and its reply lost: give such a claim
            // back, and its attempt with it, since no handler ran under it. (A no-op
            // when it was not written: the release is fenced by the token.)
            if !error.is_permanent() {
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
            Some(Claim::Won { token: claim.token, attempt: 4 })
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
            format!("D{OTHER} 60000 +1 - "),
            format!("D{OTHER} x 1 - "),
            "D".to_owned(),
            String::new(),
        ];
        for record in records {
            assert_eq!(claim.settle(record.as_bytes()), None, "{record:?}");
        }
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
