//! Idempotency keys: a namespace and an id, rendered once per call.

use std::fmt::{self, Display, Write as _};

use crate::KeyError;
use crate::payload::{Document, render};

/// The longest key accepted, in bytes, namespace and separator included: 64 KiB.
/// Longer keys are a [`KeyError::TooLong`]; stores with tighter limits hash
/// long keys themselves.
pub const MAX_KEY_LEN: usize = 64 * 1024;

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

    /// `namespace:id`, the form stores index by.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
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
pub struct KeyBuilder {
    buf: String,
    namespace_len: usize,
    error: Option<KeyError>,
}

impl KeyBuilder {
    /// Starts a key in `namespace`.
    pub fn new(namespace: &str) -> KeyBuilder {
        let mut buf = String::with_capacity(namespace.len() + 32);
        buf.push_str(namespace);
        buf.push(':');
        KeyBuilder { buf, namespace_len: namespace.len(), error: None }
    }

    /// Appends literal text from the template.
    pub fn text(&mut self, text: &str) {
        self.buf.push_str(text);
    }

    /// Appends a placeholder's value, rendered with `Display`. A value that renders
    /// empty makes the key fail with [`KeyError::EmptyPlaceholder`]: an empty part
    /// would let different messages share a key.
    pub fn field<D: Display + ?Sized>(&mut self, placeholder: &'static str, value: &D) {
        let before = self.buf.len();
        // Writing to a `String` only fails if `Display` itself fails; the empty check
        // below then reports it.
        let _ = write!(self.buf, "{value}");
        if self.buf.len() == before && self.error.is_none() {
            self.error = Some(KeyError::EmptyPlaceholder { placeholder });
        }
    }

    /// Appends the value at a JSON `pointer` (RFC 6901) of `document`: a string as it
    /// is, a number canonically (`1` and `1.0` both render `1`). A payload that is not
    /// JSON, or a pointer to nothing, `null`, `""`, a boolean, an object or an array,
    /// makes the key fail: the handler does not run and the message is dead-lettered.
    pub fn pointer(&mut self, pointer: &'static str, document: &Document<'_>) {
        if self.error.is_some() {
            return;
        }
        self.error = match document.value() {
            Err(reason) => Some(KeyError::NotJson { pointer, reason: reason.to_owned() }),
            Ok(value) => render(value, pointer, &mut self.buf)
                .err()
                .map(|why| KeyError::Pointer { pointer, why }),
        };
    }

    /// The key, or the first error met while rendering it.
    pub fn finish(self) -> Result<Key, KeyError> {
        match self.error {
            Some(e) => Err(e),
            None => Key::checked(self.buf.into_bytes(), self.namespace_len),
        }
    }
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
    fn display_escapes_control_and_non_ascii_bytes() {
        let k = Key::new("ns", b"a\nb\xff").unwrap();
        assert_eq!(k.to_string(), "ns:a\\nb\\xff");
    }
}
