//! `meshwarp doctor`: what this machine offers meshwarp, and how to fix what
//! is missing. Probes ask the kernel (libbpf feature probes), not a table of
//! kernel versions.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Result};
use libbpf_rs::libbpf_sys;

struct Check {
    name: &'static str,
    ok: bool,
    detail: String,
    fix: &'static str,
}

fn prog_type(t: libbpf_sys::bpf_prog_type) -> bool {
    // SAFETY: a plain probe; NULL opts are allowed.
    unsafe { libbpf_sys::libbpf_probe_bpf_prog_type(t, std::ptr::null()) == 1 }
}

fn map_type(t: libbpf_sys::bpf_map_type) -> bool {
    // SAFETY: as above.
    unsafe { libbpf_sys::libbpf_probe_bpf_map_type(t, std::ptr::null()) == 1 }
}

fn helper(p: libbpf_sys::bpf_prog_type, h: libbpf_sys::bpf_func_id) -> bool {
    // SAFETY: as above.
    unsafe { libbpf_sys::libbpf_probe_bpf_helper(p, h, std::ptr::null()) == 1 }
}

/// Whether the kernel's BTF has `name` of `kind` (a kfunc, a tracepoint type).
fn kernel_btf_has(name: &str, kind: u32) -> bool {
    let Ok(c) = std::ffi::CString::new(name) else { return false };
    // SAFETY: libbpf loads the kernel's BTF; freed below; NULL-checked.
    unsafe {
        let btf = libbpf_sys::btf__load_vmlinux_btf();
        if btf.is_null() {
            return false;
        }
        let found = libbpf_sys::btf__find_by_name_kind(btf, c.as_ptr(), kind) > 0;
        libbpf_sys::btf__free(btf);
        found
    }
}

fn runs(cmd: &str, args: &[&str]) -> bool {
    Command::new(cmd).args(args).output().map(|o| o.status.success()).unwrap_or(false)
}

