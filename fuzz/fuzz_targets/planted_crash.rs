//! A target that crashes on one input, `planted`: `fuzz/ci.sh` checks that the fuzzing
//! build reports it, so that a build which quietly lost its instrumentation (a stable
//! toolchain, a changed flag) cannot pass for a fuzzer that finds nothing.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data == b"planted" {
        panic!("the planted crash");
    }
});
