//! What the consumers did (effects, and the events that allow an effect to repeat),
//! and the accounting at the end of a run.

use std::collections::{BTreeMap, HashMap};
use std::io::Write as _;
use std::path::Path;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::faults::{Fault, FaultKind};

/// Now, in Unix nanoseconds: comparable between the processes of one machine.
pub fn now_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// One effect of a handler: message `id` applied by process `pid` at `at_ns`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Effect {
    /// The message's id.
    pub id: u64,
    /// The consumer process that applied it.
    pub pid: u32,
    /// When, Unix nanoseconds.
    pub at_ns: u64,
}

/// A consumer's report of how a call ended: it recorded DONE (`done`), so its effect
/// must not repeat; or in a way that lets its effect repeat: its `complete` answered
/// lease-lost (`lease_lost`), or DONE could not be written after the effect
/// (`done_unrecorded`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The message's id.
    pub id: u64,
    /// The consumer process that reported it.
    pub pid: u32,
    /// When, Unix nanoseconds.
    pub at_ns: u64,
    /// `done`, `lease_lost` or `done_unrecorded`.
    pub kind: String,
}

/// A file of whole lines, opened for appending: each line is one `write`, so a line
/// is whole or absent after a SIGKILL.
pub struct AppendFile(Mutex<std::fs::File>);

impl AppendFile {
    /// Opens (creating) `path` in append mode.
    pub fn open(path: &Path) -> std::io::Result<AppendFile> {
        let file = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
        Ok(AppendFile(Mutex::new(file)))
    }

    /// Appends `line` (which ends with a newline) in one write.
    pub fn append(&self, line: &str) -> std::io::Result<()> {
        self.0.lock().unwrap().write_all(line.as_bytes())
    }
}

/// The effect line `"<id> <pid> <ns>\n"`.
pub fn effect_line(id: u64, pid: u32, at_ns: u64) -> String {
    format!("{id} {pid} {at_ns}\n")
}

/// The effects in the ledger files under `dir` (`ledger-*.txt`).
pub fn read_effects(dir: &Path) -> Vec<Effect> {
    read_lines(dir, "ledger-")
        .filter_map(|line| {
            let mut parts = line.split_whitespace();
            Some(Effect {
                id: parts.next()?.parse().ok()?,
                pid: parts.next()?.parse().ok()?,
                at_ns: parts.next()?.parse().ok()?,
            })
        })
        .collect()
}

/// The events in the event files under `dir` (`events-*.txt`).
pub fn read_events(dir: &Path) -> Vec<Event> {
    read_lines(dir, "events-")
        .filter_map(|line| {
            let mut parts = line.split_whitespace();
            Some(Event {
                id: parts.next()?.parse().ok()?,
                pid: parts.next()?.parse().ok()?,
                at_ns: parts.next()?.parse().ok()?,
                kind: parts.next()?.to_owned(),
            })
        })
        .collect()
}

/// The whole lines of the files under `dir` whose names start with `prefix`.
fn read_lines(dir: &Path, prefix: &str) -> impl Iterator<Item = String> {
    let mut lines = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.file_name().to_string_lossy().starts_with(prefix) {
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            // A line cut short (no newline) would be a torn write: never counted.
            let whole = text.rfind('\n').map_or("", |end| &text[..end]);
            lines.extend(whole.lines().map(str::to_owned));
        }
    }
    lines.into_iter()
}

/// A message applied more than once, and why each repeat was allowed.
#[derive(Debug)]
pub struct Double {
    /// The message's id.
    pub id: u64,
    /// Its effects, oldest first.
    pub effects: Vec<Effect>,
    /// For each effect but the last, what allowed the next one (`None`: nothing).
    pub reasons: Vec<Option<String>>,
}

impl Double {
    /// Whether every repeat has a fault behind it.
    pub fn explained(&self) -> bool {
        self.reasons.iter().all(Option::is_some)
    }
}

/// The outcome of a run.
#[derive(Debug)]
pub struct Accounting {
    /// How many messages were published.
    pub published: usize,
    /// Published ids with no effect.
    pub lost: Vec<u64>,
    /// Ids with more than one effect.
    pub doubles: Vec<Double>,
    /// Publish to first effect, 99th percentile, milliseconds.
    pub p99_ms: f64,
}

