//! Examples of using meshwarp; run them with `cargo run -p meshwarp-examples --example NAME`.

pub mod mesh;
