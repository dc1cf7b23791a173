//! The attribute's arguments: collected with their spans, then checked as a whole.

use proc_macro2::{Span, TokenTree};
use syn::meta::ParseNestedMeta;
use syn::spanned::Spanned;
use syn::{Expr, Ident, Lit, LitBool, LitInt, LitStr, Path};

/// Every argument `#[idempotent(...)]` accepts, for "unknown argument" messages.
const KNOWN: &str = "key, key_fn, ttl, lease, max_attempts, backoff, namespace, store, \
                     message, cache, validate, transactional, on_terminal, classify, crate";

/// The entry of `known` closest to a misspelt `word`, if one is close: an edit distance
/// of at most a third of the longer word (at least 1), or a prefix of 3 or more letters.
pub fn similar<'a>(word: &str, known: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    fn distance(a: &str, b: &str) -> usize {
        let b: Vec<char> = b.chars().collect();
        let mut row: Vec<usize> = (0..=b.len()).collect();
        for (i, ca) in a.chars().enumerate() {
            let mut diagonal = row[0];
            row[0] = i + 1;
            for (j, cb) in b.iter().enumerate() {
                let above = row[j + 1];
                row[j + 1] = (above + 1).min(row[j] + 1).min(diagonal + usize::from(ca != *cb));
                diagonal = above;
            }
        }
        row[b.len()]
    }
    known
        .into_iter()
        .map(|k| (distance(word, k), k))
        .filter(|(d, k)| {
            *d <= (word.chars().count().max(k.chars().count()) / 3).max(1)
                || (word.len() >= 3 && (k.starts_with(word) || word.starts_with(k)))
        })
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

/// ` (did you mean `x`?)` for [`similar`], or nothing.
pub fn did_you_mean<'a>(word: &str, known: impl IntoIterator<Item = &'a str>) -> String {
    similar(word, known).map_or_else(String::new, |k| format!(" (did you mean `{k}`?)"))
}

/// Collects errors so that all of them are reported, not just the first.
#[derive(Default)]
pub struct Errors(Option<syn::Error>);

impl Errors {
    pub fn push(&mut self, error: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(error),
            None => self.0 = Some(error),
        }
    }

    pub fn at(&mut self, span: Span, message: impl std::fmt::Display) {
        self.push(syn::Error::new(span, message));
    }

    pub fn count(&self) -> usize {
        self.0.as_ref().map_or(0, |e| e.clone().into_iter().count())
    }

    pub fn finish(self) -> Result<(), syn::Error> {
        self.0.map_or(Ok(()), Err)
    }
}

/// A value given at most once, with the span of the argument's name.
pub struct Once<T>(Option<(Span, T)>);

impl<T> Default for Once<T> {
    fn default() -> Self {
        Once(None)
    }
}

impl<T> Once<T> {
    fn set(&mut self, name: &Ident, value: T, errors: &mut Errors) {
        if self.0.is_some() {
            errors.at(name.span(), format_args!("duplicate argument `{name}`: give it once"));
        } else {
            self.0 = Some((name.span(), value));
        }
    }

    pub fn get(&self) -> Option<&T> {
        self.0.as_ref().map(|(_, v)| v)
    }

    pub fn span(&self) -> Option<Span> {
        self.0.as_ref().map(|(s, _)| *s)
    }

    pub fn take(&mut self) -> Option<T> {
        self.0.take().map(|(_, v)| v)
    }
}

/// A duration in milliseconds, with the span of its literal.
#[derive(Clone, Copy)]
pub struct Millis {
    pub ms: u64,
    pub span: Span,
}

/// `backoff`: the first retry's longest wait and the cap, in milliseconds (equal for a
/// fixed delay).
#[derive(Clone, Copy)]
pub struct Backoff {
    pub base_ms: u64,
    pub cap_ms: u64,
}

