//! Idempotency keys: a namespace and an id, rendered once per call.

use std::borrow::Cow;
use std::fmt::{self, Display, Write as _};

use sha2::{Digest, Sha256};

use crate::KeyError;
use crate::payload::{Document, PointerError};

/// The longest key accepted, in bytes, namespace and separator included: 64 KiB.
/// Longer keys are a [`KeyError::TooLong`]. The Redis and PostgreSQL stores keep ids
/// over [`MAX_STORED_ID_LEN`] bytes under their SHA-256 ([`Key::stored`]).
pub const MAX_KEY_LEN: usize = 64 * 1024;

/// Ids longer than this many bytes are kept under their SHA-256 by the stores that
/// persist records (Redis, PostgreSQL): see [`Key::stored`].
pub const MAX_STORED_ID_LEN: usize = 512;

/// An idempotency key: `namespace:id`.
///
/// The namespace separates handlers (two handlers with the same namespace share
/// records); the id identifies the message. Ids are bytes: any value, including
/// `:`, whitespace and non-UTF-8, is kept as given. A namespace never contains `:`,
/// so [`as_bytes`](Key::as_bytes) is unambiguous.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Key {
    bytes: Vec<u8>,
    namespace_len: usize,
}

impl Key {
    /// Builds a key from a namespace and an id.
    ///
    /// ```
    /// let key = idempotent_runtime::Key::new("payments", "order:42").unwrap();
    /// assert_eq!(key.as_bytes(), b"payments:order:42");
    /// ```
    pub fn new(namespace: &str, id: impl AsRef<[u8]>) -> Result<Key, KeyError> {
        let id = id.as_ref();
        let mut bytes = Vec::with_capacity(namespace.len() + 1 + id.len());
        bytes.extend_from_slice(namespace.as_bytes());
        bytes.push(b':');
        bytes.extend_from_slice(id);
        Key::checked(bytes, namespace.len())
    }

    fn checked(bytes: Vec<u8>, namespace_len: usize) -> Result<Key, KeyError> {
        let namespace = &bytes[..namespace_len];
        if namespace.is_empty() || namespace.contains(&b':') {
            return Err(KeyError::InvalidNamespace {
                namespace: String::from_utf8_lossy(namespace).into_owned(),
            });
        }
        if bytes.len() == namespace_len + 1 {
            return Err(KeyError::Empty);
        }
        if bytes.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong { len: bytes.len(), max: MAX_KEY_LEN });
        }
        Ok(Key { bytes, namespace_len })
    }

    /// The namespace part.
    pub fn namespace(&self) -> &str {
        // Built from a `&str` in both constructors.
        std::str::from_utf8(&self.bytes[..self.namespace_len]).unwrap_or_default()
    }

    /// The id part.
    pub fn id(&self) -> &[u8] {
        &self.bytes[self.namespace_len + 1..]
    }

    /// `namespace:id`.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The key as the Redis and PostgreSQL stores keep it: `namespace:id`, or, for an
    /// id longer than [`MAX_STORED_ID_LEN`] bytes or one that itself starts with
    /// `sha256:`, `namespace:sha256:` and the id's SHA-256 in 64 lower-case hex digits.
    /// So an id of any length fits every store's limits (a PostgreSQL index entry holds
    /// about 2.7 KB), and a raw id can never take a hashed one's place.
    ///
    /// ```
    /// use idempotent_runtime::Key;
    ///
    /// assert_eq!(&*Key::new("orders", "42").unwrap().stored(), b"orders:42");
    /// let long = Key::new("orders", "x".repeat(600)).unwrap();
    /// assert!(long.stored().starts_with(b"orders:sha256:"));
    /// assert_eq!(long.stored().len(), "orders:sha256:".len() + 64);
    /// ```
    pub fn stored(&self) -> Cow<'_, [u8]> {
        let id = self.id();
        if id.len() <= MAX_STORED_ID_LEN && !id.starts_with(b"sha256:") {
            return Cow::Borrowed(&self.bytes);
        }
        let mut out = Vec::with_capacity(self.namespace_len + 1 + 7 + 64);
        out.extend_from_slice(&self.bytes[..=self.namespace_len]);
        out.extend_from_slice(b"sha256:");
        for byte in Sha256::digest(id) {
            out.extend_from_slice(format!("{byte:02x}").as_bytes());
        }
        Cow::Owned(out)
    }
}