pub fn run(pin_root: &Path) -> Result<()> {
    let cg = meshwarp_core::sys::mounts_of("cgroup2");
    let bpffs = meshwarp_core::sys::mounts_of("bpf");
    let root = nix::unistd::geteuid().is_root();
    let checks = [
        Check { name: "root", ok: root, detail: "CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN".into(), fix: "run as root" },
        Check {
            name: "btf",
            ok: Path::new("/sys/kernel/btf/vmlinux").exists(),
            detail: "/sys/kernel/btf/vmlinux (CO-RE)".into(),
            fix: "use a kernel built with CONFIG_DEBUG_INFO_BTF=y",
        },
        Check {
            name: "cgroup2",
            ok: !cg.is_empty(),
            detail: cg.first().map(|p| p.display().to_string()).unwrap_or_else(|| "not mounted".into()),
            fix: "meshwarp mounts one at /run/meshwarp/cgroup2 when needed (or: mount -t cgroup2 none DIR)",
        },
        Check {
            name: "bpffs",
            ok: !bpffs.is_empty(),
            detail: bpffs.first().map(|p| p.display().to_string()).unwrap_or_else(|| "not mounted".into()),
            fix: "meshwarp mounts it when needed (or: mount -t bpf bpf /sys/fs/bpf)",
        },
        Check {
            name: "sockops",
            ok: prog_type(libbpf_sys::BPF_PROG_TYPE_SOCK_OPS),
            detail: "BPF_PROG_TYPE_SOCK_OPS".into(),
            fix: "kernel needs CONFIG_CGROUP_BPF=y",
        },
        Check {
            name: "sk_msg + sockmap",
            ok: prog_type(libbpf_sys::BPF_PROG_TYPE_SK_MSG) && map_type(libbpf_sys::BPF_MAP_TYPE_SOCKMAP),
            detail: "BPF_PROG_TYPE_SK_MSG, BPF_MAP_TYPE_SOCKMAP".into(),
            fix: "kernel needs CONFIG_BPF_STREAM_PARSER=y",
        },
        Check {
            name: "socket storage",
            ok: map_type(libbpf_sys::BPF_MAP_TYPE_SK_STORAGE)
                && helper(libbpf_sys::BPF_PROG_TYPE_SK_MSG, libbpf_sys::BPF_FUNC_sk_storage_get),
            detail: "BPF_MAP_TYPE_SK_STORAGE from sk_msg".into(),
            fix: "kernel 5.15 or newer",
        },
        Check {
            name: "plugin chains",
            ok: map_type(libbpf_sys::BPF_MAP_TYPE_PROG_ARRAY)
                && map_type(libbpf_sys::BPF_MAP_TYPE_ARRAY_OF_MAPS)
                && helper(libbpf_sys::BPF_PROG_TYPE_SK_MSG, libbpf_sys::BPF_FUNC_tail_call),
            detail: "tail calls through PROG_ARRAY; ARRAY_OF_MAPS for grace periods".into(),
            fix: "kernel 5.15 or newer",
        },
        Check {
            name: "tc (cls_bpf)",
            ok: prog_type(libbpf_sys::BPF_PROG_TYPE_SCHED_CLS),
            detail: "BPF_PROG_TYPE_SCHED_CLS, for interface routes".into(),
            fix: "kernel needs CONFIG_NET_CLS_BPF",
        },
        Check {
            name: "guard tracepoints",
            ok: kernel_btf_has("btf_trace_sock_recv_length", libbpf_sys::BTF_KIND_TYPEDEF)
                && kernel_btf_has("btf_trace_sys_enter", libbpf_sys::BTF_KIND_TYPEDEF),
            detail: "tp_btf sock_recv_length and sys_enter (BTF-typed: no tracefs needed)".into(),
            fix: "kernel needs CONFIG_BPF_EVENTS and CONFIG_FTRACE_SYSCALLS",
        },
        Check {
            name: "latency monitor",
            ok: kernel_btf_has("btf_trace_tcp_sendmsg_locked", libbpf_sys::BTF_KIND_TYPEDEF),
            detail: "tp_btf tcp_sendmsg_locked, attached while it runs: stamps TCP-path sends of sockets outside the SOCKMAP".into(),
            fix: "kernel 6.13 or newer; without it the rest runs and those sends are not measured",
        },
        Check {
            name: "connection list",
            ok: true,
            detail: match meshwarp_core::ConnSource::on_this_kernel() {
                meshwarp_core::ConnSource::SocketStorage => {
                    "iter/bpf_sk_storage_map: every namespace in one read".into()
                }
                meshwarp_core::ConnSource::EachNetns => {
                    "iter/tcp in each network namespace (this kernel refuses map-element iterators)".into()
                }
            },
            fix: "",
        },
        Check {
            name: "cgroup sockopt",
            ok: prog_type(libbpf_sys::BPF_PROG_TYPE_CGROUP_SOCKOPT),
            detail: "cgroup/setsockopt: SO_RCVLOWAT, TCP_ULP and SO_ZEROCOPY on accelerated sockets".into(),
            fix: "kernel 5.3 or newer with CONFIG_CGROUP_BPF",
        },
        Check {
            name: "socket reset",
            ok: kernel_btf_has("bpf_sock_destroy", libbpf_sys::BTF_KIND_FUNC),
            detail: "iter/tcp + bpf_sock_destroy: a connection the fast path cannot serve fails loudly".into(),
            fix: "kernel 6.5 or newer",
        },
        Check {
            name: "iptables",
            ok: runs("iptables", &["--version"]),
            detail: "iptables, for capture (REDIRECT) setups and the demo".into(),
            fix: "apt-get install iptables",
        },
        Check {
            name: "iproute2",
            ok: runs("ip", &["-V"]),
            detail: "ip, for the demo and tests".into(),
            fix: "apt-get install iproute2",
        },
    ];
    let mut missing = 0;
    for c in &checks {
        println!("{} {:<18} {}", if c.ok { "ok " } else { "NO " }, c.name, c.detail);
        if !c.ok {
            missing += 1;
            println!("    fix: {}", c.fix);
        }
    }
    // What the kernel does with redirected bytes: found by experiment.
    match meshwarp_core::KernelProbe::run() {
        Ok(k) => {
            println!("    kernel probe ({}): what the fast path's safety depends on", k.release);
            for f in k.facts() {
                let mark = if f.safe { "ok " } else { "gap" };
                println!("{mark} {:<32} {:<3}  {}", f.name, if f.value { "yes" } else { "no" }, f.detail);
            }
            if k.needs_guard() {
                println!("    the reader guard works around the gaps (meshwarp serve --reader-guard auto)");
            }
        }
        Err(e) => {
            missing += 1;
            println!("NO  kernel probe               {e}");
        }
    }
    let pinned = pin_root.join(format!("v{}", meshwarp_bpf_schema()));
    println!(
        "    data path: {}",
        if pinned.exists() { format!("pinned at {}", pinned.display()) } else { "not loaded".into() }
    );
    if missing > 0 {
        bail!("{missing} check(s) failed");
    }
    Ok(())
}

fn meshwarp_bpf_schema() -> u32 {
    meshwarp_core::dataplane::SCHEMA_VERSION
}
