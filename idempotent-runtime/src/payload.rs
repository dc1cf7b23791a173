//! Message payloads: `{/json/pointer}` key placeholders and `validate = true`
//! fingerprints.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use serde_json::Value;
use sha2::{Digest, Sha256};

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

/// A payload parsed once per call, for all of a key's pointer placeholders; see
/// [`KeyBuilder::pointer`](crate::KeyBuilder::pointer).
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
    parsed: Result<Cow<'a, Value>, String>,
}

impl<'a> Document<'a> {
    /// Parses `payload` (no work when it is already a `serde_json::Value`).
    pub fn of<P: Payload + ?Sized>(payload: &'a P) -> Document<'a> {
        let parsed = match payload.payload() {
            PayloadRef::Json(value) => Ok(Cow::Borrowed(value)),
            PayloadRef::Bytes(bytes) => {
                serde_json::from_slice(bytes).map(Cow::Owned).map_err(|e| e.to_string())
            }
        };
        Document { parsed }
    }

    /// The JSON document, or why the payload is not one.
    pub fn value(&self) -> Result<&Value, &str> {
        match &self.parsed {
            Ok(value) => Ok(value),
            Err(reason) => Err(reason),
        }
    }
}

/// Why a JSON pointer gave no usable key part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
        })
    }
}

/// Renders the value at `pointer` as a key part: strings as they are, numbers
/// canonically (an integral number renders as an integer, so `1` and `1.0` are the
/// same key part; others in their shortest round-trip form).
pub(crate) fn render(value: &Value, pointer: &str, out: &mut String) -> Result<(), Unusable> {
    match value.pointer(pointer) {
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
            use std::fmt::Write as _;
            let _ = match (n.as_i64(), n.as_u64(), n.as_f64()) {
                (Some(i), _, _) => write!(out, "{i}"),
                (_, Some(u), _) => write!(out, "{u}"),
                (_, _, Some(f)) if f.fract() == 0.0 && f.abs() < 1e15 => {
                    write!(out, "{}", f as i64)
                }
                (_, _, Some(f)) => write!(out, "{f}"),
                _ => write!(out, "{n}"),
            };
            Ok(())
        }
    }
}

/// A SHA-256 fingerprint of a payload, stored with a claim under `validate = true`.
///
/// JSON values (`serde_json::Value`) are hashed over their canonical form: compact,
/// object keys sorted by their UTF-8 bytes, numbers as `serde_json` prints them.
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
        scalar => hasher.update(scalar.to_string().as_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn part(doc: &Value, pointer: &str) -> Result<String, Unusable> {
        let mut out = String::new();
        render(doc, pointer, &mut out).map(|()| out)
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

    #[test]
    fn documents_parse_bytes_once_and_report_garbage() {
        let bytes = br#"{"id": 7}"#.to_vec();
        assert_eq!(Document::of(&bytes).value().unwrap()["id"], 7);
        assert!(Document::of("not json").value().is_err());
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