/// Shows the key with non-printable and non-ASCII bytes escaped, so a key taken from
/// a message can be logged safely.
impl Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        Display::fmt(&self.bytes.escape_ascii(), f)
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key(\"{self}\")")
    }
}

/// Renders a key template into a [`Key`]; the `#[idempotent]` expansion drives it.
///
/// ```
/// use idempotent_runtime::KeyBuilder;
///
/// let mut key = KeyBuilder::new("orders");
/// key.text("order:");
/// key.field("order_id", &42);
/// assert_eq!(key.finish().unwrap().as_bytes(), b"orders:order:42");
/// ```
///
/// # Distinct values, distinct keys
///
/// A placeholder's value is written as it is, unless another placeholder follows it.
/// Then `%` and the first character of the text between the two are percent-encoded
/// in the value, as their UTF-8 bytes in upper-case hex (`%25`, `%3A`), so a value
/// can't run into the next one: with `"{from}:{to}"`, the transfers `("a:b", "c")`
/// and `("a", "b:c")` render `a%3Ab:c` and `a:b:c`. Plain ids, numbers and UUIDs
/// (with any separator they don't contain), and the value of the last placeholder,
/// are never changed, so keys stay readable.
///
/// For this to hold, two placeholders need text between them that does not start
/// with `%`, a digit or `A`–`F` (the characters an encoded value is made of); the
/// `#[idempotent]` macro checks templates at compile time, and a builder driven by
/// hand fails with [`KeyError::Unseparated`].
///
/// ```
/// use idempotent_runtime::KeyBuilder;
///
/// let render = |from: &str, to: &str| {
///     let mut key = KeyBuilder::new("transfers");
///     key.field("from", from);
///     key.text(":");
///     key.field("to", to);
///     key.finish().unwrap()
/// };
/// assert_eq!(render("a:b", "c").as_bytes(), b"transfers:a%3Ab:c");
/// assert_eq!(render("a", "b:c").as_bytes(), b"transfers:a:b:c");
/// assert_eq!(render("100%", "c").as_bytes(), b"transfers:100%25:c");
/// ```
pub struct KeyBuilder {
    buf: String,
    namespace_len: usize,
    error: Option<KeyError>,
    /// The last placeholder's value, until the next placeholder says whether it
    /// needs encoding.
    open: Option<Open>,
}

/// A placeholder's value already written to the buffer.
struct Open {
    /// Where the value starts and ends in the buffer.
    start: usize,
    end: usize,
    placeholder: &'static str,
    /// The first character of the text written after the value.
    stop: Option<char>,
}

impl KeyBuilder {
    /// Starts a key in `namespace`.
    pub fn new(namespace: &str) -> KeyBuilder {
        let mut buf = String::with_capacity(namespace.len() + 32);
        buf.push_str(namespace);
        buf.push(':');
        KeyBuilder { buf, namespace_len: namespace.len(), error: None, open: None }
    }

    /// Appends literal text from the template.
    pub fn text(&mut self, text: &str) {
        if let Some(open) = &mut self.open {
            open.stop = open.stop.or_else(|| text.chars().next());
        }
        self.buf.push_str(text);
    }

    /// Appends a placeholder's value, rendered with `Display` (and encoded as the
    /// type's docs say when another placeholder follows). A value that renders empty
    /// makes the key fail with [`KeyError::EmptyPlaceholder`] (an empty part would let
    /// different messages share a key), and one whose `Display` fails with
    /// [`KeyError::Unprintable`].
    pub fn field<D: Display + ?Sized>(&mut self, placeholder: &'static str, value: &D) {
        self.seal();
        let start = self.buf.len();
        // Writing to a `String` only fails if `Display` itself fails, possibly after
        // writing part of the value: a part could match another value, so it is an
        // error, not a key.
        if write!(self.buf, "{value}").is_err() && self.error.is_none() {
            self.error = Some(KeyError::Unprintable { placeholder });
        }
        self.opened(placeholder, start);
    }

