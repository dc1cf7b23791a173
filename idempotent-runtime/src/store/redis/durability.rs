//! Waiting for a write to be durable before answering: `WAIT` for replicas,
//! `WAITAOF` for the master's own append-only file too. Redis acknowledges a write
//! once it is in the master's memory; a failover to a replica that had not received
//! it yet, or a restart before the write reached the disk, loses it, and a duplicate
//! of that message runs its handler again. With [`Durability`], a claim is not
//! answered as won, nor DONE or FAILED as recorded, until the write reached as many
//! replicas (and the disk) as asked.

use std::time::Duration;

use redis::Value;

use super::{Connection, RedisStore};
use crate::StoreError;

/// What a write must reach before the store answers: see
/// [`RedisOptions::wait_for_replicas`](super::RedisOptions::wait_for_replicas).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Durability {
    pub(super) replicas: u32,
    pub(super) local_fsync: bool,
    pub(super) timeout: Duration,
}

impl Durability {
    /// The command that waits: `WAIT replicas timeout`, or `WAITAOF 1 replicas
    /// timeout` when the master's own fsync is asked for too.
    fn command(&self) -> redis::Cmd {
        let timeout = self.timeout.as_millis().max(1) as u64;
        if self.local_fsync {
            let mut wait = redis::cmd("WAITAOF");
            wait.arg(1).arg(self.replicas).arg(timeout);
            wait
        } else {
            let mut wait = redis::cmd("WAIT");
            wait.arg(self.replicas).arg(timeout);
            wait
        }
    }

    /// Judges the reply: `Err` when the write did not reach what was asked in time.
    fn judge(&self, reply: &Value) -> Result<(), StoreError> {
        let number = |value: &Value| match value {
            Value::Int(n) => Some(*n),
            _ => None,
        };
        let (local, replicas) = match reply {
            Value::Int(n) => (1, *n),
            Value::Array(counts) if counts.len() == 2 => {
                match (number(&counts[0]), number(&counts[1])) {
                    (Some(local), Some(replicas)) => (local, replicas),
                    _ => return Err(StoreError::Protocol(format!("WAITAOF answered {reply:?}"))),
                }
            }
            other => return Err(StoreError::Protocol(format!("WAIT answered {other:?}"))),
        };
        if local < 1 {
            return Err(StoreError::unavailable(format!(
                "the write was not in the master's append-only file within {:?}",
                self.timeout
            )));
        }
        if replicas < i64::from(self.replicas) {
            return Err(StoreError::unavailable(format!(
                "the write reached {replicas} of the {} replicas asked for within {:?}: not durable yet, so not answered",
                self.replicas, self.timeout
            )));
        }
        Ok(())
    }
}

impl RedisStore {
    /// Waits until the writes made so far on the connection that serves `redis_key`
    /// are as durable as asked; `Ok` at once without [`Durability`].
    ///
    /// `WAIT` counts the writes of the connection it is sent on: on a standalone
    /// server, the store's one multiplexed connection (so a wait also covers the
    /// other calls' writes before it); on a Cluster, the connection to the master of
    /// the key's slot.
    pub(super) async fn made_durable(&self, redis_key: &[u8]) -> Result<(), StoreError> {
        let Some(durability) = &self.durability else { return Ok(()) };
        let wait = durability.command();
        let reply: Value = match &self.connection {
            Connection::Standalone(c) => c.query(&wait).await,
            Connection::Cluster(c) => {
                use redis::cluster_routing::{
                    Route, RoutingInfo, SingleNodeRoutingInfo, Slot, SlotAddr,
                };
                let route = Route::with_slot(Slot::for_key(redis_key), SlotAddr::Master);
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route));
                c.clone().route_command(wait, routing).await
            }
        }
        .map_err(|error| self.failed(error))?;
        durability.judge(&reply)
    }
}

/// What the start-up check asks of a server for `durability`: `WAITAOF` needs Redis
/// 7.2 and an append-only file.
pub(super) fn judge_server(
    durability: &Durability,
    version: (u32, u32),
    aof_enabled: bool,
) -> Result<(), String> {
    if durability.local_fsync {
        if version < (7, 2) {
            return Err(format!(
                "it runs Redis {}.{}: waiting for the master's own fsync (WAITAOF) needs 7.2",
                version.0, version.1
            ));
        }
        if !aof_enabled {
            return Err(
                "it keeps no append-only file, which waiting for the master's own fsync needs: set appendonly yes".to_owned(),
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asking(replicas: u32, local_fsync: bool) -> Durability {
        Durability { replicas, local_fsync, timeout: Duration::from_millis(500) }
    }

    #[test]
    fn enough_replicas_pass_and_too_few_are_a_retry() {
        assert!(asking(1, false).judge(&Value::Int(2)).is_ok());
        let short = asking(2, false).judge(&Value::Int(1)).unwrap_err();
        assert!(matches!(&short, StoreError::Unavailable(_)), "{short}");
        assert!(short.to_string().contains("1 of the 2 replicas"), "{short}");
    }

    #[test]
    fn waitaof_needs_the_local_fsync_and_the_replicas() {
        let both = Value::Array(vec![Value::Int(1), Value::Int(1)]);
        assert!(asking(1, true).judge(&both).is_ok());
        let no_disk = Value::Array(vec![Value::Int(0), Value::Int(1)]);
        assert!(asking(1, true).judge(&no_disk).is_err());
    }

    #[test]
    fn waitaof_is_refused_where_it_cannot_run() {
        assert!(judge_server(&asking(0, true), (7, 0), true).unwrap_err().contains("7.2"));
        assert!(judge_server(&asking(0, true), (7, 2), false).unwrap_err().contains("appendonly"));
        assert!(judge_server(&asking(1, false), (6, 0), false).is_ok());
    }
}
