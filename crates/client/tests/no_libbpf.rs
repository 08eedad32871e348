//! The point of this crate: a controller that depends on it links no BPF
//! library. `cargo tree` over its normal dependencies must not name libbpf.

use std::process::Command;

#[test]
fn the_client_links_no_bpf_library() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| env!("CARGO").into());
    // --frozen: offline, and the lockfile as committed (never rewritten).
    let out = Command::new(cargo)
        .args(["tree", "--frozen", "-p", "meshwarp-client", "-e", "normal,build", "--prefix", "none"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("running cargo tree");
    assert!(out.status.success(), "cargo tree: {}", String::from_utf8_lossy(&out.stderr));
    let tree = String::from_utf8_lossy(&out.stdout);
    assert!(tree.lines().any(|l| l.starts_with("tonic ")), "cargo tree lists the dependencies:\n{tree}");
    let names: Vec<&str> = tree.lines().filter_map(|l| l.split_whitespace().next()).collect();
    let bad: Vec<_> =
        names.iter().filter(|n| n.starts_with("libbpf") || ["meshwarp-core", "meshwarp-bpf"].contains(n)).collect();
    assert!(bad.is_empty(), "meshwarp-client depends on {bad:?}:\n{tree}");
}
