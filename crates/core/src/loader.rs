//! Loading BPF objects through libbpf: one load at a time per process, with
//! libbpf's warnings (where a rejected program's verifier log ends up)
//! collected so the error that reports the rejection carries them. Every
//! family (socket redirection, tc, plugins) and the kernel probe load here.

use std::sync::{Mutex, Once};

use libbpf_rs::PrintLevel;

/// libbpf messages of warning level and above, collected while loading so a
/// verifier rejection carries its log.
static LOAD_LOG: Mutex<Option<String>> = Mutex::new(None);
static PRINT_INIT: Once = Once::new();
/// One load at a time per process, so the collected log is this load's.
static LOAD_LOCK: Mutex<()> = Mutex::new(());

fn libbpf_print(level: PrintLevel, msg: String) {
    match level {
        PrintLevel::Debug => tracing::trace!(target: "libbpf", "{}", msg.trim_end()),
        PrintLevel::Info => tracing::debug!(target: "libbpf", "{}", msg.trim_end()),
        PrintLevel::Warn => {
            if let Ok(mut log) = LOAD_LOG.lock() {
                if let Some(buf) = log.as_mut() {
                    buf.push_str(&msg);
                    return;
                }
            }
            tracing::warn!(target: "libbpf", "{}", msg.trim_end());
        }
    }
}

/// Runs a libbpf load with its warnings collected (where the verifier log of a
/// rejected program ends up), one load at a time.
pub(crate) fn with_libbpf_log<T>(f: impl FnOnce() -> T) -> (T, String) {
    PRINT_INIT.call_once(|| {
        libbpf_rs::set_print(Some((PrintLevel::Debug, libbpf_print)));
    });
    let _load = crate::sys::lock(&LOAD_LOCK);
    *crate::sys::lock(&LOAD_LOG) = Some(String::new());
    let r = f();
    let log = crate::sys::lock(&LOAD_LOG).take().unwrap_or_default();
    (r, log)
}
