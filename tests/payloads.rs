//! `{/json/pointer}` placeholders, `validate` and `cache` through the macro, on every
//! payload type, with the bad inputs a broker can deliver.

use std::sync::LazyLock;
use std::sync::atomic::{AtomicU32, Ordering};

use idempotent::serde_json::{Value, json};
use idempotent::{
    Disposition, Error, KeyError, MemoryStore, Outcome, Payload, PayloadRef, Unusable, idempotent,
};

static STORE: LazyLock<MemoryStore> = LazyLock::new(MemoryStore::new);
static RUNS: AtomicU32 = AtomicU32::new(0);

#[idempotent(key = "order:{/order/id}", store = STORE, namespace = "json_value")]
async fn from_value(msg: Value) -> u32 {
    let _ = msg;
    RUNS.fetch_add(1, Ordering::SeqCst)
}

#[tokio::test]
async fn values_are_keyed_by_pointer_and_numbers_canonically() {
    let first = from_value(json!({"order": {"id": 1}})).await.unwrap();
    assert!(first.is_processed());
    // 1 and 1.0 are the same number, so the same key.
    assert_eq!(from_value(json!({"order": {"id": 1.0}})).await.unwrap(), Outcome::Duplicate);
    assert!(from_value(json!({"order": {"id": "1x"}})).await.unwrap().is_processed());
}

#[idempotent(key = "{/id}", store = STORE, namespace = "bad_input")]
async fn from_bytes(msg: &[u8]) {
    let _ = msg;
    RUNS.fetch_add(1, Ordering::SeqCst);
}