#[derive(Default)]
pub struct Args {
    pub key: Once<LitStr>,
    pub key_fn: Once<Path>,
    pub ttl: Once<Millis>,
    pub lease: Once<Millis>,
    pub max_attempts: Once<(u32, Span)>,
    pub backoff: Once<Backoff>,
    pub namespace: Once<LitStr>,
    pub store: Once<Expr>,
    pub message: Once<Ident>,
    pub on_terminal: Once<Path>,
    pub classify: Once<Path>,
    pub krate: Once<Path>,
    pub cache: Once<bool>,
    pub validate: Once<bool>,
    pub transactional: Once<bool>,
    /// `key` or `key_fn` was written, valid or not: no "missing key" error then.
    pub key_written: bool,
}

impl Args {
    /// Parses one `name = value` argument. Mistakes in a value are recorded in
    /// `errors` and parsing goes on, so one run reports every misuse.
    pub fn parse(&mut self, meta: ParseNestedMeta, errors: &mut Errors) -> syn::Result<()> {
        if meta.input.peek(syn::Token![=]) && too_long(meta.input.cursor()) {
            skip_value(&meta)?;
            errors.at(
                meta.path.span(),
                format_args!(
                    "this value is longer or nested deeper than the attribute parses \
                     ({MAX_VALUE_TOKENS} tokens, a `<` counting as {ANGLE_WEIGHT}): define \
                     it outside (a `static`, a `fn`, or a variable) and name that here"
                ),
            );
            return Ok(());
        }
        let Some(name) = meta.path.get_ident().cloned() else {
            skip_value(&meta)?;
            errors.at(meta.path.span(), format_args!("unknown argument; expected one of: {KNOWN}"));
            return Ok(());
        };
        if name == "key" || name == "key_fn" {
            self.key_written = true;
        }
        match name.to_string().as_str() {
            "key" => {
                let example = "a key template, e.g. `key = \"order:{order_id}\"`";
                if let Some(lit) = string(&meta, &name, example, errors)? {
                    self.key.set(&name, lit, errors);
                }
            }
            "namespace" => {
                let example = "a string, e.g. `namespace = \"payments\"`";
                if let Some(lit) = string(&meta, &name, example, errors)? {
                    self.namespace.set(&name, lit, errors);
                }
            }
            "ttl" | "lease" => {
                let expr = ungroup(meta.value()?.parse()?);
                match duration(&expr, &name) {
                    Ok(ms) => {
                        let slot = if name == "ttl" { &mut self.ttl } else { &mut self.lease };
                        slot.set(&name, Millis { ms, span: expr.span() }, errors);
                    }
                    Err(e) => errors.push(e),
                }
            }
            "backoff" => {
                let expr = ungroup(meta.value()?.parse()?);
                match backoff(&expr) {
                    Ok(value) => self.backoff.set(&name, value, errors),
                    Err(e) => errors.push(e),
                }
            }
            "max_attempts" => {
                let expr = ungroup(meta.value()?.parse()?);
                match int_literal(&expr).map(|lit| lit.base10_parse::<u32>()) {
                    Some(Ok(0)) => errors.at(
                        expr.span(),
                        "`max_attempts` must be at least 1: it counts the first attempt too",
                    ),
                    Some(Ok(n)) => self.max_attempts.set(&name, (n, expr.span()), errors),
                    _ => errors.at(
                        expr.span(),
                        "`max_attempts` takes a whole number from 1, e.g. `max_attempts = 5`",
                    ),
                }
            }
            "store" => {
                let expr = ungroup(meta.value()?.parse()?);
                self.store.set(&name, expr, errors);
            }
            "message" => {
                let expr = ungroup(meta.value()?.parse()?);
                match expr {
                    Expr::Path(p) if p.path.get_ident().is_some() && p.qself.is_none() => {
                        let ident = p.path.get_ident().cloned();
                        if let Some(ident) = ident {
                            self.message.set(&name, ident, errors);
                        }
                    }
                    other => errors.at(
                        other.span(),
                        "`message` takes the name of an argument, e.g. `message = order`",
                    ),
                }
            }
            "key_fn" | "on_terminal" | "classify" | "crate" => {
                let value = meta.value()?;
                let path: Path = if value.peek(LitStr) {
                    // `crate = "::my::reexport"`, as tokio's attribute spells it.
                    let lit: LitStr = value.parse()?;
                    match lit.parse::<Path>() {
                        Ok(p) => p,
                        Err(_) => {
                            errors.at(
                                lit.span(),
                                format_args!(
                                    "`{name}` takes a path, e.g. `{name} = my_crate::item`"
                                ),
                            );
                            return Ok(());
                        }
                    }
                } else {
                    match ungroup(value.parse::<Expr>()?) {
                        Expr::Path(p) if p.qself.is_none() => p.path,
                        other => {
                            errors.at(
                                other.span(),
                                format_args!(
                                    "`{name}` takes a path, e.g. `{name} = my_crate::item`"
                                ),
                            );
                            return Ok(());
                        }
                    }
                };
                let slot = match name.to_string().as_str() {
                    "key_fn" => &mut self.key_fn,
                    "on_terminal" => &mut self.on_terminal,
                    "classify" => &mut self.classify,
                    _ => &mut self.krate,
                };
                slot.set(&name, path, errors);
            }
            "cache" | "validate" | "transactional" => {
                // `cache` alone means `cache = true`.
                let value = if meta.input.peek(syn::Token![=]) {
                    match ungroup(meta.value()?.parse::<Expr>()?) {
                        Expr::Lit(syn::ExprLit {
                            lit: Lit::Bool(LitBool { value, .. }), ..
                        }) => Some(value),
                        other => {
                            errors
                                .at(other.span(), format_args!("`{name}` takes `true` or `false`"));
                            None
                        }
                    }
                } else {
                    Some(true)
                };
                if let Some(value) = value {
                    let slot = match name.to_string().as_str() {
                        "cache" => &mut self.cache,
                        "validate" => &mut self.validate,
                        _ => &mut self.transactional,
                    };
                    slot.set(&name, value, errors);
                }
            }
            _ => {
                skip_value(&meta)?;
                errors.at(
                    name.span(),
                    format_args!(
                        "unknown argument `{name}`{}; expected one of: {KNOWN}",
                        did_you_mean(&name.to_string(), KNOWN.split(", "))
                    ),
                );
            }
        }
        Ok(())
    }
}

