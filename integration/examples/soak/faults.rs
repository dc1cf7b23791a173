//! The faults a run injects, when, and the log that records each one.

use std::fmt;
use std::io::Write as _;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::ledger::now_ns;

/// A seeded pseudo-random generator (splitmix64): the same seed gives the same faults
/// at the same offsets.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator starting from `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut x = self.0;
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^ (x >> 31)
    }

    /// A number in `low..=high`.
    pub fn between(&mut self, low: u64, high: u64) -> u64 {
        low + self.next_u64() % (high - low + 1)
    }

    /// A duration in `low..=high` milliseconds.
    pub fn millis(&mut self, low: u64, high: u64) -> Duration {
        Duration::from_millis(self.between(low, high))
    }

    /// The items of `items` in a random order.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.between(0, i as u64) as usize;
            items.swap(i, j);
        }
    }
}

/// One kind of fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultKind {
    /// A consumer process killed with SIGKILL (and respawned).
    Kill,
    /// The run's Redis stopped with SIGTERM and started again on its append-only file.
    Restart,
    /// The run's Redis stopped with SIGSTOP for longer than the lease, then SIGCONT.
    Pause,
    /// `CLIENT KILL TYPE normal` on the run's Redis.
    ClientKill,
    /// `pg_terminate_backend` of every backend of the run's consumers.
    BackendKill,
    /// The proxy drops every connection and refuses new ones for a while.
    NetCut,
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FaultKind::Kill => "kill",
            FaultKind::Restart => "restart",
            FaultKind::Pause => "pause",
            FaultKind::ClientKill => "client_kill",
            FaultKind::BackendKill => "backend_kill",
            FaultKind::NetCut => "net_cut",
        })
    }
}

/// One fault as injected.
#[derive(Debug, Clone)]
pub struct Fault {
    /// What was done.
    pub kind: FaultKind,
    /// When it began, Unix nanoseconds.
    pub at_ns: u64,
    /// What it was done to, for the log.
    pub target: String,
    /// The consumer process killed, for [`FaultKind::Kill`].
    pub pid: Option<u32>,
}

/// Every fault of a run, in order, also appended to a file as it happens.
#[derive(Clone)]
pub struct FaultLog {
    faults: Arc<Mutex<Vec<Fault>>>,
    file: Arc<Mutex<std::fs::File>>,
}

impl FaultLog {
    /// A log writing to `path`.
    pub fn create(path: &Path) -> std::io::Result<FaultLog> {
        let file = std::fs::File::create(path)?;
        Ok(FaultLog { faults: Arc::default(), file: Arc::new(Mutex::new(file)) })
    }

    /// Records a fault that began now.
    pub fn record(&self, kind: FaultKind, target: String, pid: Option<u32>) {
        let fault = Fault { kind, at_ns: now_ns(), target, pid };
        tracing::info!(kind = %fault.kind, target = %fault.target, "fault");
        let line = format!("{} {} {}\n", fault.at_ns, fault.kind, fault.target);
        let _ = self.file.lock().unwrap().write_all(line.as_bytes());
        self.faults.lock().unwrap().push(fault);
    }

    /// The faults so far.
    pub fn faults(&self) -> Vec<Fault> {
        self.faults.lock().unwrap().clone()
    }
}

/// The order of a run's faults: every kind of `kinds` once first (in a random
/// order), then random kinds, kills twice as likely as the others.
pub struct Schedule {
    kinds: Vec<FaultKind>,
    first: Vec<FaultKind>,
}

impl Schedule {
    /// A schedule over `kinds`.
    pub fn new(kinds: &[FaultKind], rng: &mut Rng) -> Schedule {
        let mut first = kinds.to_vec();
        rng.shuffle(&mut first);
        first.reverse(); // popped from the end
        Schedule { kinds: kinds.to_vec(), first }
    }

    /// The next fault to inject.
    pub fn next(&mut self, rng: &mut Rng) -> FaultKind {
        if let Some(kind) = self.first.pop() {
            return kind;
        }
        let roll = rng.between(0, self.kinds.len() as u64) as usize;
        // One more slot than kinds: the extra one is a kill.
        self.kinds.get(roll).copied().unwrap_or(FaultKind::Kill)
    }
}
