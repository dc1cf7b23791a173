//! Message payloads: `{/json/pointer}` key placeholders and `validate = true`
//! fingerprints.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use serde::de::{
    Deserialize, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor,
};
use serde_json::Value;
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

use crate::json_number;

/// A message payload as the runtime sees it.
#[derive(Debug, Clone, Copy)]
pub enum PayloadRef<'a> {
    /// Already-parsed JSON.
    Json(&'a Value),
    /// Raw bytes, parsed as JSON when a `{/json/pointer}` placeholder needs it.
    Bytes(&'a [u8]),
}

/// A message whose payload `{/json/pointer}` key placeholders read, and which
/// `validate = true` fingerprints.
///
/// Implemented for `serde_json::Value`, `[u8]`, `Vec<u8>`, `str`, `String`,
/// `bytes::Bytes` and references, boxes and `Arc`s of those. Implement it for a
/// broker's message type by returning its body:
///
/// ```
/// use idempotent_runtime::{Payload, PayloadRef};
///
/// struct Delivery { body: Vec<u8>, redelivered: bool }
///
/// impl Payload for Delivery {
///     fn payload(&self) -> PayloadRef<'_> {
///         PayloadRef::Bytes(&self.body)
///     }
/// }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a payload that `{{/json/pointer}}` placeholders or `validate` can read",
    note = "implement `idempotent::Payload` for it (return its body), or use a message of type `serde_json::Value`, `&[u8]`, `Vec<u8>`, `&str`, `String` or `bytes::Bytes`"
)]
pub trait Payload {
    /// The payload.
    fn payload(&self) -> PayloadRef<'_>;
}

impl Payload for Value {
    fn payload(&self) -> PayloadRef<'_> {
        PayloadRef::Json(self)
    }
}

impl Payload for [u8] {
    fn payload(&self) -> PayloadRef<'_> {
        PayloadRef::Bytes(self)
    }
}

impl Payload for Vec<u8> {
    fn payload(&self) -> PayloadRef<'_> {
        PayloadRef::Bytes(self)
    }
}

impl Payload for str {
    fn payload(&self) -> PayloadRef<'_> {
        PayloadRef::Bytes(self.as_bytes())
    }
}

impl Payload for String {
    fn payload(&self) -> PayloadRef<'_> {
        PayloadRef::Bytes(self.as_bytes())
    }
}

impl Payload for bytes::Bytes {
    fn payload(&self) -> PayloadRef<'_> {
        PayloadRef::Bytes(self)
    }
}

impl<T: Payload + ?Sized> Payload for &T {
    fn payload(&self) -> PayloadRef<'_> {
        (**self).payload()
    }
}

impl<T: Payload + ?Sized> Payload for Box<T> {
    fn payload(&self) -> PayloadRef<'_> {
        (**self).payload()
    }
}

impl<T: Payload + ?Sized> Payload for Arc<T> {
    fn payload(&self) -> PayloadRef<'_> {
        (**self).payload()
    }
}

/// A call's payload, read by all of a key's pointer placeholders; see
/// [`KeyBuilder::pointer`](crate::KeyBuilder::pointer).
///
/// A byte payload is not turned into a `serde_json::Value`: each pointer walks the
/// JSON text to its value, so numbers keep every digit (see
/// [`KeyBuilder::pointer`](crate::KeyBuilder::pointer) for how they render).
///
/// ```
/// use idempotent_runtime::{Document, KeyBuilder};
///
/// let body = br#"{"order": {"id": 42}}"#;
/// let document = Document::of(&body[..]);
/// let mut key = KeyBuilder::new("orders");
/// key.pointer("/order/id", &document);
/// assert_eq!(key.finish().unwrap().as_bytes(), b"orders:42");
/// ```
pub struct Document<'a> {
    source: Source<'a>,
}

