//! `{/json/pointer}` placeholders (`KeyBuilder::pointer`, as the macro expansion calls
//! it) on arbitrary documents and pointers. Input: the pointer, a newline, the
//! document.
//!
//! Invariants: nothing panics; the same document and pointer give the same key, and
//! the same whether the document is given as bytes, as a `&str` or (when serde_json
//! parses it) as the `serde_json::Value` re-serialized; the `Value` payload itself
//! gives the same key or, for a number it rounded, `Imprecise`/a float's own text; a
//! number keys by its value: its canonical text keys the same, and so do `1e0`-style,
//! `E+0`, `.0` and shifted-exponent spellings of it, and so does the string of its
//! canonical text (documented: `"7"` and `7` share a key).

#![no_main]

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};

use idempotent_runtime::serde_json::{self, Value};
use idempotent_runtime::{Document, Key, KeyBuilder, KeyError};
use libfuzzer_sys::fuzz_target;

/// Pointers must be `'static` (the macro passes literals): each distinct one is
/// leaked once, and kept reachable here, up to a bound.
static POINTERS: LazyLock<Mutex<HashMap<String, &'static str>>> = LazyLock::new(Mutex::default);

fn intern(pointer: &str) -> Option<&'static str> {
    let mut map = POINTERS.lock().unwrap();
    if let Some(p) = map.get(pointer) {
        return Some(*p);
    }
    if map.len() >= 200_000 {
        return None;
    }
    let leaked: &'static str = Box::leak(pointer.to_owned().into_boxed_str());
    map.insert(pointer.to_owned(), leaked);
    Some(leaked)
}

fn key(pointer: &'static str, document: &Document<'_>) -> Result<Key, KeyError> {
    let mut key = KeyBuilder::new("ns");
    key.pointer(pointer, document);
    key.finish()
}

/// The id two placeholders at `pointer` render, separated by `:`.
fn pair(pointer: &'static str, document: &Document<'_>) -> Result<Key, KeyError> {
    let mut key = KeyBuilder::new("ns");
    key.text("k:");
    key.pointer(pointer, document);
    key.text(":");
    key.pointer(pointer, document);
    key.finish()
}

fn number_key(text: &str) -> Result<Key, KeyError> {
    let document = format!("[{text}]");
    key("/0", &Document::of(document.as_str()))
}

/// Other spellings of the value whose canonical text is `canonical`.
fn spellings(canonical: &str) -> Vec<String> {
    if canonical == "0" {
        return ["0.0", "-0", "0e5", "0E-7", "-0.000e+3"].map(str::to_owned).to_vec();
    }
    let (sign, unsigned) = match canonical.strip_prefix('-') {
        Some(rest) => ("-", rest),
        None => ("", canonical),
    };
    // The value is `digits × 10^scale`.
    let (digits, scale): (String, i128) = match unsigned.split_once('e') {
        Some((digits, scale)) => (digits.to_owned(), scale.parse().unwrap()),
        None => match unsigned.split_once('.') {
            Some((int, frac)) => {
                let digits = format!("{int}{frac}");
                (digits.trim_start_matches('0').to_owned(), -(frac.len() as i128))
            }
            None => {
                let digits = unsigned.trim_end_matches('0');
                (digits.to_owned(), (unsigned.len() - digits.len()) as i128)
            }
        },
    };
    let len = digits.len() as i128;
    let exponent = |k: i128| if k >= 0 { format!("E+{k}") } else { format!("E{k}") };
    // An exponent is read as a 64-bit integer (documented): spellings whose exponent
    // does not fit are left out.
    let fits = |k: i128| i64::try_from(k).is_ok();
    [
        (scale, format!("{sign}{digits}e{scale}")),
        (scale, format!("{sign}{digits}{}", exponent(scale))),
        (scale - 1, format!("{sign}{digits}0e{}", scale - 1)),
        (scale, format!("{sign}{digits}.000e{scale}")),
        (scale + len, format!("{sign}0.{digits}e{}", scale + len)),
        (scale + len + 2, format!("{sign}0.00{digits}E{}", scale + len + 2)),
    ]
    .into_iter()
    .filter(|(k, _)| fits(*k))
    .map(|(_, text)| text)
    .collect()
}

fuzz_target!(|data: &[u8]| {
    let (pointer, body) = match data.iter().position(|&b| b == b'\n') {
        Some(at) => (&data[..at], &data[at + 1..]),
        None => (&b"/id"[..], data),
    };
    let Ok(pointer) = std::str::from_utf8(pointer) else { return };
    let Some(pointer) = intern(pointer) else { return };

    let document = Document::of(body);
    let first = key(pointer, &document);
    assert_eq!(first, key(pointer, &document), "same document, same key");
    assert_eq!(first, key(pointer, &Document::of(&body.to_vec())));
    if let Ok(text) = std::str::from_utf8(body) {
        assert_eq!(first, key(pointer, &Document::of(text)), "bytes and str agree");
    }
    let both = pair(pointer, &document);
    assert_eq!(both, pair(pointer, &document));
    assert_eq!(both.is_ok(), first.is_ok());
    if let (Ok(one), Ok(two)) = (&first, &both) {
        let id = one.id();
        // The first value is followed by `:`: it is percent-encoded, the second not.
        assert!(two.id().starts_with(b"k:") && two.id().ends_with(id));
        if !id.contains(&b'%') && !id.contains(&b':') {
            let expected = [b"k:", id, b":", id].concat();
            assert_eq!(two.id(), expected.as_slice());
        }
    }

    // A payload serde_json parsed agrees with its own text.
    if let Ok(value) = serde_json::from_slice::<Value>(body) {
        let text = value.to_string();
        let from_value = key(pointer, &Document::of(&value));
        let from_text = key(pointer, &Document::of(text.as_str()));
        match (&from_value, &from_text) {
            (Err(KeyError::Pointer { why, .. }), Ok(_))
                if *why == idempotent_runtime::Unusable::Imprecise => {}
            _ => assert_eq!(from_value, from_text, "{text} at {pointer}"),
        }
    }

    // A number keys by its value.
    let Ok(first) = first else { return };
    let found =
        serde_json::from_slice::<Value>(body).ok().and_then(|v| v.pointer(pointer).cloned());
    if !matches!(found, Some(Value::Number(_))) {
        return;
    }
    let canonical = std::str::from_utf8(first.id()).unwrap().to_owned();
    assert_eq!(number_key(&canonical).as_ref(), Ok(&first), "canonical text is a fixed point");
    let as_string = Value::String(canonical.clone()).to_string();
    assert_eq!(number_key(&as_string).as_ref(), Ok(&first), "\"7\" and 7 share a key");
    for spelling in spellings(&canonical) {
        assert_eq!(number_key(&spelling).as_ref(), Ok(&first), "{canonical} as {spelling}");
    }
    // And the number as the document wrote it, spelled otherwise.
    if let Some(Value::Number(n)) = &found {
        // serde_json's own text of the parsed number (an f64 for non-integers) is a
        // different number only when it rounded.
        let own = n.to_string();
        if n.is_u64() || n.is_i64() {
            assert_eq!(number_key(&own).as_ref(), Ok(&first), "{own}");
        }
    }
});
