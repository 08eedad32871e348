//! In-place upgrade of a pinned family: the programs a pinned data path runs
//! are replaced with this build's while its maps (rules, links, sockets,
//! counters) and attachments stay, so no connection is torn down and no rule
//! is lost.
//!
//! Each step ([`Swap`]) is one atomic kernel operation: a prog-array entry, a
//! bpf_link's program (cgroup, tcx), the SOCKMAP's sk_msg program, a
//! tracepoint link (a new link pinned over the old one), a program pin
//! (renamed over the old one). A step that fails undoes the ones before it,
//! newest first, so a refused upgrade leaves the old build running as it was.
//! A process killed between two steps leaves a mix of both builds' programs
//! over the same maps — the schema is the same, and `MW_SCHEMA_VERSION`
//! covers the contract between programs too (skb cb, chain flags, the fins),
//! so any mix works — and an empty build id (the first step), which the next
//! opener of any build sees and finishes the upgrade; stray `next-*` pins of a
//! cut-short step are cleared first ([`FamilyPins::clear_stray`](crate::pins::FamilyPins::clear_stray)).
//!
//! Sockets already in the SOCKMAP keep the sk_msg program they were added
//! under (the kernel copies it into each socket's psock): connections open
//! across an upgrade finish on the old build's sk_msg, new ones get the new.

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

use libbpf_rs::libbpf_sys;
use meshwarp_bpf::names;
use meshwarp_bpf::shared::{Build, BUILD_LEN};

use crate::maps::{MapError, TypedMap};

/// What opening a family did about pinned programs of another build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Upgrade {
    /// They were this build's (or this open loaded them).
    None,
    /// They were replaced in place with this build's, in these steps.
    Done { from: String, steps: Vec<String> },
    /// They could not be replaced and keep running, unchanged.
    Failed { reason: String },
}

/// An upgrade that did not happen; whatever it changed was put back.
#[derive(Debug, thiserror::Error)]
pub enum UpgradeError {
    #[error("loading this build's programs over the pinned maps: {source}\n--- verifier/libbpf log ---\n{log}")]
    Load {
        #[source]
        source: libbpf_rs::Error,
        log: String,
    },
    #[error("the pinned instance has no map {0} that this build's programs use")]
    MissingMap(String),
    #[error("{what}: {source}")]
    Bpf {
        what: String,
        #[source]
        source: libbpf_rs::Error,
    },
    #[error("upgrade step {step}: {source}")]
    Step {
        step: String,
        #[source]
        source: io::Error,
    },
    #[error("upgrade step {step}: {source}")]
    Map {
        step: String,
        #[source]
        source: MapError,
    },
    #[error("upgrade step {0} failed (injected fault)")]
    Injected(String),
}

fn step_err(step: &str, rc: i32) -> UpgradeError {
    let errno = if rc < 0 { -rc } else { io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO) };
    UpgradeError::Step { step: step.to_string(), source: io::Error::from_raw_os_error(errno) }
}

fn cpath(step: &str, p: &Path) -> Result<CString, UpgradeError> {
    CString::new(p.as_os_str().as_encoded_bytes()).map_err(|_| UpgradeError::Step {
        step: step.to_string(),
        source: io::Error::new(io::ErrorKind::InvalidInput, format!("{} contains a NUL byte", p.display())),
    })
}