enum Source<'a> {
    Value(&'a Value),
    Text(&'a str),
    NotUtf8(std::str::Utf8Error),
}

/// Why a pointer gave no key part.
pub(crate) enum PointerError {
    /// The payload is not JSON.
    NotJson(String),
    /// The payload is JSON, but the value at the pointer is not a key part.
    Unusable(Unusable),
}

impl<'a> Document<'a> {
    /// Reads `payload`'s body once; the pointers then read the document.
    pub fn of<P: Payload + ?Sized>(payload: &'a P) -> Document<'a> {
        let source = match payload.payload() {
            PayloadRef::Json(value) => Source::Value(value),
            PayloadRef::Bytes(bytes) => match std::str::from_utf8(bytes) {
                Ok(text) => Source::Text(text),
                Err(e) => Source::NotUtf8(e),
            },
        };
        Document { source }
    }

    /// Appends the key part at `pointer` to `out`.
    pub(crate) fn render(&self, pointer: &str, out: &mut String) -> Result<(), PointerError> {
        match &self.source {
            Source::NotUtf8(e) => Err(PointerError::NotJson(e.to_string())),
            Source::Value(value) => {
                render_value(value.pointer(pointer), out).map_err(PointerError::Unusable)
            }
            Source::Text(text) => {
                // Not a pointer (RFC 6901: empty, or `/` first): nothing, as
                // `Value::pointer` answers, rather than the whole document.
                if !pointer.is_empty() && !pointer.starts_with('/') {
                    return Err(PointerError::Unusable(Unusable::Missing));
                }
                let tokens: Vec<Cow<'_, str>> = pointer.split('/').skip(1).map(unescape).collect();
                let mut de = serde_json::Deserializer::from_str(text);
                let found = At(&tokens).deserialize(&mut de).and_then(|found| {
                    de.end()?;
                    Ok(found)
                });
                match found {
                    Err(e) => Err(PointerError::NotJson(e.to_string())),
                    Ok(None) => Err(PointerError::Unusable(Unusable::Missing)),
                    Ok(Some(raw)) => render_raw(raw.get(), out),
                }
            }
        }
    }
}

/// One RFC 6901 reference token, unescaped.
fn unescape(token: &str) -> Cow<'_, str> {
    if token.contains('~') {
        Cow::Owned(token.replace("~1", "/").replace("~0", "~"))
    } else {
        Cow::Borrowed(token)
    }
}

/// An array index as RFC 6901 writes it: digits, no leading zero.
fn index(token: &str) -> Option<usize> {
    if token.starts_with('+') || (token.starts_with('0') && token.len() > 1) {
        return None;
    }
    token.parse().ok()
}

/// Walks the JSON text along the remaining tokens in one pass: the value at their end,
/// unparsed, or `None` when nothing is there. Everything else is checked and skipped.
/// Of an object's repeated keys the last counts, as in a `serde_json::Value`.
struct At<'t>(&'t [Cow<'t, str>]);

impl<'de> DeserializeSeed<'de> for At<'_> {
    type Value = Option<&'de RawValue>;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Self::Value, D::Error> {
        match self.0.split_first() {
            None => <&RawValue>::deserialize(de).map(Some),
            Some((token, rest)) => de.deserialize_any(Step { token, rest }),
        }
    }
}

struct Step<'t> {
    token: &'t str,
    rest: &'t [Cow<'t, str>],
}

impl<'de> Visitor<'de> for Step<'_> {
    type Value = Option<&'de RawValue>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut found = None;
        while let Some(matches) = map.next_key_seed(KeyIs(self.token))? {
            if matches {
                found = map.next_value_seed(At(self.rest))?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(found)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut found = None;
        let wanted = index(self.token);
        let mut i = 0;
        loop {
            if Some(i) == wanted {
                match seq.next_element_seed(At(self.rest))? {
                    Some(value) => found = value,
                    None => break,
                }
            } else if seq.next_element::<IgnoredAny>()?.is_none() {
                break;
            }
            i += 1;
        }
        Ok(found)
    }

    // A scalar has nothing under it.
    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}

