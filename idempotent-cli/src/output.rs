//! What the commands print: aligned tables for people, JSON for scripts. Keys are
//! printed escaped (`\xNN` for bytes that are not printable ASCII), so an id a
//! producer chose cannot move the cursor or forge lines on an operator's terminal.

use std::fmt;
use std::io::Write as _;
use std::time::Duration;

use idempotent_runtime::Key;
use idempotent_runtime::store::admin::{Record, Released, State};
use serde_json::{Value, json};

/// Prints a line to standard output.
macro_rules! say {
    ($($arg:tt)*) => { line(format_args!($($arg)*)) };
}

/// Writes a line; once nothing reads the output any more (`idempotent list | head`),
/// the command ends quietly, as other tools do, instead of panicking.
fn line(args: fmt::Arguments<'_>) {
    if writeln!(std::io::stdout().lock(), "{args}").is_err() {
        std::process::exit(0);
    }
}

/// Where output goes, and in which form.
pub struct Output {
    json: bool,
}

impl Output {
    pub fn new(json: bool) -> Output {
        Output { json }
    }

    /// One record, as `inspect` shows it.
    pub fn record(&self, record: &Record) {
        if self.json {
            say!("{}", record_json(record));
            return;
        }
        let rows = [
            ("key", escaped(&record.key)),
            ("state", record.state.label().to_owned()),
            ("attempts", record.attempts.to_string()),
            ("lease left", duration(record.lease_left)),
            ("ttl left", duration(record.ttl_left)),
            ("fingerprint", record.fingerprint.clone().unwrap_or_else(|| "-".to_owned())),
            ("cached result", record.result_len.map_or("-".to_owned(), |n| format!("{n} bytes"))),
        ];
        for (name, value) in rows {
            say!("{name:<14}{value}");
        }
    }

    /// `inspect` found no record.
    pub fn missing(&self, key: &Key) {
        if self.json {
            say!("{}", json!({ "key": escaped(key.as_bytes()), "state": Value::Null }));
        } else {
            say!("no record for {} (never claimed, expired or released)", escaped(key.as_bytes()));
        }
    }

    /// A table of records, filled as they arrive (JSON lines are printed at once).
    pub fn records(&self) -> RecordTable {
        RecordTable { json: self.json, rows: Vec::new() }
    }

    pub fn released_one(&self, key: &Key, released: &Released) {
        let key = escaped(key.as_bytes());
        if self.json {
            let (outcome, why) = match released {
                Released::Released => ("released", None),
                Released::NotFound => ("not_found", None),
                Released::Refused(why) => ("refused", Some(why.as_str())),
            };
            say!("{}", json!({ "key": key, "outcome": outcome, "why": why }));
            return;
        }
        match released {
            Released::Released => say!("released {key}: the next delivery processes it"),
            Released::NotFound => say!("no record for {key}: nothing to release"),
            Released::Refused(why) => say!("refused {key}: {why}"),
        }
    }

    /// What a bulk release would do (`--dry-run`, or nothing matched).
    pub fn would_release(&self, keys: &[Vec<u8>]) {
        if self.json {
            let keys: Vec<String> = keys.iter().map(|key| escaped(key)).collect();
            say!("{}", json!({ "would_release": keys }));
            return;
        }
        if keys.is_empty() {
            say!("no record matches: nothing to release");
            return;
        }
        for key in keys {
            say!("would release {}", escaped(key));
        }
        say!("{} record(s); run again without --dry-run to release them", keys.len());
    }

    pub fn released_many(&self, summary: &Summary) {
        if self.json {
            let refused: Vec<Value> = (summary.refused.iter())
                .map(|(key, why)| json!({ "key": escaped(key), "why": why }))
                .collect();
            say!(
                "{}",
                json!({
                    "released": summary.released,
                    "gone": summary.gone,
                    "refused": refused,
                })
            );
            return;
        }
        for (key, why) in &summary.refused {
            say!("refused {}: {why}", escaped(key));
        }
        say!(
            "released {} record(s); {} gone meanwhile; {} refused",
            summary.released,
            summary.gone,
            summary.refused.len()
        );
    }

    pub fn purged(&self, purged: u64) {
        if self.json {
            say!("{}", json!({ "purged": purged }));
        } else {
            say!("purged {purged} expired record(s)");
        }
    }

