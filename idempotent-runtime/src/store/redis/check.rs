//! What a `RedisStore` asks of its server, checked when it connects and whenever
//! [`RedisStore::check`] is called: a master (not a replica) of Redis 6.0 or newer that
//! never evicts keys, where the store's user may run its scripts and write under its
//! prefix. A server that breaks one of these would lose records (a message runs again)
//! or refuse them (a message is retried for ever), so it is refused with
//! [`StoreError::Misconfigured`] instead. What only weakens the promise (no append-only
//! file) is a warning.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use redis::{RedisError, Script};

use super::durability::Durability;
use super::{Connection, RedisStore, unavailable};
use crate::{StoreError, Token};

/// The oldest Redis the store runs on: `KEEPTTL` (6.0) keeps a released record's expiry.
pub const MIN_VERSION: (u32, u32) = (6, 0);

/// How long a store that found its server misconfigured at run time refuses claims
/// before it runs [`RedisStore::check`] again.
pub const RECHECK_INTERVAL: Duration = Duration::from_secs(5);

/// Runs every command the store's scripts run, on a key under the store's prefix:
/// the user may run them there, and the server knows them.
const PROBE_SCRIPT: &str = r"
redis.call('SET', KEYS[1], '1', 'PX', 1000)
redis.call('GET', KEYS[1])
redis.call('PTTL', KEYS[1])
redis.call('TYPE', KEYS[1])
redis.call('GETRANGE', KEYS[1], 0, 0)
redis.call('STRLEN', KEYS[1])
redis.call('TIME')
redis.call('SET', KEYS[1], '2', 'KEEPTTL')
redis.call('DEL', KEYS[1])
return 1
";

/// What the store accepts of its server beyond the requirements.
#[derive(Debug, Clone, Default)]
pub(super) struct Tolerance {
    /// Connect to a server whose `maxmemory-policy` may evict records.
    pub(super) eviction: bool,
}

/// A store's refusal of claims after its server turned misconfigured at run time.
#[derive(Debug, Default)]
pub(super) struct Refusal {
    state: Mutex<Option<Refused>>,
}

#[derive(Debug)]
struct Refused {
    reason: String,
    checked: Instant,
}

impl Refusal {
    /// Starts refusing claims for `reason`, if not refusing already.
    pub(super) fn begin(&self, reason: &str) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if state.is_none() {
            tracing::error!(
                reason,
                "the Redis server refused the store for a reason of configuration: claims are refused (the messages are retried, none is dead-lettered) until the server passes the store's check again, which is tried every {} s",
                RECHECK_INTERVAL.as_secs()
            );
            *state = Some(Refused { reason: reason.to_owned(), checked: Instant::now() });
        }
    }
}

/// The fields of an `INFO` reply.
struct Info<'a>(Vec<(&'a str, &'a str)>);

impl<'a> Info<'a> {
    fn parse(text: &'a str) -> Info<'a> {
        Info(
            text.lines()
                .filter(|line| !line.starts_with('#'))
                .filter_map(|line| line.trim_end().split_once(':'))
                .collect(),
        )
    }

    fn get(&self, field: &str) -> Option<&'a str> {
        self.0.iter().find(|(name, _)| *name == field).map(|(_, value)| *value)
    }
}

/// Judges one server from its `INFO`: `Err` with what is wrong and what to do, or the
/// warnings it gives.
fn judge(
    info: &Info,
    tolerance: &Tolerance,
    durability: Option<&Durability>,
) -> Result<Vec<String>, String> {
    let mut warnings = Vec::new();
    let version = info.get("redis_version").ok_or("its INFO has no redis_version")?;
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    if (major, minor) < MIN_VERSION {
        return Err(format!(
            "it runs Redis {version}; the store needs {}.{} or newer",
            MIN_VERSION.0, MIN_VERSION.1
        ));
    }
    if let Some(durability) = durability {
        super::durability::judge_server(
            durability,
            (major, minor),
            info.get("aof_enabled") == Some("1"),
        )?;
        let replicas: u32 =
            info.get("connected_slaves").and_then(|n| n.parse().ok()).unwrap_or_default();
        if replicas < durability.replicas {
            warnings.push(format!(
                "it has {replicas} replicas connected and the store waits for {}: until they connect, every claim and DONE waits {:?} and fails (the message is retried)",
                durability.replicas, durability.timeout
            ));
        }
    }
    match info.get("role") {
        Some("master") => {}
        Some(role) => {
            return Err(format!(
                "it is a replica (role {role}): records written there are refused or lost. Connect to the master"
            ));
        }
        None => warnings.push(
            "its INFO does not say whether it is a master or a replica: a replica would refuse or lose records".to_owned(),
        ),
    }
    let policy = info.get("maxmemory_policy");
    if policy.is_none() {
        warnings.push(
            "its INFO does not show maxmemory_policy: if it evicts keys, duplicates whose records were evicted run again".to_owned(),
        );
    }
    let policy = policy.unwrap_or("noeviction");
    if policy != "noeviction" {
        let cost = format!(
            "its maxmemory-policy is {policy}: under memory pressure Redis evicts records, and a duplicate whose DONE record was evicted runs its handler again (an in-progress record evicted mid-handler also resets its attempt count)"
        );
        if !tolerance.eviction {
            return Err(format!(
                "{cost}. Set maxmemory-policy to noeviction (on a managed service, in its parameter group), or accept the loss with RedisStore::options().allow_eviction()"
            ));
        }
        warnings.push(cost);
    }
    if info.get("aof_enabled") == Some("0") {
        warnings.push(
            "it keeps no append-only file: a restart loses the records written since its last snapshot (all of them without snapshots), and duplicates of those messages run again. Set appendonly yes (appendfsync always loses nothing)".to_owned(),
        );
    }
    Ok(warnings)
}

