#!/usr/bin/env bash
# Builds every fuzz target and runs each for a bounded time (default 20 s, or the
# first argument) on its committed corpus. Exits non-zero if a target crashes; the
# crashing input is left under fuzz/artifacts/<target>/.
#
#     fuzz/ci.sh          # 20 s per target
#     fuzz/ci.sh 60       # 60 s per target
#
# Needs a nightly toolchain (`rustup toolchain install nightly`).
set -euo pipefail

cd "$(dirname "$0")"
seconds="${1:-20}"
targets=(key_template json_pointer_key record_decoders key_encoding)

command -v cargo-fuzz >/dev/null || cargo install --locked cargo-fuzz

# The instrumented build outside the clone (FUZZ_TARGET_DIR), so that later runs on
# this machine, from any clone, reuse its dependencies: from cold it takes minutes.
target_dir="${FUZZ_TARGET_DIR:-$HOME/.cache/idempotent/fuzz-target}"
mkdir -p "$target_dir"

cargo +nightly fuzz build --target-dir "$target_dir"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
for target in "${targets[@]}"; do
    echo "== $target: ${seconds}s"
    # New inputs go to a scratch directory; the committed corpus is only read.
    mkdir -p "$scratch/$target"
    cargo +nightly fuzz run --target-dir "$target_dir" "$target" "$scratch/$target" "corpus/$target" -- \
        -max_total_time="$seconds" -print_final_stats=1
done
echo "all targets ran ${seconds}s without a crash"