    pub fn stats(&self, counts: &[(String, State, u64)]) {
        if self.json {
            let rows: Vec<Value> = (counts.iter())
                .map(|(namespace, state, count)| {
                    json!({ "namespace": escaped(namespace.as_bytes()), "state": state.label(), "count": count })
                })
                .collect();
            say!("{}", Value::Array(rows));
            return;
        }
        let rows: Vec<Vec<String>> = (counts.iter())
            .map(|(namespace, state, count)| {
                vec![escaped(namespace.as_bytes()), state.label().to_owned(), count.to_string()]
            })
            .collect();
        print_table(&["NAMESPACE", "STATE", "COUNT"], &rows);
    }
}

/// What a bulk release did.
#[derive(Default)]
pub struct Summary {
    pub released: u64,
    /// Records that were gone by the time of their release (expired, or released by
    /// someone else).
    pub gone: u64,
    pub refused: Vec<(Vec<u8>, String)>,
}

impl Summary {
    pub fn add(&mut self, key: &[u8], released: Released) {
        match released {
            Released::Released => self.released += 1,
            Released::NotFound => self.gone += 1,
            Released::Refused(why) => self.refused.push((key.to_vec(), why)),
        }
    }
}

/// The records `list` prints: JSON lines at once, or a table at the end.
pub struct RecordTable {
    json: bool,
    rows: Vec<Vec<String>>,
}

impl RecordTable {
    pub fn push(&mut self, record: &Record) {
        if self.json {
            say!("{}", record_json(record));
            return;
        }
        self.rows.push(vec![
            escaped(&record.key),
            record.state.label().to_owned(),
            record.attempts.to_string(),
            duration(record.lease_left),
            duration(record.ttl_left),
            record.result_len.map_or("-".to_owned(), |n| n.to_string()),
        ]);
    }

    pub fn finish(self) {
        if self.json {
            return;
        }
        if self.rows.is_empty() {
            say!("no records");
            return;
        }
        print_table(
            &["KEY", "STATE", "ATTEMPTS", "LEASE LEFT", "TTL LEFT", "RESULT BYTES"],
            &self.rows,
        );
    }
}

fn record_json(record: &Record) -> Value {
    json!({
        "key": escaped(&record.key),
        "namespace": escaped(record.namespace.as_bytes()),
        "id": escaped(&record.id),
        "state": record.state.label(),
        "attempts": record.attempts,
        "lease_left_ms": record.lease_left.map(|d| d.as_millis() as u64),
        "ttl_left_ms": record.ttl_left.map(|d| d.as_millis() as u64),
        "fingerprint": record.fingerprint,
        "result_bytes": record.result_len,
    })
}

fn print_table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let padded: Vec<String> =
            cells.zip(&widths).map(|(cell, width)| format!("{cell:<width$}")).collect();
        say!("{}", padded.join("  ").trim_end());
    };
    line(&mut header.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
}

/// Bytes as printable ASCII, everything else escaped.
fn escaped(bytes: &[u8]) -> String {
    bytes.escape_ascii().to_string()
}

/// A duration as people read it: `850ms`, `12.4s`, `5m 3s`, `3h 20m`, `2d 4h`; `-`
/// for none.
fn duration(duration: Option<Duration>) -> String {
    let Some(duration) = duration else { return "-".to_owned() };
    let secs = duration.as_secs();
    match secs {
        0 => format!("{}ms", duration.as_millis()),
        1..60 => format!("{:.1}s", duration.as_secs_f64()),
        60..3600 => format!("{}m {}s", secs / 60, secs % 60),
        3600..86_400 => format!("{}h {}m", secs / 3600, secs % 3600 / 60),
        _ => format!("{}d {}h", secs / 86_400, secs % 86_400 / 3600),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_like_people_write_them() {
        let d = |ms| duration(Some(Duration::from_millis(ms)));
        assert_eq!(d(850), "850ms");
        assert_eq!(d(12_400), "12.4s");
        assert_eq!(d(303_000), "5m 3s");
        assert_eq!(d(12_000_000), "3h 20m");
        assert_eq!(d(187_200_000), "2d 4h");
        assert_eq!(duration(None), "-");
    }

    #[test]
    fn hostile_ids_cannot_reach_the_terminal() {
        assert_eq!(escaped(b"orders:\x1b[2Jgone\nFAKE"), "orders:\\x1b[2Jgone\\nFAKE");
    }
}