/// A refusal by the server of what the check sends (`INFO`, `SCRIPT LOAD`, `EVALSHA`)
/// as the error the check answers.
fn refused(what: &str, error: RedisError) -> StoreError {
    match unavailable(error) {
        StoreError::Misconfigured(reason) => {
            StoreError::Misconfigured(format!("the server refused {what}: {reason}"))
        }
        other => other,
    }
}

impl RedisStore {
    /// Checks that the server (every master of a Cluster) can keep this store's
    /// promise: Redis 6.0 or newer, a master, `maxmemory-policy noeviction` (unless
    /// [`allow_eviction`](super::RedisOptions::allow_eviction)), and a user that may
    /// run `INFO`, load and run scripts, and write keys under the store's prefix.
    /// Returns the warnings (also logged): a server without an append-only file.
    ///
    /// [`connect`](RedisStore::connect) and [`cluster`](RedisStore::cluster) run it;
    /// call it yourself on a store made with
    /// [`from_connection_manager`](RedisStore::from_connection_manager) or
    /// [`from_cluster_connection`](RedisStore::from_cluster_connection).
    ///
    /// # Errors
    ///
    /// [`StoreError::Misconfigured`] naming the setting and what to do about it, or
    /// [`StoreError::Unavailable`] when the server could not be asked.
    pub async fn check(&self) -> Result<Vec<String>, StoreError> {
        let mut warnings = Vec::new();
        let probe = Script::new(PROBE_SCRIPT);
        let mut unprobed = false;
        for node in self.server_nodes().await? {
            let place = match node {
                Some(slot) => format!("the Cluster master serving slot {slot}"),
                None => "the Redis server".to_owned(),
            };
            let info: String = self
                .query_on(node, &redis::cmd("INFO"))
                .await
                .map_err(|e| refused("INFO (grant the user +info)", e))?;
            let found = judge(&Info::parse(&info), &self.tolerance, self.durability.as_ref())
                .map_err(|reason| StoreError::Misconfigured(format!("{place}: {reason}")))?;
            warnings.extend(found.into_iter().map(|warning| format!("{place}: {warning}")));
            let mut load = redis::cmd("SCRIPT");
            load.arg("LOAD").arg(PROBE_SCRIPT);
            let _: String = self
                .query_on(node, &load)
                .await
                .map_err(|e| refused("SCRIPT LOAD (grant the user +@scripting)", e))?;
            match self.probe_key(node) {
                Some(key) => {
                    let mut run = redis::cmd("EVALSHA");
                    run.arg(probe.get_hash()).arg(1).arg(&key);
                    let ran = self.query_on::<i64>(node, &run).await;
                    self.probed(ran, &key, &mut warnings)?;
                }
                None => unprobed = true,
            }
        }
        if unprobed {
            // The prefix's hash tag pins every record to one slot: the probe goes where
            // the records do.
            let key = format!("{}:check:{}", self.prefix, Token::random());
            let mut run = redis::cmd("EVALSHA");
            run.arg(probe.get_hash()).arg(1).arg(&key);
            let ran = self.query::<i64>(&run).await;
            self.probed(ran, &key, &mut warnings)?;
        }
        for warning in &warnings {
            tracing::warn!(warning, "the Redis server weakens the store's promise");
        }
        Ok(warnings)
    }