#[tokio::test]
async fn bad_payloads_are_key_errors_that_run_nothing() {
    type Expect = fn(&KeyError) -> bool;
    let cases: [(&[u8], Expect); 8] = [
        (b"not json", |e| matches!(e, KeyError::NotJson { pointer: "/id", .. })),
        (b"", |e| matches!(e, KeyError::NotJson { .. })),
        (br#"{"other": 1}"#, |e| matches!(e, KeyError::Pointer { why: Unusable::Missing, .. })),
        (br#"{"id": null}"#, |e| matches!(e, KeyError::Pointer { why: Unusable::Null, .. })),
        (br#"{"id": ""}"#, |e| matches!(e, KeyError::Pointer { why: Unusable::EmptyString, .. })),
        (br#"{"id": true}"#, |e| matches!(e, KeyError::Pointer { why: Unusable::Bool, .. })),
        (br#"{"id": {"a": 1}}"#, |e| matches!(e, KeyError::Pointer { why: Unusable::Object, .. })),
        (br#"{"id": [1]}"#, |e| matches!(e, KeyError::Pointer { why: Unusable::Array, .. })),
    ];
    let before = RUNS.load(Ordering::SeqCst);
    for (payload, expected) in cases {
        let err = from_bytes(payload).await.unwrap_err();
        let Error::Key(key_error) = &err else { panic!("{err:?}") };
        assert!(expected(key_error), "{}: {key_error}", String::from_utf8_lossy(payload));
        assert_eq!(err.disposition(), Disposition::DeadLetter);
    }
    assert_eq!(RUNS.load(Ordering::SeqCst), before, "no handler ran");
    assert!(from_bytes(br#"{"id": "a b"}"#).await.unwrap().is_processed());
}

/// RFC 6901: `/` is the member named `""` of the root object; `/a//b` passes one.
#[idempotent(key = "root:{/}:{/a//b}", store = STORE, namespace = "empty_members")]
async fn empty_members(msg: &[u8]) {
    let _ = msg;
}

#[tokio::test]
async fn empty_member_names_are_pointers_like_any_other() {
    let doc = br#"{"": "r", "a": {"": {"b": 7}}}"#;
    assert!(empty_members(doc).await.unwrap().is_processed());
    assert_eq!(empty_members(doc).await.unwrap(), Outcome::Duplicate);
    let other = br#"{"": "r", "a": {"": {"b": 8}}}"#;
    assert!(empty_members(other).await.unwrap().is_processed(), "`/a//b` is part of the key");
    let err = empty_members(br#"{"a": {"": {"b": 7}}}"#).await.unwrap_err();
    assert!(
        matches!(&err, Error::Key(KeyError::Pointer { pointer: "/", why: Unusable::Missing })),
        "{err:?}"
    );
}

#[idempotent(key = "{/id}", store = STORE, namespace = "every_type")]
async fn from_string(msg: String) {}
#[idempotent(key = "{/id}", store = STORE, namespace = "every_type")]
async fn from_str(msg: &str) {}
#[idempotent(key = "{/id}", store = STORE, namespace = "every_type")]
async fn from_vec(msg: Vec<u8>) {}
#[idempotent(key = "{/id}", store = STORE, namespace = "every_type")]
async fn from_buf(msg: bytes::Bytes) {}

#[tokio::test]
async fn every_payload_type_renders_the_same_key() {
    let body = r#"{"id": 77}"#;
    assert!(from_string(body.to_owned()).await.unwrap().is_processed());
    assert_eq!(from_str(body).await.unwrap(), Outcome::Duplicate);
    assert_eq!(from_vec(body.as_bytes().to_vec()).await.unwrap(), Outcome::Duplicate);
    assert_eq!(
        from_buf(bytes::Bytes::from_static(br#"{"id":77}"#)).await.unwrap(),
        Outcome::Duplicate
    );
}

/// A broker delivery: typed metadata plus a JSON body; counts how often its payload is
/// read.
struct Delivery {
    tenant: &'static str,
    body: Vec<u8>,
    reads: AtomicU32,
}

impl Payload for Delivery {
    fn payload(&self) -> PayloadRef<'_> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        PayloadRef::Bytes(&self.body)
    }
}

#[idempotent(key = "{tenant}/{/order/id}/{/order/line}", store = STORE, validate = true)]
async fn mixed(msg: &Delivery) -> Result<(), std::io::Error> {
    Ok(())
}

#[tokio::test]
async fn typed_fields_and_pointers_mix_and_the_payload_is_parsed_once() {
    let delivery = |body: &str| Delivery {
        tenant: "acme",
        body: body.as_bytes().to_vec(),
        reads: AtomicU32::new(0),
    };
    let first = delivery(r#"{"order": {"id": 5, "line": 2}, "amount": 10}"#);
    assert!(mixed(&first).await.unwrap().is_processed());
    // Once for the two pointers, once for the fingerprint.
    assert_eq!(first.reads.load(Ordering::SeqCst), 2);
    let same = delivery(r#"{"order": {"id": 5, "line": 2}, "amount": 10}"#);
    assert_eq!(mixed(&same).await.unwrap(), Outcome::Duplicate);
    let changed = delivery(r#"{"order": {"id": 5, "line": 2}, "amount": 99}"#);
    let err = mixed(&changed).await.unwrap_err();
    assert!(matches!(err, Error::PayloadMismatch), "{err}");
    assert_eq!(err.disposition(), Disposition::DeadLetter);
}

#[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct Receipt {
    order: u64,
    charged_cents: i64,
}

static CHARGES: AtomicU32 = AtomicU32::new(0);

#[idempotent(key = "{/order}", store = STORE, cache)]
async fn charge(msg: Value) -> Result<Receipt, std::io::Error> {
    CHARGES.fetch_add(1, Ordering::SeqCst);
    Ok(Receipt { order: msg["order"].as_u64().unwrap_or(0), charged_cents: 500 })
}

#[tokio::test]
async fn cached_results_are_replayed_to_duplicates() {
    let receipt = Receipt { order: 9, charged_cents: 500 };
    assert_eq!(
        charge(json!({"order": 9})).await.unwrap(),
        Outcome::Processed(Receipt { ..receipt })
    );
    let again = charge(json!({"order": 9})).await.unwrap();
    assert_eq!(again, Outcome::Replayed(Receipt { order: 9, charged_cents: 500 }));
    assert_eq!(again.disposition(), Disposition::Ack);
    assert_eq!(CHARGES.load(Ordering::SeqCst), 1);
}

#[idempotent(key = "{/id}", store = STORE, namespace = "numbers")]
async fn by_number(msg: &[u8]) {
    let _ = msg;
}

#[tokio::test]
async fn numbers_keep_every_digit_and_equal_numbers_share_a_key() {
    // Beyond 64 bits, and beyond an f64's precision: different numbers, different keys.
    for body in [
        r#"{"id": 18446744073709551616}"#,
        r#"{"id": 18446744073709551617}"#,
        r#"{"id": -9223372036854775809}"#,
        r#"{"id": -9223372036854775810}"#,
        r#"{"id": 0.1}"#,
        r#"{"id": 0.1000000000000000055511151231257827}"#,
        r#"{"id": 1e400}"#,
        r#"{"id": 1e401}"#,
    ] {
        assert!(by_number(body.as_bytes()).await.unwrap().is_processed(), "{body}");
    }
    // The same number written another way is the same key.
    assert!(by_number(br#"{"id": 100}"#).await.unwrap().is_processed());
    for body in [r#"{"id":100.0}"#, r#"{"id":1e2}"#, r#"{"id":1000E-1}"#, r#"{"id":0.01e4}"#] {
        assert_eq!(by_number(body.as_bytes()).await.unwrap(), Outcome::Duplicate, "{body}");
    }
    assert!(by_number(br#"{"id": 0}"#).await.unwrap().is_processed());
    assert_eq!(by_number(br#"{"id": -0.0}"#).await.unwrap(), Outcome::Duplicate);
    // A hostile exponent neither allocates its digits nor collapses with a neighbour.
    assert!(by_number(br#"{"id": 1e999999999}"#).await.unwrap().is_processed());
    assert!(by_number(br#"{"id": 1e999999998}"#).await.unwrap().is_processed());
    assert_eq!(by_number(br#"{"id": 10e999999998}"#).await.unwrap(), Outcome::Duplicate);
}

#[idempotent(key = "{/id}", store = STORE, namespace = "string_then_number")]
async fn string_then_number(msg: &[u8]) {
    let _ = msg;
}

#[idempotent(key = "{/id}", store = STORE, namespace = "number_then_string")]
async fn number_then_string(msg: Value) {
    let _ = msg;
}

/// A string is taken as it is and a number in its canonical form, so a producer that
/// sends an id as `"7"` on one delivery and `7` on the next is deduplicated.
#[tokio::test]
async fn a_string_and_a_number_with_the_same_text_share_a_key() {
    assert!(string_then_number(br#"{"id": "7"}"#).await.unwrap().is_processed());
    assert_eq!(string_then_number(br#"{"id": 7.0}"#).await.unwrap(), Outcome::Duplicate);
    assert!(number_then_string(json!({"id": 7})).await.unwrap().is_processed());
    assert_eq!(number_then_string(json!({"id": "7"})).await.unwrap(), Outcome::Duplicate);
    // Only the canonical text: "7.0" is another string than 7's.
    assert!(number_then_string(json!({"id": "7.0"})).await.unwrap().is_processed());
}

#[idempotent(key = "{/id}", store = STORE, namespace = "validated_value", validate = true)]
async fn validated(msg: Value) {
    let _ = msg;
}

/// A redelivery re-serialised by its producer is the same payload: `validate`
/// fingerprints numbers by the rule keys use.
#[tokio::test]
async fn fingerprints_read_numbers_like_keys_do() {
    let parse = |s: &str| idempotent::serde_json::from_str::<Value>(s).unwrap();
    assert!(
        validated(parse(r#"{"id": 1, "amount": 100, "rate": 0.0}"#)).await.unwrap().is_processed()
    );
    for same in
        [r#"{"id": 1.0, "amount": 100.0, "rate": -0.0}"#, r#"{"rate": 0, "amount": 1e2, "id": 1}"#]
    {
        assert_eq!(validated(parse(same)).await.unwrap(), Outcome::Duplicate, "{same}");
    }
    let err = validated(parse(r#"{"id": 1, "amount": 101, "rate": 0}"#)).await.unwrap_err();
    assert!(matches!(err, Error::PayloadMismatch), "{err}");
}

#[idempotent(key = "{/id}", store = STORE, namespace = "hostile", validate = true)]
async fn hostile(msg: &[u8], runs: &AtomicU32) {
    let _ = msg;
    runs.fetch_add(1, Ordering::SeqCst);
}

/// A payload of 100 MB with its id after the bulk: keyed (the whole text is checked)
/// and fingerprinted once, a duplicate recognised, a one-byte change refused, and a
/// truncated copy a key error. Nothing is copied per call beyond the key.
#[tokio::test]
async fn a_100_mb_payload_is_keyed_fingerprinted_and_refused_when_changed_or_cut() {
    let bulk = 100 << 20;
    let mut payload = Vec::with_capacity(bulk + 64);
    payload.extend_from_slice(br#"{"bulk": ""#);
    payload.resize(payload.len() + bulk, b'x');
    payload.extend_from_slice(br#"", "id": "order-100mb"}"#);
    let runs = AtomicU32::new(0);
    assert!(hostile(&payload, &runs).await.unwrap().is_processed());
    assert_eq!(hostile(&payload, &runs).await.unwrap(), Outcome::Duplicate);
    let middle = payload.len() / 2;
    payload[middle] = b'y';
    let changed = hostile(&payload, &runs).await.unwrap_err();
    assert!(matches!(changed, Error::PayloadMismatch), "{changed}");
    let cut = hostile(&payload[..payload.len() - 2], &runs).await.unwrap_err();
    assert!(matches!(cut, Error::Key(KeyError::NotJson { .. })), "{cut}");
    assert_eq!(cut.disposition(), Disposition::DeadLetter);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// JSON nested 10,000 deep, as arrays and as objects, beside the id or holding it:
/// walked without recursion, so no stack overflow; the id beside it keys the message,
/// a container where the id should be is a key error.
#[tokio::test]
async fn json_nested_10000_deep_neither_overflows_nor_hides_the_id() {
    let depth = 10_000;
    let arrays = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
    let objects = format!("{}1{}", r#"{"a":"#.repeat(depth), "}".repeat(depth));
    let runs = AtomicU32::new(0);
    for (i, deep) in [&arrays, &objects].into_iter().enumerate() {
        let beside = format!(r#"{{"deep": {deep}, "id": "deep-{i}"}}"#);
        assert!(hostile(beside.as_bytes(), &runs).await.unwrap().is_processed(), "{i}");
        assert_eq!(hostile(beside.as_bytes(), &runs).await.unwrap(), Outcome::Duplicate);
        let holding = format!(r#"{{"id": {deep}}}"#);
        let err = hostile(holding.as_bytes(), &runs).await.unwrap_err();
        let Error::Key(KeyError::Pointer { why, .. }) = &err else { panic!("{err}") };
        assert!(matches!(why, Unusable::Array | Unusable::Object), "{why:?}");
        assert_eq!(err.disposition(), Disposition::DeadLetter);
        // Unbalanced: one bracket short, at the bottom of the nesting.
        let unbalanced = format!(r#"{{"id": "x", "deep": {}}}"#, &deep[1..]);
        let err = hostile(unbalanced.as_bytes(), &runs).await.unwrap_err();
        assert!(matches!(err, Error::Key(KeyError::NotJson { .. })), "{err}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// A payload that is not UTF-8, or a key string escaping what no text can hold (a lone
/// surrogate): a key error naming the pointer, never a lossy key that another message
/// could share.
#[tokio::test]
async fn invalid_utf8_and_lone_surrogates_are_key_errors() {
    let runs = AtomicU32::new(0);
    for payload in [
        &b"{\"id\": \"a\xffb\"}"[..],
        b"{\"id\": \"\xed\xa0\x80\"}",
        br#"{"id": "\ud800"}"#,
        br#"{"id": "a\udc00b"}"#,
        b"{\"id\": \"ok\", \"other\": \"\xc0\xaf\"}",
        b"\xef\xbb\xbf{\"id\": \"bom\"}",
    ] {
        let err = hostile(payload, &runs).await.unwrap_err();
        let Error::Key(KeyError::NotJson { pointer, reason }) = &err else {
            panic!("{}: {err}", payload.escape_ascii())
        };
        assert_eq!(*pointer, "/id");
        assert!(!reason.is_empty());
        assert_eq!(err.disposition(), Disposition::DeadLetter);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    // Elsewhere in the document an escape is checked for its syntax only, as
    // serde_json skips values: the key does not depend on it.
    let skipped = br#"{"id": "lone elsewhere", "other": "\udfff"}"#;
    assert!(hostile(skipped, &runs).await.unwrap().is_processed());
    // A surrogate pair is one character, and keys like the character written out:
    // the same key, whose other bytes `validate` then refuses.
    assert!(hostile(br#"{"id": "\ud83d\ude00"}"#, &runs).await.unwrap().is_processed());
    let written_out = hostile("{\"id\": \"\u{1F600}\"}".as_bytes(), &runs).await;
    assert!(matches!(written_out, Err(Error::PayloadMismatch)), "{written_out:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}
