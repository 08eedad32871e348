//! Where each family's pins live on bpffs, written once for all of them.
//!
//! ```text
//! <pin_root>/v<SCHEMA>/                    the socket family
//! <pin_root>/v<SCHEMA>/tc/                 the tc family
//! <family dir>/maps/<map>, progs/<prog>, links/<link>
//! <family dir>/plugins/<id>/{prog,maps/}   a plugin loaded into the family's chain
//! ```
//!
//! The directory name carries the schema version, so an agent never adopts
//! maps of another layout.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use meshwarp_bpf::names;
use meshwarp_bpf::shared::SCHEMA_VERSION;

use crate::error::IoError;

/// The pin layout of one family: its directory and the programs, maps and
/// links every instance of it has.
#[derive(Debug, Clone)]
pub struct FamilyPins {
    dir: PathBuf,
    progs: &'static [&'static str],
    maps: &'static [&'static str],
    /// Maps newer than the family: an older build's instance lacks them
    /// until an upgrade creates them ([`crate::upgrade`]).
    added_maps: &'static [&'static str],
    links: &'static [&'static str],
}

/// The directory of this build's schema under `pin_root`.
pub fn schema_dir(pin_root: &Path) -> PathBuf {
    pin_root.join(format!("v{SCHEMA_VERSION}"))
}

impl FamilyPins {
    /// The socket family (sockops, sk_msg and the guard's programs).
    pub fn sockredir(pin_root: &Path) -> Self {
        Self {
            dir: schema_dir(pin_root),
            progs: &names::SOCKREDIR_PROGS,
            maps: &names::SOCKREDIR_MAPS,
            added_maps: &names::SOCKREDIR_ADDED_MAPS,
            links: &[names::PROG_SOCKOPS, names::PROG_SETSOCKOPT, names::PROG_CONNECT4, names::PROG_CONNECT6],
        }
    }