    /// A key under the store's prefix for the probe on `node`: in the slot `node`
    /// names on a Cluster (a master's lowest). `None` when no key can be put there:
    /// the prefix holds a hash tag, which pins every key under it to one slot.
    fn probe_key(&self, node: Option<u16>) -> Option<String> {
        use redis::cluster_routing::{Route, Slot, SlotAddr};
        let base = format!("{}:check:{}", self.prefix, Token::random());
        let Some(node) = node else { return Some(base) };
        let route = |key: &str| Route::with_slot(Slot::for_key(key), SlotAddr::Master);
        if route(&format!("{base}:{{0}}")) == route(&format!("{base}:{{1}}")) {
            return None;
        }
        let want = Route::new(node, SlotAddr::Master);
        (0..u32::MAX).map(|tag| format!("{base}:{{{tag}}}")).find(|key| route(key) == want)
    }

    /// Judges the probe's answer: a command refused or unknown is a misconfiguration;
    /// a key outside the user's patterns is a warning, since every call on such a key
    /// is refused before any handler runs (and retried).
    fn probed(
        &self,
        ran: Result<i64, RedisError>,
        key: &str,
        warnings: &mut Vec<String>,
    ) -> Result<(), StoreError> {
        let Err(error) = ran else { return Ok(()) };
        if super::denied(&error) == Some(super::Denied::Key) {
            warnings.push(format!(
                "the user may not write `{key}`: records under `{}:` outside its key patterns are refused, and their messages retried until it may (grant ~{}:*)",
                self.prefix, self.prefix
            ));
            return Ok(());
        }
        Err(refused("the commands the store's scripts run", error))
    }

    /// The servers [`check`](RedisStore::check) asks: `[None]` for standalone Redis,
    /// each master of a Cluster as the lowest slot it serves.
    async fn server_nodes(&self) -> Result<Vec<Option<u16>>, StoreError> {
        Ok(match self.connection {
            Connection::Standalone(_) => vec![None],
            Connection::Cluster(_) => self.list_nodes().await?.into_iter().map(Some).collect(),
        })
    }

    /// Before a claim: `Err` while the store refuses claims after its server turned
    /// misconfigured, checking the server again every [`RECHECK_INTERVAL`].
    pub(super) async fn claims_allowed(&self) -> Result<(), StoreError> {
        {
            let mut state = self.refusal.state.lock().unwrap_or_else(|e| e.into_inner());
            match state.as_mut() {
                None => return Ok(()),
                Some(refused) if refused.checked.elapsed() < RECHECK_INTERVAL => {
                    return Err(StoreError::Misconfigured(refused.reason.clone()));
                }
                // This claim checks; the others keep refusing meanwhile.
                Some(refused) => refused.checked = Instant::now(),
            }
        }
        let answer = self.check().await;
        let mut state = self.refusal.state.lock().unwrap_or_else(|e| e.into_inner());
        match answer {
            Ok(_) => {
                tracing::info!("the Redis server passes the store's check again: claims resume");
                *state = None;
                Ok(())
            }
            Err(StoreError::Misconfigured(reason)) => {
                if let Some(refused) = state.as_mut() {
                    refused.reason.clone_from(&reason);
                }
                Err(StoreError::Misconfigured(reason))
            }
            Err(other) => Err(other),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const INFO: &str = "# Server\r\nredis_version:7.0.15\r\nredis_mode:standalone\r\n\r\n# Memory\r\nmaxmemory:0\r\nmaxmemory_policy:noeviction\r\n# Persistence\r\naof_enabled:1\r\n# Replication\r\nrole:master\r\nconnected_slaves:0\r\n";

    fn judged(info: &str, eviction: bool) -> Result<Vec<String>, String> {
        judge(&Info::parse(info), &Tolerance { eviction }, None)
    }

    #[test]
    fn a_master_that_never_evicts_and_keeps_an_append_only_file_passes() {
        assert_eq!(judged(INFO, false), Ok(vec![]));
    }

    #[test]
    fn an_evicting_server_is_refused_unless_allowed() {
        let lru = INFO.replace("noeviction", "volatile-lru");
        let refusal = judged(&lru, false).unwrap_err();
        assert!(
            refusal.contains("volatile-lru") && refusal.contains("allow_eviction"),
            "{refusal}"
        );
        let warnings = judged(&lru, true).unwrap();
        assert!(warnings[0].contains("evicts records"), "{warnings:?}");
    }

    #[test]
    fn a_replica_and_an_old_server_are_refused() {
        let replica = judged(&INFO.replace("role:master", "role:slave"), false).unwrap_err();
        assert!(replica.contains("replica"), "{replica}");
        let old = judged(&INFO.replace("7.0.15", "5.0.14"), false).unwrap_err();
        assert!(old.contains("5.0.14") && old.contains("6.0"), "{old}");
    }

    #[test]
    fn a_server_without_an_append_only_file_is_a_warning() {
        let warnings = judged(&INFO.replace("aof_enabled:1", "aof_enabled:0"), false).unwrap();
        assert!(warnings[0].contains("append-only"), "{warnings:?}");
    }
}
