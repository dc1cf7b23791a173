//! Compile-time behaviour of the macros: every misuse is an error that points at the
//! user's token and says how to fix it; unusual but valid uses compile.

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    cases.compile_fail("tests/ui/*.rs");
    cases.pass("tests/ui/pass/*.rs");
}