/// The most tokens (those inside brackets too) an argument's value may have. syn's
/// expression parser recurses once per nesting level (a bracket, a `<`, a unary
/// operator), each level at least one token: bounding the tokens bounds the depth,
/// so that a value nested hundreds deep is an error here instead of a compiler crash
/// (a stack overflow in the parser). Real values are a few dozen tokens.
const MAX_VALUE_TOKENS: usize = 512;
/// What a `<` counts for: each level of a type or qualified path takes several times
/// the stack of other levels (about 200 nested `<` overflow the compiler's 8 MiB).
const ANGLE_WEIGHT: usize = 8;

/// Whether the value from `cursor` up to the next `,` at its level has more than
/// [`MAX_VALUE_TOKENS`] tokens, a `<` counting as [`ANGLE_WEIGHT`]. Walks nested
/// groups with a stack of its own: a recursive walk would overflow on the very
/// inputs it is there to refuse.
fn too_long(cursor: syn::buffer::Cursor) -> bool {
    let mut count = 0;
    let mut top = cursor;
    let mut nested: Vec<proc_macro2::token_stream::IntoIter> = Vec::new();
    loop {
        let tree = match nested.last_mut() {
            Some(group) => match group.next() {
                Some(tree) => tree,
                None => {
                    nested.pop();
                    continue;
                }
            },
            None => match top.token_tree() {
                Some((TokenTree::Punct(p), _)) if p.as_char() == ',' => return false,
                Some((tree, rest)) => {
                    top = rest;
                    tree
                }
                None => return false,
            },
        };
        count += match &tree {
            TokenTree::Punct(p) if p.as_char() == '<' => ANGLE_WEIGHT,
            _ => 1,
        };
        if count > MAX_VALUE_TOKENS {
            return true;
        }
        if let TokenTree::Group(group) = tree {
            nested.push(group.stream().into_iter());
        }
    }
}

