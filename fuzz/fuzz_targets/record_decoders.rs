//! Every decoder of stored records on arbitrary bytes: Redis record strings (the
//! claim's `SET NX GET` answer and the admin's reading) and listing cursors, ZooKeeper
//! znode data and listing cursors, SQL rows (state letters, claim outcomes, admin
//! rows), hex cursors, and cached results (`ResultCache`, JSON of a typed result).
//! The first byte picks the decoder; the rest is its input.
//!
//! Invariants: nothing panics; a decoder's answer agrees with the fields it read;
//! what an encoder writes decodes to what was encoded, and is written again byte for
//! byte; what decodes and has an encoder re-encodes to its canonical form, the same
//! bytes for input already in that form.

#![no_main]

use std::time::Duration;

use arbitrary::{Arbitrary, Unstructured};
use idempotent_runtime::__fuzz::{self, mysql, postgres, redis, zookeeper};
use idempotent_runtime::admin::State;
use idempotent_runtime::execute::ResultCache;
use idempotent_runtime::serde_json::{self, Value};
use idempotent_runtime::{Claim, Token};
use libfuzzer_sys::fuzz_target;
use serde::{Deserialize, Serialize};

const MAX_DURATION_MS: u64 = 36_500 * 24 * 60 * 60 * 1000;

const FINGERPRINTS: [&str; 3] = [
    "-",
    "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
    "ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff",
];

/// The input's remaining bytes.
fn rest<'a>(u: &mut Unstructured<'a>) -> &'a [u8] {
    u.bytes(u.len()).unwrap_or_default()
}

/// The input's remaining bytes, up to the first that is not UTF-8.
fn rest_str<'a>(u: &mut Unstructured<'a>) -> &'a str {
    let bytes = rest(u);
    match std::str::from_utf8(bytes) {
        Ok(text) => text,
        Err(e) => std::str::from_utf8(&bytes[..e.valid_up_to()]).unwrap_or_default(),
    }
}

