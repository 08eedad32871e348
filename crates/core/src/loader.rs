//! Loading BPF objects through libbpf: one load at a time per process, with
//! libbpf's warnings (where a rejected program's verifier log ends up)
//! collected so the error that reports the rejection carries them. Every
//! family (socket redirection, tc, plugins) and the kernel probe load here.
//! It also owns opening the socket family's object with what this kernel
//! loads (probed once: task storage in sk_msg, the tcp_sendmsg_locked
//! tracepoint, map-element iterators).

use std::mem::MaybeUninit;
use std::sync::{Mutex, Once};

use libbpf_rs::skel::SkelBuilder;
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

/// The socket family's object, opened, with its constants set for an
/// instance of `nr_slots` link slots.
pub(crate) fn open_sockredir(
    obj: &mut MaybeUninit<libbpf_rs::OpenObject>,
    nr_slots: u32,
) -> Result<meshwarp_bpf::sockredir::OpenSockredirSkel<'_>, libbpf_rs::Error> {
    let mut open = meshwarp_bpf::sockredir::SockredirSkelBuilder::default().open(obj)?;
    // The latency monitor's TCP-path send stamps need a tracepoint older
    // kernels lack: without it the rest loads, and the program is not pinned.
    if !has_tcp_sendmsg_tracepoint() {
        open.progs.mw_lat_send.set_autoload(false);
    }
    // The connection list over every namespace needs a map-element
    // iterator, which some kernels refuse: mw_conns_tcp reads it per
    // namespace there.
    if !map_elem_iter_loads() {
        open.progs.mw_conns.set_autoload(false);
    }
    if let Some(ro) = open.maps.rodata_data.as_mut() {
        ro.nr_splice = libc::SYS_splice as u32;
        ro.nr_ioctl = libc::SYS_ioctl as u32;
        ro.nr_sendto = libc::SYS_sendto as u32;
        ro.nr_sendmsg = libc::SYS_sendmsg as u32;
        ro.nr_sendmmsg = libc::SYS_sendmmsg as u32;
        ro.nr_slots = nr_slots;
        ro.mw_task_storage = sk_msg_has_task_storage();
    }
    Ok(open)
}

/// Whether sk_msg programs may call `bpf_task_storage_get` (Linux 6.15 and
/// newer; the latency monitor keeps each thread's last read there, else in
/// an LRU hash). Probed once.
pub(crate) fn sk_msg_has_task_storage() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        use libbpf_rs::libbpf_sys;
        // SAFETY: the probe loads a tiny program and takes no pointers but the (null) options.
        let rc = unsafe {
            libbpf_sys::libbpf_probe_bpf_helper(
                libbpf_sys::BPF_PROG_TYPE_SK_MSG,
                libbpf_sys::BPF_FUNC_task_storage_get,
                std::ptr::null(),
            )
        };
        rc == 1
    })
}

/// Whether the kernel has the `tcp_sendmsg_locked` tracepoint (BTF), which
/// `mw_lat_send` attaches to (Linux 6.13 and newer). Probed once.
pub(crate) fn has_tcp_sendmsg_tracepoint() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        vmlinux_btf_id(c"btf_trace_tcp_sendmsg_locked", libbpf_rs::libbpf_sys::BTF_KIND_TYPEDEF).is_some()
    })
}

/// The id of type `name` of kind `kind` in the kernel's BTF, if it has one.
fn vmlinux_btf_id(name: &std::ffi::CStr, kind: u32) -> Option<u32> {
    use libbpf_rs::libbpf_sys;
    // SAFETY: libbpf loads the kernel's BTF; NULL-checked; freed below.
    let id = unsafe {
        let btf = libbpf_sys::btf__load_vmlinux_btf();
        if btf.is_null() {
            return None;
        }
        let id = libbpf_sys::btf__find_by_name_kind(btf, name.as_ptr(), kind);
        libbpf_sys::btf__free(btf);
        id
    };
    u32::try_from(id).ok().filter(|&id| id > 0)
}

/// Whether the kernel loads map-element iterators (`iter/bpf_sk_storage_map`,
/// which `mw_conns` is): some kernels refuse them with EPERM while other
/// iterators (iter/tcp) load. Probed once, with a program that returns 0.
pub(crate) fn map_elem_iter_loads() -> bool {
    static LOADS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *LOADS.get_or_init(|| {
        use libbpf_rs::libbpf_sys;
        /// One BPF instruction as the kernel reads it (registers packed in `regs`).
        #[repr(C)]
        struct Insn {
            code: u8,
            regs: u8,
            off: i16,
            imm: i32,
        }
        const MOV64_IMM: u8 = 0xb7; // BPF_ALU64 | BPF_MOV | BPF_K
        const EXIT: u8 = 0x95; // BPF_JMP | BPF_EXIT
        let insns = [Insn { code: MOV64_IMM, regs: 0, off: 0, imm: 0 }, Insn { code: EXIT, regs: 0, off: 0, imm: 0 }];
        let Some(attach_btf_id) = vmlinux_btf_id(c"bpf_iter_bpf_sk_storage_map", libbpf_sys::BTF_KIND_FUNC) else {
            return false;
        };
        let mut opts = libbpf_sys::bpf_prog_load_opts {
            sz: std::mem::size_of::<libbpf_sys::bpf_prog_load_opts>() as libbpf_sys::size_t,
            expected_attach_type: libbpf_sys::BPF_TRACE_ITER,
            attach_btf_id,
            ..Default::default()
        };
        // SAFETY: two instructions of the layout the kernel reads, NUL-terminated
        // names, options of their own size; the fd returned is closed below.
        let fd = unsafe {
            libbpf_sys::bpf_prog_load(
                libbpf_sys::BPF_PROG_TYPE_TRACING,
                c"mw_probe_iter".as_ptr(),
                c"GPL".as_ptr(),
                insns.as_ptr().cast(),
                insns.len() as libbpf_sys::size_t,
                &mut opts,
            )
        };
        if fd < 0 {
            tracing::info!(
                "the kernel refuses map-element iterators ({}): the connection list is read per network namespace",
                std::io::Error::from_raw_os_error(-fd)
            );
            return false;
        }
        // SAFETY: a new fd we own.
        drop(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) });
        true
    })
}