    /// Appends the value at a JSON `pointer` (RFC 6901) of `document`, encoded like a
    /// [`field`](KeyBuilder::field).
    ///
    /// A string renders as it is. A number renders as its exact decimal value, never
    /// through a float: `100`, `100.0`, `1e2` and `1000E-1` all render `100`, `-0`
    /// renders `0`, and `18446744073709551616` keeps every digit. The text is plain
    /// decimal without trailing zeros, or `DeK` (`1e400`) when plain notation would
    /// exceed 100 characters. A string and a number with the same text share a key
    /// (`"7"` and `7`). Of an object's repeated keys the last counts.
    ///
    /// That holds for byte payloads, whose text is read here. A `serde_json::Value`
    /// payload was parsed before: unless serde_json's `arbitrary_precision` is on, a
    /// number that is not a 64-bit integer is an `f64` by then, so numbers that differ
    /// only beyond its precision (`0.1` and `0.1000000000000000055511151231257827`)
    /// already are one number, and an integer of 2^64 or more, rounded, is refused
    /// ([`Unusable::Imprecise`](crate::Unusable::Imprecise)) rather than keyed. Pass
    /// the bytes for exact keys.
    ///
    /// A payload that is not JSON, or a pointer to nothing, `null`, `""`, a boolean,
    /// an object, an array or a number whose exponent overflows 64 bits, makes the key
    /// fail: the handler does not run and the message is dead-lettered.
    ///
    /// ```
    /// use idempotent_runtime::{Document, KeyBuilder};
    ///
    /// let key = |body: &str| {
    ///     let mut key = KeyBuilder::new("payments");
    ///     key.pointer("/amount", &Document::of(body));
    ///     key.finish().unwrap()
    /// };
    /// assert_eq!(key(r#"{"amount": 1e2}"#), key(r#"{"amount": 100.0}"#));
    /// assert_eq!(key(r#"{"amount": 18446744073709551616}"#).as_bytes(), b"payments:18446744073709551616");
    /// ```
    pub fn pointer(&mut self, pointer: &'static str, document: &Document<'_>) {
        if self.error.is_some() {
            return;
        }
        self.seal();
        let start = self.buf.len();
        match document.render(pointer, &mut self.buf) {
            Ok(()) => self.opened(pointer, start),
            Err(PointerError::NotJson(reason)) => {
                self.error = Some(KeyError::NotJson { pointer, reason });
            }
            Err(PointerError::Unusable(why)) => {
                self.error = Some(KeyError::Pointer { pointer, why })
            }
        }
    }

    /// Fails the key with `error`, unless it failed already.
    pub(crate) fn fail(&mut self, error: KeyError) {
        self.error.get_or_insert(error);
    }

    /// Records the value written since `start` as the open one.
    fn opened(&mut self, placeholder: &'static str, start: usize) {
        if self.buf.len() == start && self.error.is_none() {
            self.error = Some(KeyError::EmptyPlaceholder { placeholder });
        }
        self.open = Some(Open { start, end: self.buf.len(), placeholder, stop: None });
    }

    /// Another placeholder follows the open value: percent-encode `%` and the
    /// separator's first character in it.
    fn seal(&mut self) {
        let Some(open) = self.open.take() else { return };
        let Some(stop) = open.stop.filter(|&c| separates(c)) else {
            if self.error.is_none() {
                self.error = Some(KeyError::Unseparated { placeholder: open.placeholder });
            }
            return;
        };
        let value = &self.buf[open.start..open.end];
        if !value.contains(['%', stop]) {
            return;
        }
        let tail = self.buf.split_off(open.start);
        let (value, rest) = tail.split_at(open.end - open.start);
        for c in value.chars() {
            if c == '%' || c == stop {
                for byte in c.encode_utf8(&mut [0; 4]).bytes() {
                    let _ = write!(self.buf, "%{byte:02X}");
                }
            } else {
                self.buf.push(c);
            }
        }
        self.buf.push_str(rest);
    }

    /// The key, or the first error met while rendering it.
    pub fn finish(self) -> Result<Key, KeyError> {
        match self.error {
            Some(e) => Err(e),
            None => Key::checked(self.buf.into_bytes(), self.namespace_len),
        }
    }
}

