//! Generates the tonic/prost code for `proto/meshwarp/node/v1alpha1` with a
//! vendored protoc (no system protoc needed) and a descriptor set for reflection.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let proto = root.join("meshwarp/node/v1alpha1/node.proto");
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    tonic_prost_build::configure().file_descriptor_set_path(out.join("meshwarp_descriptor.bin")).compile_with_config(
        config,
        &[proto.as_path()],
        &[root.as_path()],
    )?;
    // serde impls following the proto3 JSON mapping, for `-o json|yaml`.
    let descriptors = std::fs::read(out.join("meshwarp_descriptor.bin"))?;
    pbjson_build::Builder::new().register_descriptors(&descriptors)?.build(&[".meshwarp"])?;
    println!("cargo:rerun-if-changed={}", proto.display());
    Ok(())
}