    /// The tc family; its links (one per attached interface and direction)
    /// come and go with attachments.
    pub fn tcredir(pin_root: &Path) -> Self {
        Self {
            dir: schema_dir(pin_root).join("tc"),
            progs: &names::TCREDIR_PROGS,
            maps: &names::TCREDIR_MAPS,
            added_maps: &[],
            links: &[],
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn maps_dir(&self) -> PathBuf {
        self.dir.join("maps")
    }

    pub fn map(&self, name: &str) -> PathBuf {
        self.maps_dir().join(name)
    }

    pub fn prog(&self, name: &str) -> PathBuf {
        self.dir.join("progs").join(name)
    }

    pub fn links_dir(&self) -> PathBuf {
        self.dir.join("links")
    }

    pub fn link(&self, name: &str) -> PathBuf {
        self.links_dir().join(name)
    }

    /// Every pin an instance always has: links, programs, the family's own
    /// maps and the maps its plugin chain shares.
    pub fn fixed(&self) -> Vec<PathBuf> {
        let links = self.links.iter().map(|l| self.link(l));
        let progs = self.progs.iter().map(|p| self.prog(p));
        let maps = self.maps.iter().chain(&names::PLUGIN_HOST_MAPS).map(|m| self.map(m));
        links.chain(progs).chain(maps).collect()
    }

    /// The maps an instance pinned by an older build may lack (see
    /// [`names::SOCKREDIR_ADDED_MAPS`]).
    pub fn added_maps(&self) -> &'static [&'static str] {
        self.added_maps
    }

    /// The fixed pins that are missing; all of them: nothing is pinned.
    pub fn missing(&self) -> (Vec<String>, bool) {
        let fixed = self.fixed();
        let missing: Vec<String> = fixed.iter().filter(|p| !p.exists()).map(|p| p.display().to_string()).collect();
        let none = missing.len() == fixed.len();
        (missing, none)
    }

    /// Holds the family for this process until dropped: one pin root, one
    /// process that allocates its rule slots (a daemon and an embedding
    /// controller on the same pins would hand out the same slot twice).
    /// Adoption after the holder exited is fine: the kernel drops the lock
    /// with its file.
    pub fn lock(&self) -> Result<PinLock, IoError> {
        fs::create_dir_all(&self.dir).map_err(|e| IoError::new(format!("creating {}", self.dir.display()), e))?;
        let dir = fs::File::open(&self.dir).map_err(|e| IoError::new(format!("opening {}", self.dir.display()), e))?;
        match nix::fcntl::Flock::lock(dir, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Ok(lock) => Ok(PinLock(lock)),
            Err((_, errno)) => Err(IoError::new(
                format!(
                    "{} is held by another meshwarp process (one pin root per daemon or embedding controller)",
                    self.dir.display()
                ),
                io::Error::from(errno),
            )),
        }
    }

    /// Whether `e` is [`FamilyPins::lock`] finding the pins held.
    pub fn is_held(e: &IoError) -> bool {
        e.source.raw_os_error() == Some(libc::EWOULDBLOCK)
    }

    pub fn create_dirs(&self) -> Result<(), IoError> {
        for d in [self.links_dir(), self.dir.join("progs"), self.maps_dir()] {
            fs::create_dir_all(&d).map_err(|e| IoError::new(format!("creating {}", d.display()), e))?;
        }
        Ok(())
    }

    /// Removes the `next-*` pins an upgrade cut short left next to the
    /// programs and links ([`crate::upgrade`] pins a replacement there, then
    /// renames it over the old pin).
    pub fn clear_stray(&self) {
        for d in [self.dir.join("progs"), self.links_dir()] {
            for e in fs::read_dir(&d).into_iter().flatten().flatten() {
                if e.file_name().to_string_lossy().starts_with(NEXT_PREFIX) {
                    tracing::info!(pin = %e.path().display(), "removing a pin a cut-short upgrade left");
                    let _ = fs::remove_file(e.path());
                }
            }
        }
    }

    /// Unpins the family: links first (which detaches what they attach),
    /// then its plugins, programs and maps, then the directories if empty.
    /// Anything else found there is not ours and stays.
    pub fn remove(&self) -> Result<(), IoError> {
        let unpin = |p: &Path| match fs::remove_file(p) {
            Ok(()) => {
                tracing::debug!(pin = %p.display(), "unpinned");
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(IoError::new(format!("unpinning {}", p.display()), e)),
        };
        // Every link, and every program: the optional ones too.
        for d in [self.links_dir(), self.dir.join("progs")] {
            if let Ok(entries) = fs::read_dir(d) {
                for e in entries.flatten() {
                    unpin(&e.path())?;
                }
            }
        }
        remove_plugin_pins(&self.dir)
            .map_err(|e| IoError::new(format!("unpinning plugins under {}", self.dir.display()), e))?;
        self.clear_stray();
        for p in self.fixed().into_iter().chain(self.added_maps.iter().map(|m| self.map(m))) {
            unpin(&p)?;
        }
        for d in [self.links_dir(), self.dir.join("progs"), self.maps_dir(), self.dir.clone()] {
            let _ = fs::remove_dir(d);
        }
        Ok(())
    }
}

/// Pins a BPF object (program, map or link) by fd at `path`.
pub(crate) fn pin_fd(fd: std::os::fd::BorrowedFd<'_>, path: &Path) -> Result<(), IoError> {
    use std::os::fd::AsRawFd;
    let err = |source| IoError::new(format!("pinning {}", path.display()), source);
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| err(io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte in the path")))?;
    // SAFETY: a valid fd and NUL-terminated path.
    let rc = unsafe { libbpf_rs::libbpf_sys::bpf_obj_pin(fd.as_raw_fd(), c.as_ptr()) };
    if rc < 0 {
        return Err(err(io::Error::from_raw_os_error(-rc)));
    }
    Ok(())
}

/// The name prefix of a replacement pinned next to the pin it replaces.
pub(crate) const NEXT_PREFIX: &str = "next-";

/// A family's pin directory, held by this process (see [`FamilyPins::lock`]).
#[derive(Debug)]
pub struct PinLock(#[allow(dead_code)] nix::fcntl::Flock<fs::File>);

/// The schema directories under `pin_root` other than this build's
/// (`v<N>`): pins an older or newer meshwarp left, which this build cannot
/// read (its maps' layouts differ) but can remove.
pub fn other_schema_dirs(pin_root: &Path) -> Vec<PathBuf> {
    let ours = format!("v{SCHEMA_VERSION}");
    let mut dirs: Vec<PathBuf> = fs::read_dir(pin_root)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name != ours && name.len() > 1 && name.starts_with('v') && name[1..].bytes().all(|b| b.is_ascii_digit())
        })
        .map(|e| e.path())
        .collect();
    dirs.sort();
    dirs
}

/// Unpins everything under another schema's directory (see
/// [`other_schema_dirs`]), whose pin names this build does not know: the
/// links of its tc family and of its socket family first (which detaches
/// what they attach), then every other pin of the family layout (`links`,
/// `progs`, `maps`, `plugins`, `tc`), then the directories. Refused while
/// a process of that build holds the directory (its lock).
pub fn remove_schema_dir(dir: &Path) -> Result<(), IoError> {
    let err = |what: &Path, e| IoError::new(format!("unpinning {}", what.display()), e);
    let _held = [dir.join("tc"), dir.to_path_buf()]
        .into_iter()
        .filter(|d| d.is_dir())
        .map(|d| FamilyPins { dir: d, progs: &[], maps: &[], added_maps: &[], links: &[] }.lock())
        .collect::<Result<Vec<_>, _>>()?;
    for links in [dir.join("tc").join("links"), dir.join("links")] {
        for e in fs::read_dir(&links).into_iter().flatten().flatten() {
            fs::remove_file(e.path()).map_err(|x| err(&e.path(), x))?;
        }
    }
    for sub in ["tc", "links", "progs", "maps", "plugins"] {
        remove_tree(&dir.join(sub)).map_err(|x| err(&dir.join(sub), x))?;
    }
    let _ = fs::remove_dir(dir);
    Ok(())
}

/// Removes the files and directories under `dir` (pins, on bpffs), and it.
fn remove_tree(dir: &Path) -> io::Result<()> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Ok(());
    };
    for e in entries.flatten() {
        if e.file_type()?.is_dir() {
            remove_tree(&e.path())?;
        } else {
            fs::remove_file(e.path())?;
        }
    }
    fs::remove_dir(dir)
}