/// Whether an object key, unescaped, is the token.
struct KeyIs<'t>(&'t str);

impl<'de> DeserializeSeed<'de> for KeyIs<'_> {
    type Value = bool;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<bool, D::Error> {
        de.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeyIs<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }

    fn visit_str<E>(self, key: &str) -> Result<bool, E> {
        Ok(key == self.0)
    }
}

/// Why a JSON pointer gave no usable key part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Unusable {
    /// Nothing at the pointer.
    Missing,
    /// `null`.
    Null,
    /// `""`.
    EmptyString,
    /// `true` or `false`: two values cannot tell messages apart.
    Bool,
    /// An object.
    Object,
    /// An array.
    Array,
    /// A number whose exponent does not fit in 64 bits.
    OutOfRange,
    /// In a `serde_json::Value` payload, an integer of 2^64 or more: serde_json held
    /// it as an `f64` when the payload was parsed, rounded, so ids that differ in
    /// their last digits would share a key. Pass the payload's bytes instead (they
    /// keep every digit), or enable serde_json's `arbitrary_precision`.
    Imprecise,
}

impl fmt::Display for Unusable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Unusable::Missing => "nothing is there",
            Unusable::Null => "it is null",
            Unusable::EmptyString => "it is an empty string",
            Unusable::Bool => "it is a boolean, which cannot tell messages apart",
            Unusable::Object => "it is an object, not a string or a number",
            Unusable::Array => "it is an array, not a string or a number",
            Unusable::OutOfRange => "it is a number whose exponent does not fit in 64 bits",
            Unusable::Imprecise => {
                "it is an integer beyond 64 bits that serde_json rounded to a float when the \
                 payload was parsed; pass the payload as bytes, or enable serde_json's \
                 `arbitrary_precision`, to key on it"
            }
        })
    }
}

/// Renders a parsed value as a key part: a string as it is, a number canonically.
fn render_value(value: Option<&Value>, out: &mut String) -> Result<(), Unusable> {
    match value {
        None => Err(Unusable::Missing),
        Some(Value::Null) => Err(Unusable::Null),
        Some(Value::Bool(_)) => Err(Unusable::Bool),
        Some(Value::Object(_)) => Err(Unusable::Object),
        Some(Value::Array(_)) => Err(Unusable::Array),
        Some(Value::String(s)) if s.is_empty() => Err(Unusable::EmptyString),
        Some(Value::String(s)) => {
            out.push_str(s);
            Ok(())
        }
        Some(Value::Number(n)) => {
            // Without `arbitrary_precision`, an integer beyond 64 bits is held as an
            // f64, rounded: ids that differ in their last digits would share a key.
            let float = n.as_f64().filter(|_| n.is_f64() && !json_number::exact_values());
            if float.is_some_and(|f| f.fract() == 0.0 && f.abs() >= 18_446_744_073_709_551_616.0) {
                return Err(Unusable::Imprecise);
            }
            json_number::canonical_value(n, out).map_err(|_| Unusable::OutOfRange)
        }
    }
}

/// Renders a value's JSON text (its syntax checked) as a key part, by the same rule.
fn render_raw(raw: &str, out: &mut String) -> Result<(), PointerError> {
    let raw = raw.trim_start();
    let unusable = |why| Err(PointerError::Unusable(why));
    match raw.as_bytes().first() {
        Some(b'"') => {
            // The walk checked the string's syntax, not what its escapes encode: a
            // lone surrogate (`\ud800`) is no text, as serde_json says when decoding.
            let s: Cow<'_, str> =
                serde_json::from_str(raw).map_err(|e| PointerError::NotJson(e.to_string()))?;
            if s.is_empty() {
                return unusable(Unusable::EmptyString);
            }
            out.push_str(&s);
            Ok(())
        }
        Some(b'{') => unusable(Unusable::Object),
        Some(b'[') => unusable(Unusable::Array),
        Some(b't' | b'f') => unusable(Unusable::Bool),
        Some(b'n') => unusable(Unusable::Null),
        _ => json_number::canonical(raw.trim_end(), out)
            .map_err(|_| PointerError::Unusable(Unusable::OutOfRange)),
    }
}

