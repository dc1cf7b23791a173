//! End-to-end tests, examples and benchmarks of `idempotent` against the real
//! stores and brokers; nothing to use from here. See `tests/`, `examples/` and
//! `benches/` beside this file.
