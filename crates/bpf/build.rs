//! Compiles each `src/bpf/*.bpf.c` program family into a libbpf-rs skeleton,
//! and the plugin objects (`../../examples/plugins`, `src/plugins`) into plain
//! BPF objects that `src/lib.rs` embeds.

use std::env;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use libbpf_cargo::SkeletonBuilder;
use sha2::{Digest, Sha256};

const FAMILIES: &[&str] = &["sockredir", "tcredir"];
/// Example plugins shipped to users.
const EXAMPLE_PLUGINS: &[&str] = &["port_allow", "byte_sampler", "rate_limit"];
/// Plugins the tests and benches use.
const TEST_PLUGINS: &[&str] = &[
    "noop_msg",
    "verdict_msg",
    "pkt_port",
    "abi_major",
    "rejected",
    "hostile_chain",
    "hostile_steer",
    "hostile_stats",
    "hostile_dir",
    "pinned_map",
];

fn clang_args(include: &Path, bpf_dir: &Path) -> Vec<OsString> {
    vec![
        "-I".into(),
        include.as_os_str().to_owned(),
        "-I".into(),
        bpf_dir.as_os_str().to_owned(),
        "-Wall".into(),
        "-Werror".into(),
        // BPF ISA v3: 32-bit atomics with fetch (flags shared between
        // programs); every kernel meshwarp supports runs it.
        "-mcpu=v3".into(),
    ]
}

fn main() {
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    let include = manifest.join("include");
    let bpf_dir = manifest.join("src/bpf");
    for family in FAMILIES {
        let src = bpf_dir.join(format!("{family}.bpf.c"));
        let skel = out.join(format!("{family}.skel.rs"));
        SkeletonBuilder::new()
            .source(&src)
            .clang_args(clang_args(&include, &bpf_dir))
            .build_and_generate(&skel)
            .unwrap_or_else(|e| panic!("building BPF family {family}: {e:#}"));
        println!("cargo:rerun-if-changed={}", src.display());
    }
    // The build id of the programs: what the skeletons embed (the objects),
    // hashed; recorded in mw_build when they are loaded.
    let mut h = Sha256::new();
    for family in FAMILIES {
        let skel = out.join(format!("{family}.skel.rs"));
        h.update(std::fs::read(&skel).unwrap_or_else(|e| panic!("reading {}: {e}", skel.display())));
    }
    let id: String = h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect();
    println!("cargo:rustc-env=MESHWARP_BPF_BUILD={id}");

    let examples = manifest.join("../../examples/plugins");
    let tests = manifest.join("src/plugins");
    // Cargo sets CARGO_FEATURE_<NAME> for a build script of a crate built
    // with that feature.
    let test_plugins = if env::var_os("CARGO_FEATURE_TEST_PLUGINS").is_some() { TEST_PLUGINS } else { &[] };
    let plugins =
        EXAMPLE_PLUGINS.iter().map(|p| (examples.join(p), p)).chain(test_plugins.iter().map(|p| (tests.join(p), p)));
    for (base, name) in plugins {
        let src = base.with_extension("bpf.c");
        SkeletonBuilder::new()
            .source(&src)
            .obj(out.join(format!("{name}.bpf.o")))
            .clang_args(clang_args(&include, &bpf_dir))
            .build()
            .unwrap_or_else(|e| panic!("building plugin {name}: {e:#}"));
        println!("cargo:rerun-if-changed={}", src.display());
    }
    println!("cargo:rerun-if-changed={}", include.display());
    println!("cargo:rerun-if-changed={}", bpf_dir.join("vmlinux.h").display());
}
