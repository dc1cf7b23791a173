//! Key templates: `"order:{order_id}"`, `{a.b.c}` paths, `{{`/`}}` escapes.

use syn::LitStr;

/// One piece of a key template.
#[derive(Debug, PartialEq, Eq)]
pub enum Segment {
    /// Literal text, escapes resolved.
    Text(String),
    /// `{a.b.c}`: the path's parts, as written.
    Placeholder(Vec<String>),
    /// `{/a/b}`: an RFC 6901 JSON pointer into the message's payload.
    Pointer(String),
}

/// Splits a template into text and placeholders. Errors point at the literal and say
/// which part is wrong and how to write it.
pub fn parse(lit: &LitStr) -> syn::Result<Vec<Segment>> {
    let err = |message: String| syn::Error::new(lit.span(), message);
    let source = lit.value();
    let mut segments = Vec::new();
    let mut text = String::new();
    let mut chars = source.char_indices().peekable();
    while let Some((at, c)) = chars.next() {
        match c {
            '{' if chars.peek().map(|&(_, c)| c) == Some('{') => {
                chars.next();
                text.push('{');
            }
            '}' if chars.peek().map(|&(_, c)| c) == Some('}') => {
                chars.next();
                text.push('}');
            }
            '}' => {
                return Err(err(format!(
                    "unmatched `}}` at byte {at} of the key template: write `}}}}` for a literal brace"
                )));
            }
            '{' => {
                let Some(len) = source[at + 1..].find('}') else {
                    return Err(err(format!(
                        "unclosed `{{` at byte {at} of the key template: close the placeholder with `}}`, or write `{{{{` for a literal brace"
                    )));
                };
                let inner = &source[at + 1..at + 1 + len];
                while chars.peek().is_some_and(|&(i, _)| i <= at + 1 + len) {
                    chars.next();
                }
                if !text.is_empty() {
                    segments.push(Segment::Text(std::mem::take(&mut text)));
                }
                let segment = if inner.starts_with('/') {
                    Segment::Pointer(pointer(inner).map_err(err)?)
                } else {
                    Segment::Placeholder(placeholder(inner).map_err(err)?)
                };
                segments.push(segment);
            }
            c => text.push(c),
        }
    }
    if !text.is_empty() {
        segments.push(Segment::Text(text));
    }
    if !segments.iter().any(|s| !matches!(s, Segment::Text(_))) {
        return Err(err(format!(
            "key template `{source}` has no placeholder, so every message would share one key: \
             add one, e.g. `\"{source}{{order_id}}\"`, or use `key_fn = ...`"
        )));
    }
    check_separators(&segments).map_err(err)?;
    Ok(segments)
}

/// Two placeholders need text between them that an encoded value can't contain: the
/// runtime percent-encodes `%` and the separator's first character in the value
/// before it (as `%` and upper-case hex digits), so the first such character after a
/// value is where it ends, and distinct values always render distinct keys.
fn check_separators(segments: &[Segment]) -> Result<(), String> {
    let is_value = |s: &Segment| !matches!(s, Segment::Text(_));
    for (i, value) in segments.iter().enumerate() {
        // Only a value that another placeholder follows is encoded.
        if !is_value(value) || !segments[i + 1..].iter().any(is_value) {
            continue;
        }
        // Text is merged while parsing: one `Text` at most between two placeholders.
        let (value, next) = (written(value), &segments[i + 1]);
        match next {
            Segment::Text(text) => match text.chars().next() {
                Some(first) if !separates(first) => {
                    let after = segments.get(i + 2).map(written).unwrap_or_default();
                    return Err(format!(
                        "the separator after `{value}` starts with `{first}`: a value followed \
                         by a separator is percent-encoded (`%3A`), so the separator can't \
                         start with `%`, a digit or `A`-`F`, or two messages could render the \
                         same key; start it with another character, e.g. `{value}:{text}{after}`"
                    ));
                }
                _ => {}
            },
            _ => {
                let next = written(next);
                return Err(format!(
                    "`{value}{next}` has nothing between the placeholders, so (\"ab\", \"c\") \
                     and (\"a\", \"bc\") would render the same key: put a separator between \
                     them, e.g. `{value}:{next}`"
                ));
            }
        }
    }
    Ok(())
}

/// Whether text starting with `c` can follow a placeholder that another one follows:
/// not `%`, a digit or `A`-`F`, the characters of a percent-encoded byte.
fn separates(c: char) -> bool {
    !matches!(c, '%' | '0'..='9' | 'A'..='F')
}

/// A placeholder as the user wrote it.
fn written(segment: &Segment) -> String {
    match segment {
        Segment::Text(text) => text.clone(),
        Segment::Placeholder(parts) => format!("{{{}}}", parts.join(".")),
        Segment::Pointer(pointer) => format!("{{{pointer}}}"),
    }
}