/// The directory of plugin `id` of the chain of the family pinned in `family_dir`.
pub fn plugin_dir(family_dir: &Path, id: u32) -> PathBuf {
    family_dir.join("plugins").join(id.to_string())
}

/// Removes every plugin pin under a family's pin directory (teardown).
fn remove_plugin_pins(family_dir: &Path) -> io::Result<()> {
    let root = family_dir.join("plugins");
    let Ok(entries) = fs::read_dir(&root) else {
        return Ok(());
    };
    for e in entries.flatten() {
        remove_plugin_dir(&e.path())?;
    }
    let _ = fs::remove_dir(&root);
    Ok(())
}

pub(crate) fn remove_plugin_dir(dir: &Path) -> io::Result<()> {
    if let Ok(maps) = fs::read_dir(dir.join("maps")) {
        for m in maps.flatten() {
            fs::remove_file(m.path())?;
        }
    }
    let _ = fs::remove_dir(dir.join("maps"));
    match fs::remove_file(dir.join("prog")) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    fs::remove_dir(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_share_one_shape_under_the_schema_dir() {
        let root = Path::new("/sys/fs/bpf/mw");
        let (s, t) = (FamilyPins::sockredir(root), FamilyPins::tcredir(root));
        assert_eq!(t.dir(), s.dir().join("tc"));
        assert_eq!(s.map("mw_pairs"), s.dir().join("maps/mw_pairs"));
        assert_eq!(plugin_dir(t.dir(), 3), t.dir().join("plugins/3"));
        for f in [&s, &t] {
            let fixed = f.fixed();
            assert!(fixed.contains(&f.map(names::MAP_CHAIN)), "plugin host maps are pinned by every family");
            let mut uniq = fixed.clone();
            uniq.sort();
            uniq.dedup();
            assert_eq!(uniq.len(), fixed.len(), "no pin listed twice");
        }
        assert_eq!(s.fixed()[0], s.link(names::PROG_SOCKOPS), "links first");
    }
}
