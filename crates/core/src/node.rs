//! The node as a whole: what belongs to no single family. Today that is the
//! uninstall, which removes every family's pins (socket redirection, tc,
//! their plugins) under a pin root.

use std::path::Path;

use crate::dataplane::{self, DataplaneError};
use crate::tc::{self, TcError};

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Dataplane(#[from] DataplaneError),
    #[error(transparent)]
    Tc(#[from] TcError),
}

/// Removes meshwarp's pins (of this schema) under `pin_root` and nothing
/// else: the tc family (its tcx links first, so interfaces stop running it)
/// then the socket family. Accelerated connections continue on the normal
/// TCP path; routed packets take the kernel's forwarding again.
pub fn uninstall(pin_root: &Path) -> Result<(), NodeError> {
    tc::remove_pinned(pin_root)?;
    dataplane::remove_pinned(pin_root)?;
    Ok(())
}
