//! The node as a whole: [`Node`] owns the families one node runs (socket
//! redirection, tc, their plugin chains), their opening or adoption, and
//! [`uninstall`] removes every family's pins under a pin root.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::dataplane::{self, Dataplane, DataplaneConfig, DataplaneError};
use crate::pins::FamilyPins;
use crate::plugin::PluginChain;
use crate::tc::{self, TcConfig, TcDataplane, TcError};

/// What one node runs: the socket family always; the tc family and the
/// plugin chains where this kernel and host allow them (else why not).
#[derive(Debug, Clone)]
pub struct Node {
    pub dataplane: Arc<Dataplane>,
    pub tc: Result<Arc<TcDataplane>, String>,
    pub plugins: Result<Arc<PluginChain>, String>,
}

/// How to open a [`Node`].
#[derive(Debug, Clone, Default)]
pub struct NodeConfig {
    pub dataplane: DataplaneConfig,
    /// Network namespace whose interfaces tc routes name (`None`: this
    /// process's).
    pub netns: Option<PathBuf>,
    /// How long to wait for pins another process holds (a daemon still
    /// draining while its successor starts); zero: refuse at once.
    pub pin_lock_wait: std::time::Duration,
}

/// Runs `open` until it does not find the pins held, or `wait` passed.
fn when_free<T, E>(
    what: &str,
    wait: std::time::Duration,
    held: impl Fn(&E) -> bool,
    open: impl Fn() -> Result<T, E>,
) -> Result<T, E> {
    let deadline = std::time::Instant::now() + wait;
    let mut told = false;
    loop {
        match open() {
            Err(e) if held(&e) && std::time::Instant::now() < deadline => {
                if !told {
                    tracing::info!("the {what} pins are held by another process (draining?): waiting up to {wait:?}");
                    told = true;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            r => return r,
        }
    }
}

impl Node {
    /// Loads or adopts every family pinned under `cfg.dataplane.pin_root`.
    /// The socket family must open; tc and plugins that cannot are reported
    /// (logged, and kept as the reason) and the node runs without them.
    pub fn open(cfg: &NodeConfig) -> Result<Self, NodeError> {
        let dp_held = |e: &DataplaneError| matches!(e, DataplaneError::Io(io) if FamilyPins::is_held(io));
        let dp = Arc::new(when_free("socket", cfg.pin_lock_wait, dp_held, || Dataplane::open(&cfg.dataplane))?);
        tracing::info!(origin = ?dp.origin(), pin_dir = %dp.pin_dir().display(), pairs = dp.pairs().len(),
            captures = dp.captures().len(), "data path ready");
        let tc_cfg = TcConfig {
            pin_root: cfg.dataplane.pin_root.clone(),
            netns: cfg.netns.clone(),
            max_routes: cfg.dataplane.max_rules,
        };
        let tc_held = |e: &TcError| matches!(e, TcError::Io(io) if FamilyPins::is_held(io));
        let tc = match when_free("tc", cfg.pin_lock_wait, tc_held, || TcDataplane::open(&tc_cfg)) {
            Ok(tc) => {
                tracing::info!(routes = tc.routes().len(), attachments = tc.attachments().len(), "tc data path ready");
                Ok(Arc::new(tc))
            }
            Err(e) => {
                tracing::warn!("tc redirection unavailable: {e}");
                Err(e.to_string())
            }
        };
        Ok(Self::with(dp, tc))
    }

    /// A node of an already open socket family (and tc family, or why not);
    /// opens the plugin chains over them.
    pub fn with(dataplane: Arc<Dataplane>, tc: Result<Arc<TcDataplane>, String>) -> Self {
        let plugins = PluginChain::open(Some(&dataplane), tc.as_deref().ok()).map(Arc::new).map_err(|e| {
            tracing::warn!("plugins unavailable: {e}");
            e.to_string()
        });
        Self { dataplane, tc, plugins }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Dataplane(#[from] DataplaneError),
    #[error(transparent)]
    Tc(#[from] TcError),
}

/// Removes meshwarp's pins under `pin_root` and nothing else: the tc family
/// (its tcx links first, so interfaces stop running it) then the socket
/// family, of this schema and of any other a previous or later build left
/// (`v<N>`: the daemon refuses to start next to those). New connections take the normal TCP path;
/// connections accelerated before stay on their fast path until they close
/// (their sockets keep the programs and maps alive); routed packets take the
/// kernel's forwarding again. The caller holds the pins or knows no process
/// does (see [`uninstall_unheld`]).
pub fn uninstall(pin_root: &Path) -> Result<(), NodeError> {
    tc::remove_pinned(pin_root)?;
    dataplane::remove_pinned(pin_root)?;
    for dir in crate::pins::other_schema_dirs(pin_root) {
        tracing::info!(dir = %dir.display(), "removing the pins of another meshwarp schema");
        crate::pins::remove_schema_dir(&dir).map_err(|e| NodeError::Dataplane(DataplaneError::Io(e)))?;
    }
    crate::guard::remove_lock(&crate::pins::schema_dir(pin_root));
    // Only if empty now: anything else there is not ours.
    let _ = std::fs::remove_dir(pin_root);
    Ok(())
}

/// [`uninstall`] for a process that holds no handle: refused while another
/// process (a running daemon, an embedding controller) holds a family's
/// pins, which it would otherwise pull from under it.
pub fn uninstall_unheld(pin_root: &Path) -> Result<(), NodeError> {
    let tc = FamilyPins::tcredir(pin_root);
    let _tc = tc.dir().exists().then(|| tc.lock()).transpose().map_err(|e| NodeError::Tc(TcError::Io(e)))?;
    let sock = FamilyPins::sockredir(pin_root);
    let _sock = sock
        .dir()
        .exists()
        .then(|| sock.lock())
        .transpose()
        .map_err(|e| NodeError::Dataplane(DataplaneError::Io(e)))?;
    uninstall(pin_root)
}
