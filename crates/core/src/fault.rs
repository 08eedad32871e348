//! Fault injection for crash-safety tests: named points in multi-step
//! changes (an in-place upgrade, a plugin load, a config update) where a
//! test makes the change fail or kills the process. Compiled to nothing
//! without feature `fault-injection`, which only this crate's own tests turn
//! on.

use std::sync::Mutex;

/// The fault set in this process (`None`: the `MESHWARP_FAULT` variable's).
static FAULT: Mutex<Option<String>> = Mutex::new(None);

/// A fault injected at a point (`fail:<point>`).
#[derive(Debug, thiserror::Error)]
#[error("injected fault at {0}")]
pub struct Injected(pub String);

/// `"fail:<point>"` makes [`point`] `<point>` return an error,
/// `"kill:<point>"` kills this process with SIGKILL there. The
/// `MESHWARP_FAULT` environment variable sets the same for a child process
/// when nothing was set here.
#[cfg(feature = "fault-injection")]
pub fn inject(fault: Option<&str>) {
    *crate::sys::lock(&FAULT) = fault.map(str::to_string);
}

/// A named point of a multi-step change: what the injected fault says, if
/// it names this point.
pub(crate) fn point(name: &str) -> Result<(), Injected> {
    if !cfg!(feature = "fault-injection") {
        return Ok(());
    }
    let set = crate::sys::lock(&FAULT).clone().or_else(|| std::env::var("MESHWARP_FAULT").ok());
    match set.as_deref().and_then(|f| f.split_once(':')) {
        Some(("kill", s)) if s == name => {
            tracing::warn!(point = name, "injected fault: killing this process");
            // SAFETY: signals this process.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            Ok(())
        }
        Some(("fail", s)) if s == name => Err(Injected(name.to_string())),
        _ => Ok(()),
    }
}