/// Whether text starting with `c` can separate two placeholders: an encoded value
/// never contains `c`, so the first `c` after a value ends it. `%` and upper-case hex
/// digits are what encoded bytes are made of.
fn separates(c: char) -> bool {
    !matches!(c, '%' | '0'..='9' | 'A'..='F')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_with_colons_do_not_collide_across_namespaces() {
        let a = Key::new("a", "b:c").unwrap();
        let b = Key::new("a:b", "c");
        assert!(matches!(b, Err(KeyError::InvalidNamespace { .. })));
        assert_eq!(a.namespace(), "a");
        assert_eq!(a.id(), b"b:c");
    }

    #[test]
    fn empty_placeholder_is_an_error() {
        let mut k = KeyBuilder::new("ns");
        k.text("order:");
        k.field("order_id", "");
        assert_eq!(k.finish(), Err(KeyError::EmptyPlaceholder { placeholder: "order_id" }));
    }

    #[test]
    fn too_long_and_empty_keys_are_errors() {
        let long = "x".repeat(MAX_KEY_LEN);
        assert!(matches!(Key::new("ns", &long), Err(KeyError::TooLong { .. })));
        assert_eq!(Key::new("ns", ""), Err(KeyError::Empty));
    }

    #[test]
    fn a_display_that_fails_part_way_is_an_error() {
        struct Half;
        impl Display for Half {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("abc")?;
                Err(fmt::Error)
            }
        }
        let mut k = KeyBuilder::new("ns");
        k.field("half", &Half);
        assert_eq!(k.finish(), Err(KeyError::Unprintable { placeholder: "half" }));
    }

    #[test]
    fn display_escapes_control_and_non_ascii_bytes() {
        let k = Key::new("ns", b"a\nb\xff").unwrap();
        assert_eq!(k.to_string(), "ns:a\\nb\\xff");
    }
}

/// Distinct placeholder values never render the same key, whatever the template and
/// whatever a producer puts in a field.
#[cfg(test)]
mod distinct {
    use proptest::prelude::*;
    use serde_json::{Value, json};

    use super::{KeyBuilder, separates};
    use crate::Document;

    /// `prefix {v0} separators[0] {v1} ... {vn} suffix`; each placeholder is a typed
    /// field or a JSON pointer.
    #[derive(Debug, Clone)]
    struct Template {
        prefix: String,
        separators: Vec<String>,
        suffix: String,
        pointers: Vec<bool>,
    }

    const POINTERS: [&str; 4] = ["/p0", "/p1", "/p2", "/p3"];

    /// Characters that break naive keys: separators, escapes, braces, hex digits,
    /// control and non-ASCII characters, and anything else.
    fn tricky() -> impl Strategy<Value = char> {
        prop_oneof![
            4 => prop::sample::select(vec![
                ':', '/', '|', '-', '.', '%', '\\', '{', '}', 'a', 'A', 'F', '2', '5', '3',
                '\n', '\0', '\u{7f}', 'é', '→', ' ', '~',
            ]),
            1 => any::<char>(),
        ]
    }

    fn text(len: std::ops::Range<usize>) -> impl Strategy<Value = String> {
        prop::collection::vec(tricky(), len).prop_map(|cs| cs.into_iter().collect())
    }

    fn template() -> impl Strategy<Value = Template> {
        let separator = text(1..4)
            .prop_filter("a usable separator", |s| s.chars().next().is_some_and(separates));
        (text(0..3), prop::collection::vec(separator, 0..4), text(0..3))
            .prop_flat_map(|(prefix, separators, suffix)| {
                let n = separators.len() + 1;
                (Just((prefix, separators, suffix)), prop::collection::vec(any::<bool>(), n))
            })
            .prop_map(|((prefix, separators, suffix), pointers)| Template {
                prefix,
                separators,
                suffix,
                pointers,
            })
    }

    fn values(n: usize) -> impl Strategy<Value = Vec<String>> {
        prop::collection::vec(text(1..6), n)
    }

