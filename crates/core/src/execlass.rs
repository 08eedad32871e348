//! What an executable can do to the sockets it reads, read from its ELF: the
//! reader guard's static half. A program that can call `splice(2)` on a socket
//! must never be given redirected bytes on a kernel whose splice does not see
//! them, and it must be known *before* its first connection, so the guard asks
//! the binary rather than waiting to see it splice.
//!
//! A program can splice if it, or a library it has mapped, imports `splice`
//! (glibc, musl and most C programs), if it is a Go binary carrying the
//! standard library's splice path (`io.Copy` between TCP connections splices),
//! or if it drives io_uring (which can splice without a system call meshwarp
//! sees). A statically linked, stripped binary that is not Go cannot be read
//! and is treated as able to splice ("opaque").

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use meshwarp_bpf::shared::ExeKey;
use object::read::{ReadCache, ReadRef};
use object::{Object, ObjectSection, ObjectSymbol};

/// Imports that let a program splice from a socket.
const SPLICE_IMPORTS: [&str; 2] = ["splice", "__splice"];
/// Imports of liburing: a program that can splice without a system call.
const URING_IMPORTS: [&str; 4] =
    ["io_uring_queue_init", "io_uring_queue_init_params", "io_uring_setup", "__io_uring_get_cqe"];
/// Function names of Go's splice path (kept in the pclntab even when stripped).
const GO_SPLICE: [&[u8]; 3] = [b"internal/poll.splice", b"internal/poll.Splice", b"syscall.Splice"];

#[derive(Debug, thiserror::Error)]
pub enum ClassifyError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} is not an ELF object: {reason}")]
    NotElf { path: PathBuf, reason: String },
    /// A part of the file the headers name could not be read (the file
    /// changed or was cut short while it was read).
    #[error("{path}: could not read its {what}")]
    Unreadable { path: PathBuf, what: &'static str },
    #[error("process {pid} runs {path}, inode {found}, not the inode {expected} the kernel reported")]
    Replaced { pid: u32, path: PathBuf, found: u64, expected: u64 },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> ClassifyError + '_ {
    move |source| ClassifyError::Io { path: path.to_path_buf(), source }
}

/// What the guard concluded about one executable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExeFacts {
    /// It can splice from a socket.
    pub splice: bool,
    /// It could not be read (stripped static, not Go): treated as able to splice.
    pub opaque: bool,
    /// Why, for logs: "imports splice", "Go: internal/poll.splice", ...
    pub reason: String,
}

/// The kernel's encoding of a device number (`MKDEV`), from `st_dev`.
pub fn kernel_dev(st_dev: u64) -> u64 {
    let (major, minor) = (libc::major(st_dev), libc::minor(st_dev));
    (u64::from(major) << 20) | u64::from(minor)
}

/// The key the programs use for the file at `path` (following symlinks).
pub fn exe_key(path: &Path) -> Result<ExeKey, ClassifyError> {
    let m = fs::metadata(path).map_err(io_err(path))?;
    Ok(ExeKey { dev: kernel_dev(m.dev()), ino: m.ino() })
}

/// Reads what it needs of one ELF file: its headers, dynamic imports or
/// symbol table, and for Go its function name table. Not the whole file: a
/// connection made before its program is classified is not accelerated, and
/// reading all of node's 99 MB took 70 ms warm, 240 ms cold.
pub fn classify_file(path: &Path) -> Result<ExeFacts, ClassifyError> {
    let file = fs::File::open(path).map_err(io_err(path))?;
    let cache = ReadCache::new(file);
    classify_elf(path, &cache)
}

fn classify_elf<'a, R: ReadRef<'a>>(path: &Path, data: R) -> Result<ExeFacts, ClassifyError> {
    let file = object::File::parse(data)
        .map_err(|e| ClassifyError::NotElf { path: path.to_path_buf(), reason: e.to_string() })?;
    let fact = |splice: bool, opaque: bool, reason: String| Ok(ExeFacts { splice, opaque, reason });
    // An import table that cannot be read is no answer (reads now come from
    // the file as parsing goes, so a file cut short fails here).
    let imports =
        file.imports().map_err(|_| ClassifyError::Unreadable { path: path.to_path_buf(), what: "imports" })?;
    for imp in &imports {
        let name = String::from_utf8_lossy(imp.name());
        if SPLICE_IMPORTS.contains(&name.as_ref()) {
            return fact(true, false, format!("imports {name}"));
        }
        if URING_IMPORTS.contains(&name.as_ref()) {
            return fact(true, false, format!("imports {name} (io_uring can splice without a system call)"));
        }
    }
    let pclntab = file.section_by_name(".gopclntab");
    if pclntab.is_some() || file.section_by_name(".go.buildinfo").is_some() {
        // Function names survive stripping in the pclntab; a binary without
        // that section (it moved into .data.rel.ro in some builds) is read
        // whole.
        let unreadable = |what| ClassifyError::Unreadable { path: path.to_path_buf(), what };
        let names = match pclntab {
            Some(s) => s.data().map_err(|_| unreadable(".gopclntab section"))?,
            None => {
                let len = data.len().map_err(|()| unreadable("length"))?;
                data.read_bytes_at(0, len).map_err(|()| unreadable("contents"))?
            }
        };
        for needle in GO_SPLICE {
            if memchr::memmem::find(names, needle).is_some() {
                return fact(true, false, format!("Go: {}", String::from_utf8_lossy(needle)));
            }
        }
        return fact(false, false, "Go without the splice path".into());
    }
    let dynamic = file.section_by_name(".dynamic").is_some();
    if dynamic {
        return fact(false, false, "dynamically linked, no splice import".into());
    }
    // Static: only its own symbol table can tell.
    let mut any = false;
    for sym in file.symbols() {
        any = true;
        if sym.name().is_ok_and(|n| SPLICE_IMPORTS.contains(&n)) {
            return fact(true, false, "static, defines splice".into());
        }
    }
    if any {
        fact(false, false, "static, no splice symbol".into())
    } else {
        fact(true, true, "static and stripped: cannot tell, treated as able to splice".into())
    }
}