/// A SHA-256 fingerprint of a payload, stored with a claim under `validate = true`.
///
/// JSON values (`serde_json::Value`) are hashed over their canonical form: compact,
/// object keys sorted by their UTF-8 bytes, numbers by the rule keys use
/// ([`KeyBuilder::pointer`](crate::KeyBuilder::pointer)), so `100`, `100.0` and `1e2`
/// agree. A value is what the handler reads: payloads that parse to the same value
/// (escape forms, a repeated key whose last occurrence is the same) have one
/// fingerprint.
/// Byte payloads (`&[u8]`, `Vec<u8>`, strings, `Bytes`, broker bodies) are hashed as
/// they are: a redelivery carries the same bytes.
///
/// ```
/// use idempotent_runtime::Fingerprint;
/// use idempotent_runtime::serde_json::json;
///
/// let a = Fingerprint::of(&json!({"id": 7, "amount": 500}));
/// let b = Fingerprint::of(&json!({"amount": 500, "id": 7}));
/// assert_eq!(a, b, "key order does not matter for JSON values");
/// assert_ne!(Fingerprint::of(&b"{\"id\":7}"[..]), Fingerprint::of(&b"{\"id\": 7}"[..]));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The fingerprint of `payload`.
    pub fn of<P: Payload + ?Sized>(payload: &P) -> Fingerprint {
        let mut hasher = Sha256::new();
        match payload.payload() {
            PayloadRef::Bytes(bytes) => hasher.update(bytes),
            PayloadRef::Json(value) => canonical(value, &mut hasher),
        }
        Fingerprint(hasher.finalize().into())
    }

    /// From stored bytes.
    pub const fn from_bytes(bytes: [u8; 32]) -> Fingerprint {
        Fingerprint(bytes)
    }

    /// The 32 bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

/// 64 lowercase hex digits.
impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({self})")
    }
}