/// Consumes `= value` after an unknown name, if present, up to the next `,`, without
/// parsing it (it need not be an expression).
fn skip_value(meta: &ParseNestedMeta) -> syn::Result<()> {
    if meta.input.peek(syn::Token![=]) {
        meta.value()?.step(|cursor| {
            let mut rest = *cursor;
            while let Some((tree, next)) = rest.token_tree() {
                if matches!(&tree, TokenTree::Punct(p) if p.as_char() == ',') {
                    break;
                }
                rest = next;
            }
            Ok(((), rest))
        })?;
    }
    Ok(())
}

/// A string literal value; `None` (with the error recorded) for any other expression.
fn string(
    meta: &ParseNestedMeta,
    name: &Ident,
    example: &str,
    errors: &mut Errors,
) -> syn::Result<Option<LitStr>> {
    let expr = ungroup(meta.value()?.parse()?);
    Ok(match expr {
        Expr::Lit(syn::ExprLit { lit: Lit::Str(lit), .. }) => Some(lit),
        other => {
            errors.at(other.span(), format_args!("`{name}` takes {example}"));
            None
        }
    })
}

fn int_literal(expr: &Expr) -> Option<&LitInt> {
    match expr {
        Expr::Lit(syn::ExprLit { lit: Lit::Int(lit), .. }) => Some(lit),
        _ => None,
    }
}

/// The longest `ttl` or `lease`: 100 years, in milliseconds (`Spec::MAX_DURATION` in the
/// runtime). Longer ones would overflow the stores' expiry times.
const MAX_DURATION_MS: u64 = 36_500 * 24 * 60 * 60 * 1000;

/// `600` (seconds) or `"500ms"`, `"10m"`, `"1h30m"`; greater than zero, at most 100
/// years.
fn duration(expr: &Expr, name: &Ident) -> syn::Result<u64> {
    let what = if name == "ttl" {
        "the time a completed message stays deduplicated"
    } else {
        "how long a claim holds without renewal"
    };
    let usage = format!(
        "`{name}` takes whole seconds (`{name} = 600`) or a string with units (`{name} = \"500ms\"`, `\"10m\"`, `\"1h30m\"`; units ms, s, m, h, d)"
    );
    let ms = match expr {
        Expr::Lit(syn::ExprLit { lit: Lit::Int(lit), .. }) => lit
            .base10_parse::<u64>()
            .ok()
            .and_then(|s| s.checked_mul(1000))
            .ok_or_else(|| syn::Error::new(lit.span(), &usage))?,
        Expr::Lit(syn::ExprLit { lit: Lit::Str(lit), .. }) => {
            parse_duration(&lit.value()).ok_or_else(|| syn::Error::new(lit.span(), &usage))?
        }
        other => return Err(syn::Error::new(other.span(), usage)),
    };
    if ms == 0 {
        return Err(syn::Error::new(
            expr.span(),
            format!("`{name}` must be greater than 0: it is {what}"),
        ));
    }
    if ms > MAX_DURATION_MS {
        return Err(syn::Error::new(
            expr.span(),
            format!(
                "`{name}` can be at most 100 years (`\"36500d\"`): the stores keep it as an \
                 expiry time, and it is {what}"
            ),
        ));
    }
    Ok(ms)
}