fn fingerprint(u: &mut Unstructured<'_>) -> arbitrary::Result<&'static str> {
    Ok(FINGERPRINTS[u.choose_index(FINGERPRINTS.len())?])
}

fn state(u: &mut Unstructured<'_>) -> arbitrary::Result<State> {
    Ok(State::ALL[u.choose_index(State::ALL.len())?])
}

/// The claim's `SET NX GET` found `record`.
fn redis_settle(u: &mut Unstructured<'_>) -> arbitrary::Result<()> {
    let claimer =
        redis::Claimer::new(u.arbitrary()?, u.arbitrary()?, u.arbitrary()?, fingerprint(u)?);
    let record = rest(u);
    let Some(claim) = claimer.settle(record) else { return Ok(()) };
    let state = record[0];
    match claim {
        Claim::Won { token, .. } => assert!(state == b'P' && token == claimer.token()),
        Claim::Done => assert_eq!(state, b'D'),
        Claim::Cached(result) => assert!(state == b'D' && record.ends_with(&result)),
        Claim::Failed { .. } => assert_eq!(state, b'F'),
        Claim::Mismatch => {}
        other => panic!("{other:?} from {record:?}"),
    }
    Ok(())
}

/// A record in the current format, as the claim and the scripts write it: a fresh
/// claim, finished (`D`/`F` and the result appended) or released.
fn redis_written(u: &mut Unstructured<'_>) -> arbitrary::Result<()> {
    let token: u128 = u.arbitrary()?;
    // Leases and ttls are at most 100 years; the retention is `max(ttl, lease) + lease`.
    let lease: u64 = u.int_in_range(1..=MAX_DURATION_MS)?;
    let retention: u64 = u.int_in_range(lease..=lease + MAX_DURATION_MS)?;
    let fp = fingerprint(u)?;
    let claimer = redis::Claimer::new(token, lease, retention, fp);
    let fresh = claimer.fresh_record();
    assert_eq!(claimer.settle(&fresh), Some(Claim::Won { token: claimer.token(), attempt: 1, fence: None }));
    let other = redis::Claimer::new(token.wrapping_add(1), lease, retention, fp);
    assert_eq!(other.settle(&fresh), None, "another's live claim needs the script");
    let pttl: i64 = u.int_in_range(-1..=i64::MAX)?;
    let now: i64 = u.int_in_range(0..=i64::MAX)?;
    let read = |record: &[u8]| {
        let head = &record[..record.len().min(256)];
        redis::read(b"ns:id", head, record.len(), pttl, now)
            .unwrap_or_else(|| panic!("unreadable {:?}", record.escape_ascii().to_string()))
    };
    let record = read(&fresh);
    assert_eq!((record.state, record.attempts, record.result_len), (State::InProgress, 1, None));
    assert_eq!(record.fingerprint.as_deref(), Some(fp).filter(|&f| f != "-"));
    let held = retention - lease;
    let expected = Some(pttl - held as i64).filter(|&left| left > 0);
    assert_eq!(record.lease_left, expected.map(|ms| Duration::from_millis(ms as u64)));

    // FINISH_SCRIPT: the final state, the rest of the record, the result.
    let result: Vec<u8> = u.arbitrary()?;
    let done = u.arbitrary::<bool>()?;
    let mut finished = vec![if done { b'D' } else { b'F' }];
    finished.extend_from_slice(&fresh[1..]);
    finished.extend_from_slice(&result);
    let settled = other.settle(&finished);
    let expected = match (done, result.is_empty()) {
        (true, true) => Claim::Done,
        (true, false) => Claim::Cached(result.clone()),
        (false, _) => Claim::Failed { attempts: 1 },
    };
    assert_eq!(settled, Some(expected));
    let record = read(&finished);
    assert_eq!(record.state, if done { State::Done } else { State::Failed });
    assert_eq!(record.lease_left, None);
    if done {
        assert_eq!(record.result_len, (!result.is_empty()).then_some(result.len()));
    }
    // RELEASE_SCRIPT.
    let attempts: u32 = u.arbitrary()?;
    let released = format!("R- 0 {attempts} {fp} ");
    assert_eq!(other.settle(released.as_bytes()), None);
    let record = read(released.as_bytes());
    assert_eq!(
        (record.state, record.attempts, record.lease_left),
        (State::Released, attempts, None)
    );
    Ok(())
}

/// The admin's reading of whatever a key holds.
fn redis_read(u: &mut Unstructured<'_>) -> arbitrary::Result<()> {
    // PTTL is -1 (no expiry) or more (-2, no key, is answered before); the server's
    // time is not negative.
    let pttl: i64 = u.int_in_range(-1..=i64::MAX)?;
    let now: i64 = u.int_in_range(0..=i64::MAX)?;
    let stored: Vec<u8> = u.arbitrary()?;
    let record = rest(u);
    let head = &record[..record.len().min(256)];
    let Some(read) = redis::read(&stored, head, record.len(), pttl, now) else { return Ok(()) };
    assert_eq!(read.key, stored);
    assert_eq!(__fuzz::letter(read.state), record[0]);
    assert!(read.result_len.is_none_or(|n| n < record.len()));
    assert!(read.lease_left.is_none() || read.state == State::InProgress);
    Ok(())
}

fn redis_cursor(u: &mut Unstructured<'_>) -> arbitrary::Result<()> {
    if u.arbitrary()? {
        let text = rest_str(u);
        if let Ok(again) = redis::list_cursor(text) {
            assert_eq!(redis::list_cursor(&again).ok().as_ref(), Some(&again));
            // Number spellings such as `+1` or `01`, and empty pending entries, are
            // read too: a cursor is written back in its canonical form, which reads
            // as itself (above).
        }
    } else {
        let node: Option<u16> = u.arbitrary()?;
        let pending: Vec<Vec<u8>> = u.arbitrary()?;
        let pending: Vec<Vec<u8>> = pending.into_iter().filter(|k| !k.is_empty()).collect();
        let text = redis::encode_list_cursor(node, u.arbitrary()?, pending);
        assert_eq!(redis::list_cursor(&text).ok().as_ref(), Some(&text));
    }
    Ok(())
}

fn zookeeper_parse(u: &mut Unstructured<'_>) -> arbitrary::Result<()> {
    let data = rest(u);
    if let Some(fields) = zookeeper::parse(data) {
        let again = zookeeper::encode(fields.clone());
        assert_eq!(zookeeper::parse(&again), Some(fields));
        // The numbers and the token may be spelled otherwise (`+1`, `01`, upper-case
        // hex) than the store writes them; what it writes reads back byte for byte.
        assert_eq!(zookeeper::encode(zookeeper::parse(&again).unwrap()), again);
    }
    Ok(())
}

fn zookeeper_encode(u: &mut Unstructured<'_>) -> arbitrary::Result<()> {
    let fingerprint = if u.arbitrary()? {
        let bytes: [u8; 32] = u.arbitrary()?;
        Some(__fuzz::hex(&bytes))
    } else {
        None
    };
    let fields = zookeeper::Fields {
        state: __fuzz::letter(state(u)?),
        token: u.arbitrary()?,
        lease: u.arbitrary()?,
        keep: u.arbitrary()?,
        attempts: u.arbitrary()?,
        fingerprint,
        result: u.arbitrary()?,
    };
    assert_eq!(zookeeper::parse(&zookeeper::encode(fields.clone())), Some(fields));
    Ok(())
}

fn zookeeper_cursor(u: &mut Unstructured<'_>) -> arbitrary::Result<()> {
    let text = rest_str(u);
    if let Ok((bucket, child)) = zookeeper::list_cursor(text) {
        assert_eq!(format!("{bucket}/{child}"), text);
    }
    Ok(())
}

fn sql_rows(u: &mut Unstructured<'_>) -> arbitrary::Result<()> {
    // PostgreSQL: a `"char"` state, the claim statement's outcome.
    let row: (Vec<u8>, i8, i32, Option<i64>, i64, Option<Vec<u8>>, Option<i32>) = u.arbitrary()?;
    let letter = row.1 as u8;
    let key = row.0.clone();
    match postgres::record(row) {
        Ok(record) => {
            assert_eq!(Some(record.state), __fuzz::from_letter(letter));
            assert_eq!(__fuzz::letter(record.state), letter);
            assert_eq!(record.key, key);
            if let Ok(text) = std::str::from_utf8(&key) {
                let joined = match text.split_once(':') {
                    Some(_) => [record.namespace.as_bytes(), b":", &record.id].concat(),
                    None => record.namespace.clone().into_bytes(),
                };
                assert_eq!(joined, key);
            }
        }
        Err(_) => assert_eq!(__fuzz::from_letter(letter), None),
    }
    let outcome: String = u.arbitrary()?;
    let (attempts, result, lease_left): (i32, Option<Vec<u8>>, Option<i64>) = u.arbitrary()?;
    let token = Token::from_u128(u.arbitrary()?);
    if let Ok(claim) = postgres::claim(&outcome, attempts, result.clone(), lease_left, token) {
        assert!(["W", "D", "F", "P", "M"].contains(&outcome.as_str()));
        if let Claim::Cached(r) = &claim {
            assert_eq!(Some(r), result.as_ref());
        }
    }
    // MySQL: a `CHAR(1)` state read as bytes.
    let row: (Vec<u8>, Vec<u8>, i32, Option<i64>, i64, Option<Vec<u8>>, Option<i64>) =
        u.arbitrary()?;
    let letter = row.1.clone();
    match mysql::record(row) {
        Ok(record) => assert_eq!(vec![__fuzz::letter(record.state)], letter),
        Err(_) => assert!(letter.len() != 1 || __fuzz::from_letter(letter[0]).is_none()),
    }
    let letter = rest(u);
    match mysql::state(letter) {
        Ok(state) => assert_eq!([__fuzz::letter(state)].as_slice(), letter),
        Err(_) => assert!(letter.len() != 1 || __fuzz::from_letter(letter[0]).is_none()),
    }
    for state in State::ALL {
        assert_eq!(__fuzz::from_letter(__fuzz::letter(state)), Some(state));
    }
    Ok(())
}

fn hex_cursor(u: &mut Unstructured<'_>) -> arbitrary::Result<()> {
    let text = rest_str(u);
    if let Ok(bytes) = __fuzz::unhex(text) {
        let again = __fuzz::hex(&bytes);
        assert_eq!(__fuzz::unhex(&again).ok(), Some(bytes), "hex read back");
        if !text.contains('+') {
            assert_eq!(again, text.to_ascii_lowercase());
        }
    }
    Ok(())
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum Status {
    Accepted,
    Rejected { reason: String },
    Moved(u64, i8),
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Receipt {
    id: u64,
    name: String,
    amount: Option<f64>,
    lines: Vec<i32>,
    status: Status,
    #[serde(default)]
    tags: std::collections::BTreeMap<String, bool>,
    big: Option<u128>,
}

/// A cached result read as a `T`: what reads re-encodes to bytes that read the same
/// and re-encode to themselves; what the encoder keeps reads back.
fn cached<T>(bytes: &[u8])
where
    T: Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug,
{
    let cache = __fuzz::json_cache::<T>();
    let Some(Ok(value)) = cache.decode(bytes) else { return };
    let Ok(Some(encoded)) = cache.encode(&value) else { return };
    let back = cache.decode(&encoded).expect("a JSON cache decodes").expect("encoded reads back");
    assert_eq!(back, value);
    assert_eq!(cache.encode(&back), Ok(Some(encoded)));
}

fn result_cache(u: &mut Unstructured<'_>) -> arbitrary::Result<()> {
    let bytes = rest(u);
    cached::<Value>(bytes);
    cached::<Receipt>(bytes);
    cached::<String>(bytes);
    cached::<Vec<f64>>(bytes);
    cached::<(i64, Option<u128>, bool)>(bytes);
    Ok(())
}

/// Typed values the encoder keeps read back.
fn result_cache_encode(u: &mut Unstructured<'_>) -> arbitrary::Result<()> {
    #[derive(Arbitrary)]
    struct Input {
        id: u64,
        name: String,
        amount: Option<f64>,
        lines: Vec<i32>,
        reason: Option<String>,
        tags: Vec<(String, bool)>,
        big: Option<u128>,
    }
    let input = Input::arbitrary(u)?;
    let receipt = Receipt {
        id: input.id,
        name: input.name,
        amount: input.amount,
        lines: input.lines,
        status: match input.reason {
            Some(reason) => Status::Rejected { reason },
            None => Status::Accepted,
        },
        tags: input.tags.into_iter().collect(),
        big: input.big,
    };
    let cache = __fuzz::json_cache::<Receipt>();
    match cache.encode(&receipt) {
        Ok(Some(bytes)) => {
            let back = cache.decode(&bytes).unwrap().unwrap();
            // Only what reads back is kept: a non-finite amount is written `null`.
            assert_eq!(back, receipt);
        }
        Ok(None) => panic!("a JSON cache keeps results"),
        Err(_) => assert!(receipt.amount.is_some_and(|a| !a.is_finite())),
    }
    let value = serde_json::to_value(&receipt).ok();
    if let Some(value) = value {
        let cache = __fuzz::json_cache::<Value>();
        if let Ok(Some(bytes)) = cache.encode(&value) {
            assert_eq!(cache.decode(&bytes).unwrap().unwrap(), value);
        }
    }
    Ok(())
}

type Target = fn(&mut Unstructured<'_>) -> arbitrary::Result<()>;

const TARGETS: [Target; 11] = [
    redis_settle,
    redis_written,
    redis_read,
    redis_cursor,
    zookeeper_parse,
    zookeeper_encode,
    zookeeper_cursor,
    sql_rows,
    hex_cursor,
    result_cache,
    result_cache_encode,
];

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else { return };
    let mut u = Unstructured::new(rest);
    let _ = TARGETS[usize::from(pick) % TARGETS.len()](&mut u);
});
