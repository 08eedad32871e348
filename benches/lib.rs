//! Criterion benchmarks live in `redirect.rs`; see `README.md` in this directory.
