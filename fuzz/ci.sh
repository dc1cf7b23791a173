#!/usr/bin/env bash
# Builds every fuzz target and runs each for a bounded time (default 20 s, or the
# first argument) on its committed corpus. Exits non-zero if a target crashes; the
# crashing input is left under fuzz/artifacts/<target>/.
#
#     fuzz/ci.sh               # 20 s per target
#     fuzz/ci.sh 60            # 60 s per target
#     fuzz/ci.sh --build-only  # install cargo-fuzz if missing and build, nothing more
#
# Uses the nightly toolchain if rustup has one; otherwise stable with
# RUSTC_BOOTSTRAP=1 (cargo-fuzz's flags are unstable). Either way it first checks that
# the build reports a crash planted in a target of its own.
set -euo pipefail

cd "$(dirname "$0")"
seconds="${1:-20}"
targets=(key_template json_pointer_key record_decoders key_encoding)

command -v cargo-fuzz >/dev/null || cargo install --locked cargo-fuzz

# The instrumented build outside the clone (FUZZ_TARGET_DIR), so that later runs on
# this machine, from any clone, reuse its dependencies: from cold it takes minutes.
target_dir="${FUZZ_TARGET_DIR:-$HOME/.cache/idempotent/fuzz-target}"
mkdir -p "$target_dir"

if rustup toolchain list | grep -q '^nightly'; then
  fuzz=(cargo +nightly fuzz)
else
  echo "no nightly toolchain: fuzzing on stable with RUSTC_BOOTSTRAP=1"
  export RUSTC_BOOTSTRAP=1
  fuzz=(cargo fuzz)
fi

# A development build without AddressSanitizer: the targets are safe Rust (a bug
# shows as a panic, which libFuzzer reports), and these are short smoke runs. From
# cold it builds in about a minute and a half where the optimized, sanitized build
# took over half an hour beside the tests. For long local runs, `cargo fuzz run
# <target>` builds the optimized, sanitized one.
build=(--dev -s none --target-dir "$target_dir")
"${fuzz[@]}" build "${build[@]}"
[ "$seconds" != "--build-only" ] || exit 0
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

# The planted crash must be found, or nothing this build reports can be trusted.
mkdir -p "$scratch/planted"
printf planted > "$scratch/planted/input"
if "${fuzz[@]}" run "${build[@]}" planted_crash "$scratch/planted" -- -runs=10 \
    > "$scratch/planted.log" 2>&1; then
  cat "$scratch/planted.log"
  echo "the fuzzing build did not report the planted crash: it cannot find crashes" >&2
  exit 1
fi
grep -q "the planted crash" "$scratch/planted.log" || {
  cat "$scratch/planted.log"
  echo "the planted-crash target failed, but not with its crash" >&2
  exit 1
}
echo "== the planted crash is found"
rm -rf artifacts/planted_crash
for target in "${targets[@]}"; do
    echo "== $target: ${seconds}s"
    # New inputs go to a scratch directory; the committed corpus is only read.
    mkdir -p "$scratch/$target"
    "${fuzz[@]}" run "${build[@]}" "$target" "$scratch/$target" "corpus/$target" -- \
        -max_total_time="$seconds" -print_final_stats=1
done
echo "all targets ran ${seconds}s without a crash"