    fn render(t: &Template, values: &[String]) -> Vec<u8> {
        let document: Value = (values.iter().enumerate())
            .map(|(i, v)| (format!("p{i}"), json!(v)))
            .collect::<serde_json::Map<_, _>>()
            .into();
        let document = Document::of(&document);
        let mut key = KeyBuilder::new("ns");
        key.text(&t.prefix);
        for (i, value) in values.iter().enumerate() {
            if t.pointers[i] {
                key.pointer(POINTERS[i], &document);
            } else {
                key.field("field", value);
            }
            if let Some(separator) = t.separators.get(i) {
                key.text(separator);
            }
        }
        key.text(&t.suffix);
        key.finish().unwrap().id().to_vec()
    }

    /// Reads the values back from a key: each value but the last ends at the first
    /// occurrence of its separator's first character, and is percent-decoded; the
    /// last is what remains before the suffix, as it is.
    fn parse(t: &Template, id: &[u8]) -> Option<Vec<String>> {
        let mut rest = std::str::from_utf8(id).ok()?.strip_prefix(t.prefix.as_str())?;
        rest = rest.strip_suffix(t.suffix.as_str())?;
        let mut values = Vec::new();
        for separator in &t.separators {
            let end = rest.find(separator.chars().next()?)?;
            values.push(percent_decode(&rest[..end])?);
            rest = rest[end..].strip_prefix(separator.as_str())?;
        }
        values.push(rest.to_owned());
        Some(values)
    }

    fn percent_decode(encoded: &str) -> Option<String> {
        let mut bytes = Vec::new();
        let mut chunks = encoded.split('%');
        bytes.extend_from_slice(chunks.next()?.as_bytes());
        for chunk in chunks {
            bytes.push(u8::from_str_radix(chunk.get(..2)?, 16).ok()?);
            bytes.extend_from_slice(&chunk.as_bytes()[2..]);
        }
        String::from_utf8(bytes).ok()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        /// The values can be read back from the key, so no two tuples share one.
        #[test]
        fn a_key_determines_its_values(
            (t, values) in template().prop_flat_map(|t| {
                let n = t.separators.len() + 1;
                (Just(t), values(n))
            })
        ) {
            let id = render(&t, &values);
            prop_assert_eq!(parse(&t, &id), Some(values));
        }

        /// Moving text across a separator, the classic collision, changes the key.
        #[test]
        fn shifting_a_separator_between_values_changes_the_key(
            (t, x, y, z) in template()
                .prop_filter("two placeholders", |t| !t.separators.is_empty())
                .prop_flat_map(|t| (Just(t), text(1..4), text(1..4), text(1..4)))
        ) {
            let sep = &t.separators[0];
            let rest: Vec<String> = vec!["r".to_owned(); t.separators.len() - 1];
            let left = [vec![format!("{x}{sep}{y}"), z.clone()], rest.clone()].concat();
            let right = [vec![x.clone(), format!("{y}{sep}{z}")], rest].concat();
            prop_assert_ne!(render(&t, &left), render(&t, &right));
        }

        /// Two random tuples: different tuples, different keys.
        #[test]
        fn distinct_tuples_distinct_keys(
            (t, a, b) in template().prop_flat_map(|t| {
                let n = t.separators.len() + 1;
                (Just(t), values(n), values(n))
            })
        ) {
            prop_assert_eq!(render(&t, &a) == render(&t, &b), a == b);
        }
    }

    #[test]
    fn plain_values_render_as_they_are() {
        let t = Template {
            prefix: "order:".into(),
            separators: vec![":".into(), "-".into()],
            suffix: String::new(),
            pointers: vec![false, true, false],
        };
        let uuid = "67e55044-10b1-426f-9247-bb680e5fe0c8".to_owned();
        let id = render(&t, &["tenant_7".into(), "42".into(), uuid.clone()]);
        assert_eq!(id, format!("order:tenant_7:42-{uuid}").into_bytes());
    }

    #[test]
    fn a_hand_driven_builder_without_separator_fails() {
        for separator in ["", "%", "1", "A"] {
            let mut key = KeyBuilder::new("ns");
            key.field("a", "x");
            key.text(separator);
            key.field("b", "y");
            assert_eq!(
                key.finish(),
                Err(crate::KeyError::Unseparated { placeholder: "a" }),
                "{separator:?}"
            );
        }
    }
}
