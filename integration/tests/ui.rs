//! Compile-time behaviour of the macros: every misuse is an error that points at the
//! user's token and says how to fix it; unusual but valid uses compile.
//!
//! rustc's messages list the implementations of a trait, which depend on the enabled
//! features; this package always enables all of them, so the expected output is
//! recorded with every feature on.

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    cases.compile_fail("tests/ui/*.rs");
    cases.pass("tests/ui/pass/*.rs");
}