/// Shared objects already read: whether each can splice.
pub type LibCache = BTreeMap<PathBuf, bool>;

/// A running process: its executable (checked against the inode the kernel
/// reported, when given) and every ELF file it has mapped.
pub fn classify_process(pid: u32, expected_ino: Option<u64>) -> Result<(ExeKey, ExeFacts), ClassifyError> {
    classify_process_cached(pid, expected_ino, &mut LibCache::new())
}

/// [`classify_process`], reading each shared object once across calls.
pub fn classify_process_cached(
    pid: u32,
    expected_ino: Option<u64>,
    libs: &mut LibCache,
) -> Result<(ExeKey, ExeFacts), ClassifyError> {
    let exe = PathBuf::from(format!("/proc/{pid}/exe"));
    let key = exe_key(&exe)?;
    if let Some(ino) = expected_ino {
        if key.ino != ino {
            return Err(ClassifyError::Replaced { pid, path: exe, found: key.ino, expected: ino });
        }
    }
    let mut facts = classify_file(&exe)?;
    if facts.splice {
        return Ok((key, facts));
    }
    for lib in mapped_objects(pid) {
        let splices =
            *libs.entry(lib.clone()).or_insert_with(|| classify_file(&lib).is_ok_and(|f| f.splice && !f.opaque));
        if splices {
            facts = ExeFacts { splice: true, opaque: false, reason: format!("{} can splice", lib.display()) };
            break;
        }
    }
    Ok((key, facts))
}

/// Shared objects mapped executable by a process (from /proc/PID/maps).
fn mapped_objects(pid: u32) -> BTreeSet<PathBuf> {
    let Ok(maps) = fs::read_to_string(format!("/proc/{pid}/maps")) else {
        return BTreeSet::new();
    };
    maps.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let perms = f.nth(1)?;
            let path = f.nth(3)?;
            (perms.contains('x') && path.starts_with('/') && path.contains(".so")).then(|| PathBuf::from(path))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_test_binary_does_not_splice() {
        // meshwarp's own code must never import splice: the guard would then
        // refuse to redirect into any socket its tests read.
        let me = std::env::current_exe().unwrap();
        let f = classify_file(&me).unwrap();
        assert!(!f.splice, "{f:?}");
    }

    #[test]
    fn system_programs() {
        // Present on every Debian machine; python3 imports splice (os.splice).
        // Go (scripts/install-deps.sh installs it) carries its splice path,
        // found in its .gopclntab section.
        let go = meshwarp_testbed::which("go").and_then(|p| fs::canonicalize(p).ok());
        let mut cases = vec![(PathBuf::from("/usr/bin/python3"), true), (PathBuf::from("/bin/ls"), false)];
        cases.extend(go.map(|g| (g, true)));
        for (p, splice) in cases {
            if p.exists() {
                let f = classify_file(&p).unwrap();
                assert_eq!(f.splice, splice, "{}: {f:?}", p.display());
            }
        }
    }

    #[test]
    fn an_elf_cut_short_is_an_error() {
        // This test binary's headers, without the tables they point to.
        let me = fs::read(std::env::current_exe().unwrap()).unwrap();
        let e = classify_elf(Path::new("x"), &me[..4096]).unwrap_err();
        assert!(matches!(e, ClassifyError::NotElf { .. } | ClassifyError::Unreadable { .. }), "{e}");
    }

    #[test]
    fn not_elf_is_an_error() {
        let e = classify_elf(Path::new("x"), &b"#!/bin/sh\necho hi\n"[..]).unwrap_err();
        assert!(matches!(e, ClassifyError::NotElf { .. }), "{e}");
    }

    #[test]
    fn this_process_is_classified_with_its_inode() {
        let pid = std::process::id();
        let (key, _) = classify_process(pid, None).unwrap();
        assert_eq!(key, exe_key(&std::env::current_exe().unwrap()).unwrap());
        let e = classify_process(pid, Some(key.ino + 1)).unwrap_err();
        assert!(matches!(e, ClassifyError::Replaced { .. }), "{e}");
    }

    #[test]
    fn kernel_dev_encoding() {
        // st_dev 8:1 (sda1) in glibc's encoding is 0x801; MKDEV(8, 1) = 8 << 20 | 1.
        assert_eq!(kernel_dev(libc::makedev(8, 1)), (8 << 20) | 1);
        assert_eq!(kernel_dev(libc::makedev(259, 70000)), (259 << 20) | 70000);
    }
}
