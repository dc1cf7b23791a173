//! Expansion snapshots: what `#[idempotent]` turns representative handlers into.
//! Regenerate with `MACROTEST=overwrite cargo test -p idempotent-macro-tests --test
//! expand` and review the diff.
//!
//! Needs `cargo-expand` (`cargo install --locked cargo-expand`). Without it the test is
//! skipped with a message, except under CI (`CI` set), where it fails.

#[test]
fn expansions() {
    let has_expand = std::process::Command::new(env!("CARGO"))
        .args(["expand", "--version"])
        .output()
        .is_ok_and(|out| out.status.success());
    if !has_expand {
        assert!(std::env::var_os("CI").is_none(), "CI must install cargo-expand");
        eprintln!("skipped: cargo-expand is not installed (cargo install --locked cargo-expand)");
        return;
    }
    macrotest::expand("tests/expand/*.rs");
    macrotest::expand("tests/expand/postgres/*.rs");
}