fn placeholder(inner: &str) -> Result<Vec<String>, String> {
    if inner.is_empty() {
        return Err("empty placeholder `{}` in the key template: name a field of the message, \
                    e.g. `{order_id}`, or another argument, e.g. `{tenant}`"
            .to_owned());
    }
    if let Some((path, spec)) = inner.split_once(':') {
        return Err(format!(
            "`{{{inner}}}`: key templates take no format spec (`:{spec}`): a field's `Display` \
             is its part of the key; write `{{{path}}}`, and give the field's type a `Display` \
             (or use `key_fn`) if it has none"
        ));
    }
    let parts: Vec<String> = inner.split('.').map(str::to_owned).collect();
    let valid = |p: &String| {
        let ident = p.chars().next().is_some_and(|c| c == '_' || c.is_alphabetic())
            && p.chars().all(|c| c == '_' || c.is_alphanumeric());
        let index = !p.is_empty() && p.chars().all(|c| c.is_ascii_digit());
        (ident && p != "_") || index
    };
    if !parts.iter().all(valid) {
        return Err(format!(
            "`{{{inner}}}` is not a field path: write `{{field}}`, `{{field.sub_field}}` or \
             `{{argument}}`, without spaces"
        ));
    }
    Ok(parts)
}

/// Checks an RFC 6901 pointer: `~` only as `~0` (for `~`) or `~1` (for `/`). Empty
/// members are valid: `{/}` is the member named `""` of the root object, and `{/a//b}`
/// passes through one (the runtime resolves them as `serde_json::Value::pointer` does).
fn pointer(inner: &str) -> Result<String, String> {
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        if c == '~' && !matches!(chars.next(), Some('0' | '1')) {
            return Err(format!(
                "`{{{inner}}}` is not a valid JSON pointer: `~` must be followed by `0` (for a \
                 literal `~`) or `1` (for a literal `/`)"
            ));
        }
    }
    Ok(inner.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segments(s: &str) -> Result<Vec<Segment>, String> {
        parse(&LitStr::new(s, proc_macro2::Span::call_site())).map_err(|e| e.to_string())
    }

    fn ph(parts: &[&str]) -> Segment {
        Segment::Placeholder(parts.iter().map(|s| s.to_string()).collect())
    }

    #[test]
    fn text_placeholders_and_escapes() {
        assert_eq!(
            segments("order:{order_id}/{{x}}:{a.b.0}").unwrap(),
            vec![
                Segment::Text("order:".into()),
                ph(&["order_id"]),
                Segment::Text("/{x}:".into()),
                ph(&["a", "b", "0"]),
            ]
        );
    }

    #[test]
    fn pointers() {
        assert_eq!(
            segments("k:{/order/id}-{/a~1b/~0c}").unwrap(),
            vec![
                Segment::Text("k:".into()),
                Segment::Pointer("/order/id".into()),
                Segment::Text("-".into()),
                Segment::Pointer("/a~1b/~0c".into()),
            ]
        );
        // RFC 6901: `/` is the member `""` of the root; members may be empty anywhere.
        for pointer in ["/", "/a//b", "/a/", "//"] {
            let template = format!("k:{{{pointer}}}");
            assert_eq!(segments(&template).unwrap()[1], Segment::Pointer(pointer.into()));
        }
    }

    #[test]
    fn mistakes() {
        assert!(segments("order").unwrap_err().contains("no placeholder"));
        assert!(segments("{{order}}").unwrap_err().contains("no placeholder"));
        assert!(segments("a{}").unwrap_err().contains("empty placeholder"));
        assert!(segments("a{b").unwrap_err().contains("unclosed"));
        assert!(segments("a}b{c}").unwrap_err().contains("unmatched"));
        assert!(segments("{/a~2b}").unwrap_err().contains("not a valid JSON pointer"));
        assert!(segments("{ a }").unwrap_err().contains("not a field path"));
        assert!(segments("{a..b}").unwrap_err().contains("not a field path"));
        assert!(segments("{a-b}").unwrap_err().contains("not a field path"));
        assert!(segments("{id:?}").unwrap_err().contains("no format spec (`:?`)"));
    }

    #[test]
    fn placeholders_need_a_separator_an_encoded_value_cannot_contain() {
        assert!(segments("{a}{b}").unwrap_err().contains("nothing between the placeholders"));
        assert!(segments("x{a}{/b}y").unwrap_err().contains("nothing between"));
        for bad in ["{a}%{b}", "{a}1{b}", "{a}Fx{b}", "{a}:{b}A{c}"] {
            assert!(segments(bad).unwrap_err().contains("can't start with `%`"), "{bad}");
        }
        // Fine: text after the last placeholder, and separators of any other start.
        for good in ["{a}1", "{a}%", "{a}:{b}1", "{a}a{b}", "{a}f{b}", "{a}{{{b}", "{a}→{b}"] {
            assert!(segments(good).is_ok(), "{good}");
        }
    }
}
