//! Distinct inputs, distinct keys.
//!
//! * `Key::new`: two (namespace, id) pairs give equal `as_bytes`, equal `stored`
//!   forms and equal Redis keys (one prefix) exactly when the pairs are equal (a
//!   namespace never holds `:`; a hashed id can't be taken for a raw one; SHA-256
//!   collisions aside). The namespace and id read back.
//! * `KeyBuilder`: one template (texts between placeholders, each a typed field or a
//!   JSON pointer into a byte payload) rendered with two tuples of values gives the
//!   same key exactly when the tuples are equal, as `KeyBuilder`'s docs promise for
//!   templates whose separators don't start with `%`, a digit or `A`-`F` (others fail
//!   with `Unseparated`). Values are non-empty strings (an empty one is an error).

#![no_main]

use arbitrary::Arbitrary;
use idempotent_runtime::serde_json::{self, Value};
use idempotent_runtime::{Document, Key, KeyBuilder, KeyError, RedisStore};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Pair {
    namespace: String,
    id: Vec<u8>,
}

#[derive(Debug, Arbitrary)]
struct Template {
    prefix: String,
    /// Per placeholder: pointer (true) or field, and the text after it.
    parts: Vec<(bool, String)>,
}

#[derive(Debug, Arbitrary)]
enum Input {
    Pairs(Pair, Pair, String),
    /// The second pair is the first with its id's bytes swapped round a split point.
    Shifted(String, Vec<u8>, u8),
    Built(Template, Vec<String>, Vec<String>),
}

const POINTERS: [&str; 8] = ["/p0", "/p1", "/p2", "/p3", "/p4", "/p5", "/p6", "/p7"];

fn check_pairs(a: &Pair, b: &Pair, prefix: &str) {
    let (Ok(x), Ok(y)) = (Key::new(&a.namespace, &a.id), Key::new(&b.namespace, &b.id)) else {
        return;
    };
    for (key, pair) in [(&x, a), (&y, b)] {
        assert_eq!(key.namespace(), pair.namespace);
        assert_eq!(key.id(), pair.id.as_slice());
        assert!(!key.namespace().contains(':'));
        let stored = key.stored();
        assert!(stored.starts_with(format!("{}:", pair.namespace).as_bytes()));
        let hashed = stored.as_ref() != key.as_bytes();
        assert_eq!(hashed, pair.id.len() > 512 || pair.id.starts_with(b"sha256:"));
        if hashed {
            assert_eq!(stored.len(), pair.namespace.len() + 1 + 7 + 64);
        }
    }
    let same = a.namespace == b.namespace && a.id == b.id;
    assert_eq!(x.as_bytes() == y.as_bytes(), same, "{a:?} {b:?}");
    assert_eq!(x == y, same);
    assert_eq!(x.stored() == y.stored(), same, "{a:?} {b:?}");
    assert_eq!(
        RedisStore::redis_key_with(prefix, &x) == RedisStore::redis_key_with(prefix, &y),
        same,
        "{a:?} {b:?} under {prefix:?}"
    );
}

/// The key `template` renders with `values` (made non-empty), and the values used.
fn render(template: &Template, values: &[String]) -> Result<(Key, Vec<String>), KeyError> {
    let n = template.parts.len().min(POINTERS.len());
    let values: Vec<String> = (0..n)
        .map(|i| {
            let v = values.get(i).cloned().unwrap_or_default();
            if v.is_empty() { "v".to_owned() } else { v }
        })
        .collect();
    let document: serde_json::Map<String, Value> = (values.iter().enumerate())
        .map(|(i, v)| (format!("p{i}"), Value::String(v.clone())))
        .collect();
    let body = serde_json::to_vec(&document).unwrap();
    let document = Document::of(body.as_slice());
    let mut key = KeyBuilder::new("ns");
    key.text(&template.prefix);
    for (i, (pointer, text)) in template.parts.iter().take(n).enumerate() {
        if *pointer {
            key.pointer(POINTERS[i], &document);
        } else {
            key.field("field", &values[i]);
        }
        key.text(text);
    }
    key.finish().map(|key| (key, values))
}

fn separates(c: char) -> bool {
    !matches!(c, '%' | '0'..='9' | 'A'..='F')
}

fn check_built(template: &Template, a: &[String], b: &[String]) {
    let n = template.parts.len().min(POINTERS.len());
    let separated = (template.parts.iter().take(n.saturating_sub(1)))
        .all(|(_, text)| text.chars().next().is_some_and(separates));
    let x = render(template, a);
    let y = render(template, b);
    for rendered in [&x, &y] {
        match rendered {
            Ok(_) => assert!(separated, "{template:?} rendered although unseparated"),
            Err(KeyError::Unseparated { .. }) => assert!(!separated, "{template:?}"),
            // No placeholder and no text: an empty id.
            Err(KeyError::Empty) => assert!(n == 0 && template.prefix.is_empty()),
            Err(KeyError::TooLong { .. }) => {}
            Err(e) => panic!("{e} for {template:?}"),
        }
    }
    let (Ok((x, a)), Ok((y, b))) = (x, y) else { return };
    assert_eq!(x.as_bytes() == y.as_bytes(), a == b, "{template:?} {a:?} {b:?}");
    assert_eq!(x.stored() == y.stored(), a == b, "{template:?} {a:?} {b:?}");
}

fuzz_target!(|input: Input| {
    match input {
        Input::Pairs(a, b, prefix) => check_pairs(&a, &b, &prefix),
        Input::Shifted(namespace, id, at) => {
            let at = usize::from(at).min(id.len());
            let mut moved = id[at..].to_vec();
            moved.extend_from_slice(&id[..at]);
            let (a, b) = (Pair { namespace: namespace.clone(), id }, Pair { namespace, id: moved });
            check_pairs(&a, &b, "idempotent");
        }
        Input::Built(template, a, b) => check_built(&template, &a, &b),
    }
});