/// `backoff = "1s..5m"` (exponential from the first value, capped at the second),
/// `backoff = "2s"` or `backoff = 2` (fixed, whole seconds).
fn backoff(expr: &Expr) -> syn::Result<Backoff> {
    let usage = "`backoff` takes `\"base..cap\"` for an exponential backoff (`backoff = \"1s..5m\"`: \
                 attempt n waits up to base·2^(n−1), at most cap) or one duration for a fixed \
                 one (`backoff = \"2s\"`, or whole seconds: `backoff = 2`); units ms, s, m, h, d";
    let (text, span) = match expr {
        Expr::Lit(syn::ExprLit { lit: Lit::Int(lit), .. }) => {
            let ms = lit.base10_parse::<u64>().ok().and_then(|s| s.checked_mul(1000));
            let ms = ms.ok_or_else(|| syn::Error::new(lit.span(), usage))?;
            return checked_backoff(Backoff { base_ms: ms, cap_ms: ms }, lit.span());
        }
        Expr::Lit(syn::ExprLit { lit: Lit::Str(lit), .. }) => (lit.value(), lit.span()),
        other => return Err(syn::Error::new(other.span(), usage)),
    };
    let value = match text.split_once("..") {
        Some((base, cap)) => {
            let base = parse_duration(base).ok_or_else(|| syn::Error::new(span, usage))?;
            let cap = cap.strip_prefix('=').unwrap_or(cap);
            let cap = parse_duration(cap).ok_or_else(|| syn::Error::new(span, usage))?;
            if cap < base {
                return Err(syn::Error::new(
                    span,
                    "`backoff`'s cap (after `..`) must not be less than its base: write \
                     `\"base..cap\"`, e.g. `backoff = \"1s..5m\"`",
                ));
            }
            Backoff { base_ms: base, cap_ms: cap }
        }
        None => {
            let ms = parse_duration(&text).ok_or_else(|| syn::Error::new(span, usage))?;
            Backoff { base_ms: ms, cap_ms: ms }
        }
    };
    checked_backoff(value, span)
}

/// A backoff whose base is above zero and whose cap is at most 100 years.
fn checked_backoff(value: Backoff, span: Span) -> syn::Result<Backoff> {
    if value.base_ms == 0 {
        return Err(syn::Error::new(
            span,
            "`backoff` must start above 0: a retry that waits nothing hammers the dependency \
             that failed (the shortest is `\"1ms\"`)",
        ));
    }
    if value.cap_ms > MAX_DURATION_MS {
        return Err(syn::Error::new(span, "`backoff` can wait at most 100 years (`\"36500d\"`)"));
    }
    Ok(value)
}

/// Parses `"1h30m"`-style durations into milliseconds.
fn parse_duration(text: &str) -> Option<u64> {
    let mut rest = text.trim();
    if rest.is_empty() {
        return None;
    }
    let mut total: u64 = 0;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
        if digits == 0 {
            return None;
        }
        let number: u64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit()).unwrap_or(rest.len());
        let factor = match &rest[..unit_len] {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total = total.checked_add(number.checked_mul(factor)?)?;
    }
    Some(total)
}

