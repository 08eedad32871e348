//! The daemon's config file: any text is a config or a clear error, never a
//! panic (figment/TOML parsing, then the checks of `options`: grants,
//! socket mode, mTLS files, limits).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = meshwarp_cli::config::from_toml(text);
    }
});
