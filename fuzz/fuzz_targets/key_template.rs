//! The macro's parsers on arbitrary text: key templates, `#[idempotent(...)]`
//! arguments and duration strings.
//!
//! Invariants: nothing panics; a template that parses, written back (escapes and
//! placeholders as the user writes them), parses to the same segments; a parsed
//! template has a placeholder, valid paths and pointers, and a separating text between
//! any two placeholders; `ttl`/`lease`/`backoff` strings parse to what a separate
//! reading of the documented grammar gives, within (0, 100 years].

#![no_main]

use libfuzzer_sys::fuzz_target;
use proc_macro2::Span;
use quote::quote;
use syn::LitStr;
use syn::parse::Parser;

#[allow(dead_code)]
#[path = "../../idempotent-macros/src/args.rs"]
mod args;
#[allow(dead_code)]
#[path = "../../idempotent-macros/src/template.rs"]
mod template;

use template::Segment;

const MAX_DURATION_MS: u64 = 36_500 * 24 * 60 * 60 * 1000;

/// The template as a user would write it: braces in text doubled.
fn written(segments: &[Segment]) -> String {
    let mut out = String::new();
    for segment in segments {
        match segment {
            Segment::Text(text) => out.push_str(&text.replace('{', "{{").replace('}', "}}")),
            Segment::Placeholder(parts) => {
                out.push('{');
                out.push_str(&parts.join("."));
                out.push('}');
            }
            Segment::Pointer(pointer) => {
                out.push('{');
                out.push_str(pointer);
                out.push('}');
            }
        }
    }
    out
}

fn check_template(source: &str) {
    let Ok(segments) = template::parse(&LitStr::new(source, Span::call_site())) else {
        return;
    };
    assert!(segments.iter().any(|s| !matches!(s, Segment::Text(_))), "{source:?}");
    for (i, segment) in segments.iter().enumerate() {
        match segment {
            Segment::Text(text) => {
                assert!(!text.is_empty(), "{source:?}");
                assert!(!matches!(segments.get(i + 1), Some(Segment::Text(_))), "{source:?}");
            }
            Segment::Placeholder(parts) => {
                assert!(parts.iter().all(|p| !p.is_empty()), "{source:?}");
            }
            Segment::Pointer(pointer) => {
                assert!(pointer.starts_with('/') && !pointer.contains('}'), "{source:?}");
            }
        }
        // A placeholder that another follows is followed by a separating text.
        let value = !matches!(segment, Segment::Text(_));
        let later = segments[i + 1..].iter().any(|s| !matches!(s, Segment::Text(_)));
        if value && later {
            let Some(Segment::Text(text)) = segments.get(i + 1) else {
                panic!("unseparated placeholders in {source:?}");
            };
            let first = text.chars().next().unwrap();
            assert!(!matches!(first, '%' | '0'..='9' | 'A'..='F'), "{source:?}");
        }
    }
    let again = written(&segments);
    let reparsed = template::parse(&LitStr::new(&again, Span::call_site()))
        .unwrap_or_else(|e| panic!("{source:?} written as {again:?} fails: {e}"));
    assert_eq!(reparsed, segments, "{source:?} written as {again:?}");
}

/// The documented duration grammar: one or more `<digits><unit>`, units ms, s, m, h,
/// d, surrounding whitespace ignored; `None` when malformed or over `u64` ms.
fn reference_duration(text: &str) -> Option<u64> {
    let text = text.trim();
    if text.is_empty() {
        return None;
    }
    let mut total = 0u64;
    let mut chars = text.chars().peekable();
    while chars.peek().is_some() {
        let mut digits = String::new();
        while let Some(c) = chars.next_if(char::is_ascii_digit) {
            digits.push(c);
        }
        let mut unit = String::new();
        while let Some(c) = chars.next_if(|c| !c.is_ascii_digit()) {
            unit.push(c);
        }
        if digits.is_empty() {
            return None;
        }
        let factor = match unit.as_str() {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            _ => return None,
        };
        let number: u64 = digits.parse().ok()?;
        total = total.checked_add(number.checked_mul(factor)?)?;
    }
    Some(total)
}

/// Parses `#[idempotent(<tokens>)]`'s arguments; `None` if they don't tokenize.
fn parse_args(tokens: proc_macro2::TokenStream) -> (args::Args, args::Errors, bool) {
    let mut parsed = args::Args::default();
    let mut errors = args::Errors::default();
    let ok = syn::meta::parser(|meta| parsed.parse(meta, &mut errors)).parse2(tokens).is_ok();
    (parsed, errors, ok)
}

fn check_durations(text: &str) {
    let lit = LitStr::new(text, Span::call_site());
    let expected = reference_duration(text).filter(|&ms| ms > 0 && ms <= MAX_DURATION_MS);
    for name in ["ttl", "lease"] {
        let name = syn::Ident::new(name, Span::call_site());
        let (parsed, errors, ok) = parse_args(quote!(#name = #lit));
        assert!(ok, "{text:?}");
        let got = if name == "ttl" { parsed.ttl.get() } else { parsed.lease.get() };
        assert_eq!(got.map(|m| m.ms), expected, "{name} = {text:?}");
        assert_eq!(errors.count(), usize::from(expected.is_none()), "{text:?}");
    }
    let (parsed, errors, ok) = parse_args(quote!(backoff = #lit));
    assert!(ok, "{text:?}");
    let expected = match text.split_once("..") {
        Some((base, cap)) => {
            let cap = cap.strip_prefix('=').unwrap_or(cap);
            reference_duration(base).zip(reference_duration(cap))
        }
        None => reference_duration(text).map(|ms| (ms, ms)),
    }
    .filter(|&(base, cap)| base > 0 && cap >= base && cap <= MAX_DURATION_MS);
    assert_eq!(parsed.backoff.get().map(|b| (b.base_ms, b.cap_ms)), expected, "{text:?}");
    assert_eq!(errors.count(), usize::from(expected.is_none()), "{text:?}");
}

fn check_args(text: &str) {
    // Whatever tokenizes goes through the argument parser without a panic, and what
    // it keeps is valid.
    let Ok(tokens) = syn::parse_str::<proc_macro2::TokenStream>(text) else { return };
    let (parsed, _, _) = parse_args(tokens);
    for ms in [parsed.ttl.get(), parsed.lease.get()].into_iter().flatten() {
        assert!(ms.ms > 0 && ms.ms <= MAX_DURATION_MS, "{text:?}");
    }
    if let Some(b) = parsed.backoff.get() {
        assert!(b.base_ms > 0 && b.base_ms <= b.cap_ms && b.cap_ms <= MAX_DURATION_MS);
    }
    if let Some((n, _)) = parsed.max_attempts.get() {
        assert!(*n >= 1, "{text:?}");
    }
    if let Some(key) = parsed.key.get() {
        check_template(&key.value());
    }
}

fuzz_target!(|text: &str| {
    check_template(text);
    check_durations(text);
    check_args(text);
});
