//! Compile-time behaviour of the macros: every misuse is an error that points at the
//! user's token and says how to fix it; unusual but valid uses compile.
//!
//! rustc's messages list the implementations of a trait, which depend on the enabled
//! features: the expected output is recorded with this package's (the SQL stores).
//! Regenerate with `TRYBUILD=overwrite cargo test -p idempotent-macro-tests --test ui`
//! and review the diff.

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    cases.compile_fail("tests/ui/*.rs");
    cases.pass("tests/ui/pass/*.rs");
}