fn owned(step: &str, fd: RawFd) -> Result<OwnedFd, UpgradeError> {
    if fd < 0 {
        return Err(step_err(step, fd));
    }
    // SAFETY: a new fd returned by libbpf, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Opens a pinned object (program, map or link).
pub(crate) fn obj_get(step: &str, p: &Path) -> Result<OwnedFd, UpgradeError> {
    let c = cpath(step, p)?;
    // SAFETY: NUL-terminated path.
    owned(step, unsafe { libbpf_sys::bpf_obj_get(c.as_ptr()) })
}

pub(crate) fn obj_pin(step: &str, fd: BorrowedFd<'_>, p: &Path) -> Result<(), UpgradeError> {
    crate::pins::pin_fd(fd, p).map_err(|e| UpgradeError::Step { step: step.to_string(), source: e.source })
}

/// Pins `fd` at `path` in one step for a reader: pinned next to it first,
/// then renamed over it (bpffs renames atomically, dropping the old pin).
fn pin_over(step: &str, fd: BorrowedFd<'_>, path: &Path) -> Result<(), UpgradeError> {
    let next = next_path(path);
    let _ = fs::remove_file(&next);
    obj_pin(&format!("{step} (pinning {})", next.display()), fd, &next)?;
    // A process killed here leaves the `next-` pin for FamilyPins::clear_stray.
    let r = fault_point(&format!("{step}/pinned")).and_then(|()| {
        fs::rename(&next, path)
            .map_err(|source| UpgradeError::Step { step: format!("{step} (renaming over {})", path.display()), source })
    });
    if r.is_err() {
        let _ = fs::remove_file(&next);
    }
    r
}

/// Where a replacement is pinned before it is renamed over `path` (bpffs
/// refuses names with a dot).
fn next_path(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    path.with_file_name(format!("{}{name}", crate::pins::NEXT_PREFIX))
}

pub(crate) fn prog_fd_by_id(step: &str, id: u32) -> Result<OwnedFd, UpgradeError> {
    // SAFETY: plain syscall wrapper.
    owned(&format!("{step} (program {id})"), unsafe { libbpf_sys::bpf_prog_get_fd_by_id(id) })
}

fn link_prog_id(step: &str, link: BorrowedFd<'_>) -> Result<u32, UpgradeError> {
    // SAFETY: zeroed is a valid bpf_link_info.
    let mut info: libbpf_sys::bpf_link_info = unsafe { std::mem::zeroed() };
    let mut len = size_of::<libbpf_sys::bpf_link_info>() as u32;
    // SAFETY: valid fd, buffer and its length.
    let rc = unsafe { libbpf_sys::bpf_link_get_info_by_fd(link.as_raw_fd(), &mut info, &mut len) };
    if rc < 0 {
        return Err(step_err(&format!("{step} (link info)"), rc));
    }
    Ok(info.prog_id)
}

fn link_update(step: &str, link: BorrowedFd<'_>, new: BorrowedFd<'_>, old: BorrowedFd<'_>) -> Result<(), UpgradeError> {
    // SAFETY: zeroed opts with the right size are valid input.
    let mut opts: libbpf_sys::bpf_link_update_opts = unsafe { std::mem::zeroed() };
    opts.sz = size_of::<libbpf_sys::bpf_link_update_opts>() as _;
    // Only if the link still runs the program read a moment ago: a
    // concurrent change is refused rather than overwritten.
    opts.flags = libbpf_sys::BPF_F_REPLACE;
    opts.old_prog_fd = old.as_raw_fd() as u32;
    // SAFETY: valid fds and options.
    let rc = unsafe { libbpf_sys::bpf_link_update(link.as_raw_fd(), new.as_raw_fd(), &opts) };
    if rc < 0 {
        return Err(step_err(step, rc));
    }
    Ok(())
}

fn prog_array_put(step: &str, map: BorrowedFd<'_>, key: u32, prog: BorrowedFd<'_>) -> Result<(), UpgradeError> {
    let val = prog.as_raw_fd() as u32;
    // SAFETY: a prog array takes a u32 key and a u32 program fd.
    let rc = unsafe {
        libbpf_sys::bpf_map_update_elem(
            map.as_raw_fd(),
            (&key as *const u32).cast(),
            (&val as *const u32).cast(),
            libbpf_sys::BPF_ANY as u64,
        )
    };
    if rc < 0 {
        return Err(step_err(step, rc));
    }
    Ok(())
}

/// The id of the program at `key` of a prog array, if any.
fn prog_array_get(step: &str, map: BorrowedFd<'_>, key: u32) -> Result<Option<u32>, UpgradeError> {
    let mut id = 0u32;
    // SAFETY: a prog array's lookup from user space yields the program id.
    let rc = unsafe {
        libbpf_sys::bpf_map_lookup_elem(map.as_raw_fd(), (&key as *const u32).cast(), (&mut id as *mut u32).cast())
    };
    match rc {
        0 => Ok(Some(id)),
        rc if rc == -libc::ENOENT => Ok(None),
        rc => Err(step_err(&format!("{step} (lookup)"), rc)),
    }
}

/// The program attached to a SOCKMAP as its sk_msg verdict, if any.
fn sockmap_verdict_id(step: &str, map: BorrowedFd<'_>) -> Result<Option<u32>, UpgradeError> {
    let (mut flags, mut ids, mut cnt) = (0u32, [0u32; 1], 1u32);
    // SAFETY: valid fd and out-buffers of the sizes given.
    let rc = unsafe {
        libbpf_sys::bpf_prog_query(
            map.as_raw_fd(),
            libbpf_sys::BPF_SK_MSG_VERDICT,
            0,
            &mut flags,
            ids.as_mut_ptr(),
            &mut cnt,
        )
    };
    if rc < 0 {
        return Err(step_err(&format!("{step} (query)"), rc));
    }
    Ok((cnt > 0).then_some(ids[0]))
}

fn sockmap_verdict(step: &str, map: BorrowedFd<'_>, prog: BorrowedFd<'_>) -> Result<(), UpgradeError> {
    // The kernel swaps the map's program in one exchange (no BPF_F_REPLACE
    // for SOCKMAP attachments).
    // SAFETY: valid fds.
    let rc =
        unsafe { libbpf_sys::bpf_prog_attach(prog.as_raw_fd(), map.as_raw_fd(), libbpf_sys::BPF_SK_MSG_VERDICT, 0) };
    if rc < 0 {
        return Err(step_err(step, rc));
    }
    Ok(())
}

pub(crate) fn raw_tp_open(step: &str, prog: BorrowedFd<'_>) -> Result<OwnedFd, UpgradeError> {
    // SAFETY: a tp_btf program fd; NULL name: its own BTF target.
    owned(&format!("{step} (attaching)"), unsafe {
        libbpf_sys::bpf_raw_tracepoint_open(std::ptr::null(), prog.as_raw_fd())
    })
}

fn fault_point(step: &str) -> Result<(), UpgradeError> {
    crate::fault::point(step).map_err(|_| UpgradeError::Injected(step.to_string()))
}

type Undo = Box<dyn FnOnce() -> Result<(), UpgradeError>>;

/// The steps of one upgrade done so far, with how to undo each.
#[derive(Default)]
pub(crate) struct Swap {
    done: Vec<(String, Undo)>,
}

impl Swap {
    fn record(&mut self, step: String, undo: Undo) -> Result<(), UpgradeError> {
        self.done.push((step.clone(), undo));
        fault_point(&step)
    }

    /// Names of the steps done (in order).
    pub(crate) fn steps(&self) -> Vec<String> {
        self.done.iter().map(|(s, _)| s.clone()).collect()
    }

    /// Points entry `key` of the pinned prog array `map` at `prog`.
    pub(crate) fn prog_array(&mut self, map: &Path, key: u32, prog: BorrowedFd<'_>) -> Result<(), UpgradeError> {
        let step = format!("{}[{key}]", file_name(map));
        let map = obj_get(&step, map)?;
        let old = prog_array_get(&step, map.as_fd(), key)?.map(|id| prog_fd_by_id(&step, id)).transpose()?;
        prog_array_put(&step, map.as_fd(), key, prog)?;
        let s = step.clone();
        self.record(
            step,
            Box::new(move || match old {
                Some(old) => prog_array_put(&s, map.as_fd(), key, old.as_fd()),
                None => Ok(()),
            }),
        )
    }

    /// Makes the pinned SOCKMAP `map` run `prog` for sockets added from now
    /// on; the undo puts back the program attached before (asked of the map,
    /// not of a pin a cut-short upgrade may have left behind).
    pub(crate) fn sockmap_verdict(&mut self, map: &Path, prog: BorrowedFd<'_>) -> Result<(), UpgradeError> {
        let step = format!("{} sk_msg", file_name(map));
        let map = obj_get(&step, map)?;
        let old = sockmap_verdict_id(&step, map.as_fd())?.map(|id| prog_fd_by_id(&step, id)).transpose()?;
        sockmap_verdict(&step, map.as_fd(), prog)?;
        let s = step.clone();
        self.record(
            step,
            Box::new(move || match old {
                Some(old) => sockmap_verdict(&s, map.as_fd(), old.as_fd()),
                None => Ok(()),
            }),
        )
    }

    /// Makes the pinned bpf_link at `path` (cgroup, tcx) run `prog`.
    pub(crate) fn link_prog(&mut self, path: &Path, prog: BorrowedFd<'_>) -> Result<(), UpgradeError> {
        let step = format!("link {}", file_name(path));
        let link = obj_get(&step, path)?;
        let old = prog_fd_by_id(&step, link_prog_id(&step, link.as_fd())?)?;
        // Taken before the update, so nothing can fail between the change
        // and recording its undo.
        let new = prog.try_clone_to_owned().map_err(|source| UpgradeError::Step { step: step.clone(), source })?;
        link_update(&step, link.as_fd(), prog, old.as_fd())?;
        let s = step.clone();
        self.record(step, Box::new(move || link_update(&s, link.as_fd(), old.as_fd(), new.as_fd())))
    }

    /// Replaces the pinned tracepoint link at `path` (if there is one) with
    /// a link of `prog`. The new one is attached before the old one goes, so
    /// no event is missed; an event in between runs both (the read
    /// tracepoint then over-counts one read, which at worst delays a
    /// demotion).
    pub(crate) fn tp_link(&mut self, path: &Path, prog: BorrowedFd<'_>) -> Result<(), UpgradeError> {
        if !path.exists() {
            return Ok(());
        }
        let step = format!("link {}", file_name(path));
        let old_link = obj_get(&step, path)?;
        let old = prog_fd_by_id(&step, link_prog_id(&step, old_link.as_fd())?)?;
        drop(old_link);
        let link = raw_tp_open(&step, prog)?;
        pin_over(&step, link.as_fd(), path)?;
        let (s, p) = (step.clone(), path.to_path_buf());
        self.record(
            step,
            Box::new(move || {
                let link = raw_tp_open(&s, old.as_fd())?;
                pin_over(&s, link.as_fd(), &p)
            }),
        )
    }

    /// Pins `prog` at `path` in place of the program pinned there.
    pub(crate) fn prog_pin(&mut self, path: &Path, prog: BorrowedFd<'_>) -> Result<(), UpgradeError> {
        let step = format!("pin {}", file_name(path));
        let old = obj_get(&step, path)?;
        pin_over(&step, prog, path)?;
        let (s, p) = (step.clone(), path.to_path_buf());
        self.record(step, Box::new(move || pin_over(&s, old.as_fd(), &p)))
    }

    /// Pins an optional program at `path`: in place of the one pinned
    /// there, or new where the older build had none (its undo unpins it).
    pub(crate) fn prog_pin_optional(&mut self, path: &Path, prog: BorrowedFd<'_>) -> Result<(), UpgradeError> {
        if path.exists() {
            return self.prog_pin(path, prog);
        }
        self.pin_new(format!("pin {}", file_name(path)), prog, path)
    }

    /// Pins a map the load created because the older build had none (see
    /// [`reuse_pinned_maps`]); the undo unpins it. Pinned before any program
    /// changes, so an opener after a cut-short upgrade reuses it.
    pub(crate) fn map_pin(&mut self, path: &Path, map: BorrowedFd<'_>) -> Result<(), UpgradeError> {
        self.pin_new(format!("pin map {}", file_name(path)), map, path)
    }

    /// Pins `fd` at `path`, where nothing was pinned (the undo unpins it).
    fn pin_new(&mut self, step: String, fd: BorrowedFd<'_>, path: &Path) -> Result<(), UpgradeError> {
        obj_pin(&step, fd, path)?;
        let (s, p) = (step.clone(), path.to_path_buf());
        self.record(
            step,
            Box::new(move || fs::remove_file(&p).map_err(|source| UpgradeError::Step { step: s, source })),
        )
    }

    /// Unpins an optional program this build does not load here (the undo
    /// pins it back).
    pub(crate) fn prog_unpin(&mut self, path: &Path) -> Result<(), UpgradeError> {
        let step = format!("unpin {}", file_name(path));
        let old = obj_get(&step, path)?;
        fs::remove_file(path).map_err(|source| UpgradeError::Step { step: step.clone(), source })?;
        let (s, p) = (step.clone(), path.to_path_buf());
        self.record(step, Box::new(move || obj_pin(&s, old.as_fd(), &p)))
    }

    /// A step of the family's own (e.g. a tc filter replaced through
    /// netlink): `run` done, then recorded with its undo.
    pub(crate) fn step(
        &mut self,
        name: String,
        run: impl FnOnce() -> Result<(), UpgradeError>,
        undo: impl FnOnce() -> Result<(), UpgradeError> + 'static,
    ) -> Result<(), UpgradeError> {
        run()?;
        self.record(name, Box::new(undo))
    }

    /// Marks the instance as being upgraded (an empty build id) before any
    /// program changes: whichever build opens it next, this one or an older
    /// one rolling back, sees a mismatch and finishes the job.
    pub(crate) fn mark_upgrading(&mut self, maps_dir: &Path) -> Result<(), UpgradeError> {
        self.put_build(maps_dir, &Build::default(), "mw_build (upgrading)")
    }

    /// Records this build as the one whose programs run (the last step).
    pub(crate) fn build_id(&mut self, maps_dir: &Path) -> Result<(), UpgradeError> {
        self.put_build(maps_dir, &this_build(), names::MAP_BUILD)
    }

    fn put_build(&mut self, maps_dir: &Path, build: &Build, step: &str) -> Result<(), UpgradeError> {
        let err = |source| UpgradeError::Map { step: step.to_string(), source };
        let map = TypedMap::<u32, Build>::pinned(maps_dir, names::MAP_BUILD).map_err(err)?;
        let old = map.get(&0).map_err(err)?.unwrap_or_default();
        map.put(&0, build).map_err(err)?;
        let s = step.to_string();
        self.record(
            step.to_string(),
            Box::new(move || map.put(&0, &old).map_err(|source| UpgradeError::Map { step: s, source })),
        )
    }

    /// Undoes every step done, newest first; a failed undo is logged and the
    /// others still run.
    pub(crate) fn rollback(self) {
        for (step, undo) in self.done.into_iter().rev() {
            match undo() {
                Ok(()) => tracing::info!(step, "upgrade step undone"),
                Err(e) => tracing::error!(step, "undoing an upgrade step failed: {e}"),
            }
        }
    }
}

fn file_name(p: &Path) -> String {
    p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

/// Runs `steps` over a fresh [`Swap`], between marking the family pinned
/// with the maps in `maps_dir` as upgrading and recording this build: all of
/// them, or (on the first error) none, the done ones undone.
pub(crate) fn run(
    maps_dir: &Path,
    steps: impl FnOnce(&mut Swap) -> Result<(), UpgradeError>,
) -> Result<Vec<String>, UpgradeError> {
    let mut swap = Swap::default();
    let all = |swap: &mut Swap| {
        swap.mark_upgrading(maps_dir)?;
        steps(swap)?;
        swap.build_id(maps_dir)
    };
    match all(&mut swap) {
        Ok(()) => Ok(swap.steps()),
        Err(e) => {
            tracing::error!("upgrade failed, undoing its steps: {e}");
            swap.rollback();
            Err(e)
        }
    }
}

/// What opening a family does about its pinned programs: nothing when they
/// are this build's, else `replace` them ([`run`]); a failure leaves the old
/// ones running and is reported, not returned.
pub(crate) fn apply(
    family: &str,
    maps_dir: &Path,
    replace: impl FnOnce() -> Result<Vec<String>, UpgradeError>,
) -> Result<Upgrade, MapError> {
    let from = programs_build(maps_dir)?;
    if from == meshwarp_bpf::BUILD_ID {
        return Ok(Upgrade::None);
    }
    Ok(match replace() {
        Ok(steps) => {
            tracing::info!(family, from = %from, to = meshwarp_bpf::BUILD_ID, ?steps,
                "upgraded the pinned programs in place (maps, rules and connections kept)");
            Upgrade::Done { from, steps }
        }
        Err(e) => {
            tracing::error!(family, programs = %from, this = meshwarp_bpf::BUILD_ID,
                "the pinned programs are of another build and could not be replaced; they keep running: {e}");
            Upgrade::Failed { reason: e.to_string() }
        }
    })
}

/// Points each map of a freshly opened object at the family's pinned map of
/// the same name, so the loaded programs use the running instance's state;
/// libbpf's internal maps (`.rodata`, named with a dot) are the object's own.
/// A map of `added` (newer than the family) that the instance lacks is left
/// for the load to create; its name is returned, for [`Swap::map_pin`].
pub(crate) fn reuse_pinned_maps<'a>(
    maps: impl Iterator<Item = libbpf_rs::OpenMapMut<'a>>,
    maps_dir: &Path,
    added: &[&str],
) -> Result<Vec<String>, UpgradeError> {
    let mut created = Vec::new();
    for mut m in maps {
        let name = m.name().to_string_lossy().into_owned();
        if name.contains('.') {
            continue;
        }
        let path = maps_dir.join(&name);
        if !path.exists() {
            if added.contains(&name.as_str()) {
                created.push(name);
                continue;
            }
            return Err(UpgradeError::MissingMap(name));
        }
        m.reuse_pinned_map(&path).map_err(|source| UpgradeError::Bpf { what: format!("reusing {name}"), source })?;
    }
    Ok(created)
}

/// `max_entries` of a pinned map.
pub(crate) fn pinned_max_entries(path: &Path) -> Result<u32, UpgradeError> {
    let h = libbpf_rs::MapHandle::from_pinned_path(path)
        .map_err(|source| UpgradeError::Bpf { what: format!("opening {}", path.display()), source })?;
    Ok(libbpf_rs::MapCore::max_entries(&h))
}

/// The build id ([`meshwarp_bpf::BUILD_ID`]) of the programs pinned with the
/// maps in `maps_dir` (empty if none was recorded).
pub fn programs_build(maps_dir: &Path) -> Result<String, MapError> {
    Ok(TypedMap::<u32, Build>::pinned(maps_dir, names::MAP_BUILD)?
        .get(&0)?
        .map(|b| String::from_utf8_lossy(&b.id).trim_end_matches('\0').to_string())
        .unwrap_or_default())
}

/// This build's id as `mw_build` holds it.
pub(crate) fn this_build() -> Build {
    let mut build = Build::default();
    build.id.copy_from_slice(&meshwarp_bpf::BUILD_ID.as_bytes()[..BUILD_LEN]);
    build
}

/// The kernel id of every program a pinned family runs, by pin: its program
/// pins (`progs/<name>`) and the program of each pinned link
/// (`links/<name>`). After an upgrade every one of them is this build's.
pub fn running_programs(family_dir: &Path) -> Result<std::collections::BTreeMap<String, u32>, UpgradeError> {
    let mut out = std::collections::BTreeMap::new();
    for (sub, link) in [("progs", false), ("links", true)] {
        let Ok(entries) = fs::read_dir(family_dir.join(sub)) else { continue };
        for e in entries.flatten() {
            let key = format!("{sub}/{}", e.file_name().to_string_lossy());
            let fd = obj_get(&key, &e.path())?;
            let id = if link {
                link_prog_id(&key, fd.as_fd())?
            } else {
                libbpf_rs::ProgramHandle::from_pinned_path(e.path())
                    .map_err(|source| UpgradeError::Bpf { what: key.clone(), source })?
                    .id()
            };
            out.insert(key, id);
        }
    }
    // What the maps run: each chain's last entry and the SOCKMAP's sk_msg.
    if let Ok(entries) = fs::read_dir(family_dir.join("maps")) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let key = format!("maps/{name}");
            if name.starts_with("mw_ch_") {
                let map = obj_get(&key, &e.path())?;
                if let Some(id) = prog_array_get(&key, map.as_fd(), meshwarp_bpf::shared::CHAIN_FIN)? {
                    out.insert(format!("{key}[fin]"), id);
                }
            } else if name == names::MAP_SOCKMAP {
                let map = obj_get(&key, &e.path())?;
                if let Some(id) = sockmap_verdict_id(&key, map.as_fd())? {
                    out.insert(format!("{key} sk_msg"), id);
                }
            }
        }
    }
    Ok(out)
}
