//! The point of this crate: a controller that depends on it links no BPF
//! library. `cargo tree` over its normal dependencies must not name libbpf.

use std::process::Command;

#[test]
fn the_client_links_no_bpf_library() {
    let out = Command::new(env!("CARGO"))
        .args(["tree", "--offline", "-p", "meshwarp-client", "-e", "normal", "--prefix", "none"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("running cargo tree");
    assert!(out.status.success(), "cargo tree: {}", String::from_utf8_lossy(&out.stderr));
    let tree = String::from_utf8_lossy(&out.stdout);
    assert!(tree.lines().any(|l| l.starts_with("tonic ")), "cargo tree lists the dependencies:\n{tree}");
    for crate_name in ["libbpf", "meshwarp-core", "meshwarp-bpf"] {
        assert!(!tree.contains(crate_name), "meshwarp-client depends on {crate_name}:\n{tree}");
    }
}