/// Accounts `effects` against the publish times (`published[id]`, Unix ns), using the
/// consumers' `events` and the run's `faults` to explain repeats.
pub fn account(
    published: &[u64],
    effects: &[Effect],
    events: &[Event],
    faults: &[Fault],
) -> Accounting {
    let mut by_id: BTreeMap<u64, Vec<Effect>> = BTreeMap::new();
    for effect in effects {
        by_id.entry(effect.id).or_default().push(*effect);
    }
    let mut events_by_id: HashMap<u64, Vec<&Event>> = HashMap::new();
    for event in events {
        events_by_id.entry(event.id).or_default().push(event);
    }
    let kills: Vec<&Fault> = faults.iter().filter(|f| f.kind == FaultKind::Kill).collect();

    let lost = (0..published.len() as u64).filter(|id| !by_id.contains_key(id)).collect();
    let mut latencies: Vec<u64> = Vec::new();
    let mut doubles = Vec::new();
    for (id, mut effects) in by_id {
        effects.sort_by_key(|e| e.at_ns);
        if let Some(sent) = published.get(id as usize) {
            latencies.push(effects[0].at_ns.saturating_sub(*sent));
        }
        if effects.len() < 2 {
            continue;
        }
        let reasons = effects
            .windows(2)
            .map(|pair| {
                let (first, next) = (pair[0], pair[1]);
                // A report belongs to the call that applied `first`: by its consumer,
                // after it, and before that consumer's own next effect of the message
                // (a later report is about a later call).
                let own_next = (effects.iter())
                    .filter(|e| e.pid == first.pid && e.at_ns > first.at_ns)
                    .map(|e| e.at_ns)
                    .min()
                    .unwrap_or(u64::MAX);
                let reported = |kind: &str| {
                    events_by_id.get(&id).and_then(|events| {
                        events.iter().find(|e| {
                            e.pid == first.pid
                                && (first.at_ns..own_next).contains(&e.at_ns)
                                && e.kind == kind
                        })
                    })
                };
                // DONE was recorded after the first effect: nothing allows another.
                if reported("done").is_some() {
                    return None;
                }
                let killed = kills.iter().find(|k| {
                    k.pid == Some(first.pid) && k.at_ns >= first.at_ns && k.at_ns <= next.at_ns
                });
                if let Some(kill) = killed {
                    let after = (kill.at_ns - first.at_ns) as f64 / 1e6;
                    return Some(format!(
                        "pid {} killed {after:.1} ms after its effect",
                        first.pid
                    ));
                }
                let repeatable = reported("lease_lost").or_else(|| reported("done_unrecorded"));
                repeatable.map(|e| format!("pid {} reported {} for it", e.pid, e.kind))
            })
            .collect();
        doubles.push(Double { id, effects, reasons });
    }
    latencies.sort_unstable();
    let p99_ms = match latencies.len() {
        0 => 0.0,
        n => latencies[((n * 99).div_ceil(100)).clamp(1, n) - 1] as f64 / 1e6,
    };
    Accounting { published: published.len(), lost, doubles, p99_ms }
}

/// The table's header.
pub const TABLE_HEADER: &str = "| config | minutes | consumers | messages | faults (kill / restart / \
pause / client kill / backend kill / net cut) | lost | doubled | doubles explained | p99 latency |\n\
| --- | --- | --- | --- | --- | --- | --- | --- | --- |";

/// One table row for a run.
pub fn table_row(
    config: &str,
    minutes: f64,
    consumers: usize,
    faults: &[Fault],
    accounting: &Accounting,
) -> String {
    let count = |kind: FaultKind| faults.iter().filter(|f| f.kind == kind).count();
    let cell = |kind: FaultKind, applies: bool| {
        if applies { count(kind).to_string() } else { "–".to_owned() }
    };
    let redis = config == "redis";
    let faults = [
        cell(FaultKind::Kill, true),
        cell(FaultKind::Restart, redis),
        cell(FaultKind::Pause, redis),
        cell(FaultKind::ClientKill, redis),
        cell(FaultKind::BackendKill, !redis),
        cell(FaultKind::NetCut, true),
    ]
    .join(" / ");
    let explained = accounting.doubles.iter().filter(|d| d.explained()).count();
    format!(
        "| {config} | {minutes:.1} | {consumers} | {} | {faults} | {} | {} | {explained} | {:.0} ms |",
        accounting.published,
        accounting.lost.len(),
        accounting.doubles.len(),
        accounting.p99_ms,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn effect(id: u64, pid: u32, at_ns: u64) -> Effect {
        Effect { id, pid, at_ns }
    }

    fn event(id: u64, pid: u32, at_ns: u64, kind: &str) -> Event {
        Event { id, pid, at_ns, kind: kind.to_owned() }
    }

    #[test]
    fn a_repeat_after_a_recorded_done_is_unexplained() {
        let effects = [effect(0, 7, 10), effect(0, 8, 30)];
        let events = [event(0, 7, 12, "done")];
        let accounting = account(&[0], &effects, &events, &[]);
        assert!(!accounting.doubles[0].explained());
    }

    #[test]
    fn a_repeat_after_done_failed_is_explained_even_by_the_same_consumer() {
        // The consumer could not write DONE, got the message again and applied it
        // again, this time recording DONE: that later `done` belongs to its second call.
        let effects = [effect(0, 7, 10), effect(0, 7, 30)];
        let events = [event(0, 7, 12, "done_unrecorded"), event(0, 7, 31, "done")];
        let accounting = account(&[0], &effects, &events, &[]);
        assert!(accounting.doubles[0].explained(), "{:?}", accounting.doubles);

        // Another consumer repeating it: the same.
        let effects = [effect(0, 7, 10), effect(0, 8, 30)];
        let events = [event(0, 7, 12, "done_unrecorded"), event(0, 8, 31, "done")];
        assert!(account(&[0], &effects, &events, &[]).doubles[0].explained());
    }

    #[test]
    fn a_report_of_a_later_call_explains_nothing_earlier() {
        // The second call's `done_unrecorded` does not excuse the first call's repeat.
        let effects = [effect(0, 7, 10), effect(0, 7, 30), effect(0, 8, 50)];
        let events = [event(0, 7, 31, "done_unrecorded")];
        let accounting = account(&[0], &effects, &events, &[]);
        let reasons = &accounting.doubles[0].reasons;
        assert!(reasons[0].is_none() && reasons[1].is_some(), "{reasons:?}");
    }
}
