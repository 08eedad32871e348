//! Plugin objects arrive from callers and are parsed (by `object` and by
//! libbpf) in the root daemon: any bytes must give a verdict, never a crash.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meshwarp_core::plugin::inspect_object;
use meshwarp_core::Hook;

fuzz_target!(|data: &[u8]| {
    let hook = match data.first().map(|b| b % 3) {
        Some(0) => Hook::Connection,
        Some(1) => Hook::Message,
        _ => Hook::Packet,
    };
    let _ = inspect_object(hook, data.get(1..).unwrap_or_default());
});