fn canonical(value: &Value, hasher: &mut Sha256) {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            hasher.update(b"{");
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    hasher.update(b",");
                }
                hasher.update(Value::String(k.clone()).to_string().as_bytes());
                hasher.update(b":");
                canonical(v, hasher);
            }
            hasher.update(b"}");
        }
        Value::Array(items) => {
            hasher.update(b"[");
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    hasher.update(b",");
                }
                canonical(v, hasher);
            }
            hasher.update(b"]");
        }
        Value::Number(n) => {
            let mut text = String::new();
            match json_number::canonical_value(n, &mut text) {
                Ok(()) => hasher.update(text.as_bytes()),
                Err(_) => hasher.update(n.to_string().as_bytes()),
            }
        }
        scalar => hasher.update(scalar.to_string().as_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The key part at `pointer`, read from the value and from its JSON text, which
    /// must agree.
    fn part(doc: &Value, pointer: &str) -> Result<String, Unusable> {
        let read = |document: Document<'_>| {
            let mut out = String::new();
            match document.render(pointer, &mut out) {
                Ok(()) => Ok(out),
                Err(PointerError::Unusable(why)) => Err(why),
                Err(PointerError::NotJson(reason)) => panic!("{reason}"),
            }
        };
        let text = doc.to_string();
        let from_value = read(Document::of(doc));
        assert_eq!(from_value, read(Document::of(&text)), "{text} at {pointer}");
        from_value
    }

    #[test]
    fn pointers_render_scalars_canonically_and_refuse_the_rest() {
        let doc = json!({"a": {"b": "x", "n": 1, "f": 1.0, "g": 1.5, "big": 18446744073709551615u64},
                         "null": null, "empty": "", "t": true, "o": {}, "l": [1], "a~b": "tilde", "c/d": "slash"});
        assert_eq!(part(&doc, "/a/b"), Ok("x".into()));
        assert_eq!(part(&doc, "/a/n"), Ok("1".into()));
        assert_eq!(part(&doc, "/a/f"), Ok("1".into()), "1 and 1.0 are one key");
        assert_eq!(part(&doc, "/a/g"), Ok("1.5".into()));
        assert_eq!(part(&doc, "/a/big"), Ok("18446744073709551615".into()));
        assert_eq!(part(&doc, "/a~0b"), Ok("tilde".into()));
        assert_eq!(part(&doc, "/c~1d"), Ok("slash".into()));
        assert_eq!(part(&doc, "/nope"), Err(Unusable::Missing));
        assert_eq!(part(&doc, "/null"), Err(Unusable::Null));
        assert_eq!(part(&doc, "/empty"), Err(Unusable::EmptyString));
        assert_eq!(part(&doc, "/t"), Err(Unusable::Bool));
        assert_eq!(part(&doc, "/o"), Err(Unusable::Object));
        assert_eq!(part(&doc, "/l"), Err(Unusable::Array));
    }

    fn text_part(text: &str, pointer: &str) -> Result<String, String> {
        let mut out = String::new();
        match Document::of(text).render(pointer, &mut out) {
            Ok(()) => Ok(out),
            Err(PointerError::Unusable(why)) => Err(why.to_string()),
            Err(PointerError::NotJson(reason)) => Err(format!("not JSON: {reason}")),
        }
    }

    /// A `Value` payload's integers beyond 64 bits went through an f64 when it was
    /// parsed: they are refused rather than allowed to share a key. (Smaller numbers
    /// that are not 64-bit integers are taken as serde_json parsed them.)
    #[test]
    fn rounded_integers_in_values_are_refused() {
        let parse = |s: &str| serde_json::from_str::<Value>(s).unwrap();
        let value_part = |doc: &Value| {
            let mut out = String::new();
            match Document::of(doc).render("/id", &mut out) {
                Ok(()) => Ok(out),
                Err(PointerError::Unusable(why)) => Err(why),
                Err(PointerError::NotJson(reason)) => panic!("{reason}"),
            }
        };
        for rounded in [
            r#"{"id": 18446744073709551616}"#,
            r#"{"id": 18446744073709551617}"#,
            r#"{"id": -1e20}"#,
        ] {
            assert_eq!(value_part(&parse(rounded)), Err(Unusable::Imprecise), "{rounded}");
            // The bytes keep every digit.
            assert!(text_part(rounded, "/id").is_ok());
        }
        for exact in [
            r#"{"id": 18446744073709551615}"#,
            r#"{"id": -9223372036854775808}"#,
            r#"{"id": 123456789012345.0}"#,
            r#"{"id": 0.1}"#,
            r#"{"id": 12345.25}"#,
        ] {
            assert_eq!(value_part(&parse(exact)).ok(), text_part(exact, "/id").ok(), "{exact}");
        }
    }

    #[test]
    fn text_documents_are_walked_checked_and_read_like_values() {
        let doc = r#" {"a": [10, {"b": "x\u0041"}], "a\/k": 1, "dup": 1, "dup": 2, "n": 1e400} "#;
        assert_eq!(text_part(doc, "/a/0"), Ok("10".into()));
        assert_eq!(text_part(doc, "/a/1/b"), Ok("xA".into()));
        assert_eq!(text_part(doc, "/a~1k"), Ok("1".into()), "escaped key, RFC 6901 token");
        assert_eq!(text_part(doc, "/dup"), Ok("2".into()), "the last repeated key, as in a Value");
        assert_eq!(text_part(doc, "/n"), Ok("1e400".into()));
        for missing in ["/a/2", "/a/01", "/a/+1", "/a/x", "/a/0/deeper", "/zz"] {
            assert_eq!(text_part(doc, missing), Err("nothing is there".into()), "{missing}");
        }
        for garbage in ["not json", "", r#"{"id": 1"#, r#"{"id": 1} trailing"#, r#"{"id": 01}"#] {
            assert!(text_part(garbage, "/id").unwrap_err().starts_with("not JSON"), "{garbage}");
        }
        // A value after the one found is still checked.
        assert!(text_part(r#"{"id": 1, "x": [}"#, "/id").unwrap_err().starts_with("not JSON"));
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        // Skipped values are checked without recursion: no stack to exhaust.
        assert_eq!(text_part(&deep, "/0"), Err(Unusable::Array.to_string()));
        assert!(text_part(&deep, "/1").is_err());
        let mut out = String::new();
        assert!(matches!(
            Document::of(&b"{\"id\": \"\xff\"}"[..]).render("/id", &mut out),
            Err(PointerError::NotJson(_))
        ));
    }

    /// A float in a `Value` payload keys like its text: serde_json read it with
    /// correct rounding (`float_roundtrip`), so the `f64` it holds is the one the text
    /// writes, whose shortest text is the same number.
    #[test]
    fn floats_in_values_key_like_their_text() {
        for text in [r#"{"id": 8.854502369371306e-159}"#, r#"{"id": 0.1}"#] {
            let value: Value = serde_json::from_str(text).unwrap();
            let mut from_value = String::new();
            assert!(Document::of(&value).render("/id", &mut from_value).is_ok());
            assert_eq!(Ok(from_value), text_part(text, "/id"), "{text}");
        }
    }

    /// RFC 6901: a pointer is empty or starts with `/`. Any other points at nothing,
    /// in a byte payload as in a `Value`, rather than at the whole document.
    #[test]
    fn a_pointer_without_its_leading_slash_points_at_nothing() {
        assert_eq!(text_part("6", "\u{8}7"), Err(Unusable::Missing.to_string()));
        assert_eq!(part(&json!({"id": 1}), "id"), Err(Unusable::Missing));
        assert_eq!(part(&json!("x"), "x"), Err(Unusable::Missing));
        assert_eq!(part(&json!("x"), ""), Ok("x".into()), "the empty pointer is the whole");
    }

    proptest::proptest! {
        /// Integers and the floats equal to them, as a producer that re-serialises may
        /// write them, have one fingerprint and one key part.
        #[test]
        fn numbers_fingerprint_and_key_by_value(i in -(1i64 << 53)..(1i64 << 53), scale in 0u32..6) {
            let float = i as f64;
            let exponent = format!("{}e{scale}", i as f64 / 10f64.powi(scale as i32));
            let written: Value = serde_json::from_str(&exponent).unwrap();
            for other in [json!({"x": float}), json!({"x": written})] {
                if other["x"].as_f64() == Some(float) {
                    proptest::prop_assert_eq!(Fingerprint::of(&json!({"x": i})), Fingerprint::of(&other));
                    proptest::prop_assert_eq!(part(&other, "/x"), Ok(i.to_string()));
                }
            }
        }
    }

    #[test]
    fn fingerprints_ignore_key_order_for_values_not_for_bytes() {
        let a = json!({"x": 1, "y": [true, null, "s"]});
        let b: Value = serde_json::from_str(r#"{"y":[true,null,"s"],"x":1}"#).unwrap();
        assert_eq!(Fingerprint::of(&a), Fingerprint::of(&b));
        assert_ne!(Fingerprint::of(&a), Fingerprint::of(&json!({"x": 2, "y": [true, null, "s"]})));
        assert_eq!(Fingerprint::of(r#"{"x":1}"#), Fingerprint::of(&br#"{"x":1}"#.to_vec()));
        assert_ne!(Fingerprint::of(r#"{"x":1}"#), Fingerprint::of(r#"{"x": 1}"#));
    }
}
