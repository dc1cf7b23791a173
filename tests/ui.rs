//! Compile-time behaviour of the macros: every misuse is an error that points at the
//! user's token and says how to fix it; unusual but valid uses compile.
//!
//! rustc's messages list the implementations of a trait, which depend on the enabled
//! features, so the expected output is recorded with all of them
//! (`cargo test --workspace --all-features`); with fewer, this test is skipped.

#[test]
fn ui() {
    if !cfg!(all(
        feature = "testing",
        feature = "redis-streams",
        feature = "redis-tls",
        feature = "rabbitmq",
        feature = "nats",
        feature = "kafka",
        feature = "postgres"
    )) {
        eprintln!("skipped: the expected compiler output is recorded with --all-features");
        return;
    }
    let cases = trybuild::TestCases::new();
    cases.compile_fail("tests/ui/*.rs");
    cases.pass("tests/ui/pass/*.rs");
}
