//! Compiles each `src/bpf/*.bpf.c` program family into a libbpf-rs skeleton.

use std::env;
use std::path::PathBuf;

use libbpf_cargo::SkeletonBuilder;

const FAMILIES: &[&str] = &["sockredir", "tcredir"];

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
            .clang_args([
                "-I".into(),
                include.clone().into_os_string(),
                "-I".into(),
                bpf_dir.clone().into_os_string(),
                "-Wall".into(),
                "-Werror".into(),
            ])
            .build_and_generate(&skel)
            .unwrap_or_else(|e| panic!("building BPF family {family}: {e:#}"));
        println!("cargo:rerun-if-changed={}", src.display());
    }
    println!("cargo:rerun-if-changed={}", include.display());
    println!("cargo:rerun-if-changed={}", bpf_dir.join("vmlinux.h").display());
}