/// `expr` without the invisible groups a `macro_rules!` fragment (`$ttl:expr`) wraps
/// it in, and without parentheses: `ttl = $ttl` reads as the literal it carries.
pub fn ungroup(expr: Expr) -> Expr {
    match expr {
        Expr::Group(group) => ungroup(*group.expr),
        Expr::Paren(paren) => ungroup(*paren.expr),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::{parse_duration, similar};

    #[test]
    fn similar_names() {
        let known = ["ttl", "lease", "retryable", "terminal", "max_attempts"];
        assert_eq!(similar("tll", known), Some("ttl"));
        assert_eq!(similar("retry", known), Some("retryable"));
        assert_eq!(similar("terminl", known), Some("terminal"));
        assert_eq!(similar("max_attempt", known), Some("max_attempts"));
        assert_eq!(similar("store", known), None);
        assert_eq!(similar("x", known), None);
    }

    /// Each value below nests deep enough to overflow the stack of syn's recursive
    /// parser (a stack overflow crashes the compiler): it is refused before that,
    /// with one error, and parsing goes on. (Found by the `key_template` fuzz target.)
    #[test]
    fn values_nested_too_deep_are_an_error_not_a_stack_overflow() {
        use syn::parse::Parser as _;
        // Brackets nested 10,000 deep would overflow the test's own tokenizer
        // (proc-macro2's, standing in for the compiler's, which has no such limit).
        let (deep, brackets) = (10_000, 1_000);
        for text in [
            format!("store = {}", "<".repeat(deep)),
            format!("_ = {}, ttl = 600", "<".repeat(deep)),
            format!("unknown = {}S", "!".repeat(deep)),
            format!("store = {}S{}", "(".repeat(brackets), ")".repeat(brackets)),
            format!("store = {}S{}", "[<".repeat(brackets), ">]".repeat(brackets)),
            format!("store = {}", "x + ".repeat(deep) + "x"),
        ] {
            let (mut args, mut errors) = (super::Args::default(), super::Errors::default());
            let parsed = syn::meta::parser(|meta| args.parse(meta, &mut errors)).parse_str(&text);
            assert!(parsed.is_ok(), "{}...: {parsed:?}", &text[..12]);
            assert_eq!(errors.count(), 1, "{}...", &text[..12]);
            assert!(args.store.get().is_none());
            if text.ends_with("ttl = 600") {
                assert_eq!(
                    args.ttl.get().map(|t| t.ms),
                    Some(600_000),
                    "the next argument is read"
                );
            }
        }
        // Values of the sizes people write parse as before.
        let text = "store = &*Box::leak(Box::new(Vec::<Option<Arc<u8>>>::with_capacity((((1))))))";
        let (mut args, mut errors) = (super::Args::default(), super::Errors::default());
        syn::meta::parser(|meta| args.parse(meta, &mut errors)).parse_str(text).unwrap();
        assert_eq!(errors.count(), 0);
        assert!(args.store.get().is_some());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms"), Some(500));
        assert_eq!(parse_duration("10m"), Some(600_000));
        assert_eq!(parse_duration("1h30m"), Some(5_400_000));
        assert_eq!(parse_duration("2d"), Some(172_800_000));
        assert_eq!(parse_duration("10"), None);
        assert_eq!(parse_duration("m"), None);
        assert_eq!(parse_duration("10 m"), None);
        assert_eq!(parse_duration(""), None);
    }
    #[test]
    fn backoffs() {
        let parse = |text: &str| {
            let expr: syn::Expr = syn::parse_str(text).unwrap();
            super::backoff(&expr).map(|b| (b.base_ms, b.cap_ms)).map_err(|e| e.to_string())
        };
        assert_eq!(parse(r#""1s..5m""#), Ok((1_000, 300_000)));
        assert_eq!(parse(r#"" 100ms .. 2s ""#), Ok((100, 2_000)));
        assert_eq!(parse(r#""1s..=1s""#), Ok((1_000, 1_000)));
        assert_eq!(parse(r#""2s""#), Ok((2_000, 2_000)));
        assert_eq!(parse("3"), Ok((3_000, 3_000)));
        for bad in [r#""1s..""#, r#""..5m""#, r#""1s...5m""#, r#""fast""#, r#""""#, "1.5", "x"] {
            assert!(parse(bad).unwrap_err().contains("`backoff` takes"), "{bad}");
        }
        assert!(parse(r#""5m..1s""#).unwrap_err().contains("must not be less than"));
        assert!(parse(r#""0s""#).unwrap_err().contains("must start above 0"));
        assert!(parse(r#""0ms..1s""#).unwrap_err().contains("must start above 0"));
        assert!(parse(r#""1s..36501d""#).unwrap_err().contains("at most 100 years"));
    }
}
