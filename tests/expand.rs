//! Expansion snapshots: what `#[idempotent]` turns representative handlers into.
//! Regenerate with `MACROTEST=overwrite cargo test --test expand` and review the diff.

#[test]
fn expansions() {
    macrotest::expand("tests/expand/*.rs");
}
