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

/// The crate docs' section "What `#[idempotent]` expands to" shows the quickstart's
/// handler as `examples/quickstart.rs` has it, and its expansion as the reviewed
/// snapshot `tests/expand/quickstart.expanded.rs` has it (which `expansions` keeps
/// current). Needs no `cargo-expand`.
#[test]
fn the_docs_show_the_quickstart_handler_and_its_expansion() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let read = |path: std::path::PathBuf| {
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    };
    // From the line that starts with `start` to the next line that is `}`.
    let item = |text: &str, start: &str| -> String {
        let from = text.find(start).unwrap_or_else(|| panic!("no `{start}` in {text}"));
        let to = text[from..].find("\n}\n").expect("the item ends with `}` on a line");
        text[from..from + to + 2].to_owned()
    };
    let handler = item(&read(root.join("examples/quickstart.rs")), "#[idempotent(key");
    let case = read(root.join("macro-tests/tests/expand/quickstart.rs"));
    assert!(
        case.contains(&handler),
        "tests/expand/quickstart.rs must hold the quickstart's handler:\n{handler}"
    );
    let expanded = item(
        &read(root.join("macro-tests/tests/expand/quickstart.expanded.rs")),
        "async fn charge(",
    );

    let docs: String = read(root.join("src/lib.rs"))
        .lines()
        .filter_map(|line| line.strip_prefix("//!"))
        .map(|line| format!("{}\n", line.strip_prefix(' ').unwrap_or(line)))
        .collect();
    let section = docs
        .split("\n# ")
        .find(|s| s.starts_with("What `#[idempotent]` expands to"))
        .expect("the crate docs have a section \"What `#[idempotent]` expands to\"");
    for (what, text) in [("handler", &handler), ("expansion", &expanded)] {
        assert!(
            section.contains(text.as_str()),
            "the docs' section must show the quickstart's {what} as it is now:\n{text}"
        );
    }
}
