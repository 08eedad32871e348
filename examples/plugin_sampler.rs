//! Load a plugin from a program: the byte sampler (examples/plugins/byte_sampler.bpf.c)
//! on the node's on_message chain, then read its own pinned map every second —
//! messages, bytes and every Nth message's size per pair or capture rule.
//!
//! `cargo run -p meshwarp-examples --example plugin_sampler -- [N] [SECONDS]` (as root;
//! the plugin stays loaded afterwards: `meshwarp plugin unload sampler`).

use std::time::Duration;

use anyhow::{Context, Result};
use libbpf_rs::{MapCore, MapFlags, MapHandle};
use meshwarp_core::{Dataplane, DataplaneConfig, Hook, Phase, PluginChain, PluginManifest};

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let every: u32 = args.next().map(|a| a.parse()).transpose()?.unwrap_or(16);
    let seconds: u64 = args.next().map(|a| a.parse()).transpose()?.unwrap_or(10);

    let dp = Dataplane::open(&DataplaneConfig::default())?;
    let chain = PluginChain::open(Some(&dp), None)?;
    let manifest = PluginManifest {
        version: "example".into(),
        phase: Phase::Stats,
        ..PluginManifest::new("sampler", Hook::Message)
    };
    let info =
        chain.load(&manifest, meshwarp_bpf::plugins::BYTE_SAMPLER, &every.to_le_bytes(), true, "plugin-sampler")?;
    println!(
        "plugin {} loaded: prog #{}, position {} of the on_message chain",
        info.manifest.name, info.prog_id, info.position
    );
    let pin = &info.maps.iter().find(|m| m.name == "mw_samples").context("sampler map")?.pin;
    let samples = MapHandle::from_pinned_path(pin)?;
    for _ in 0..seconds {
        std::thread::sleep(Duration::from_secs(1));
        for key in samples.keys() {
            let Some(v) = samples.lookup(&key, MapFlags::ANY)? else { continue };
            let w: Vec<u64> = v.chunks_exact(8).map(|c| u64::from_ne_bytes(c.try_into().unwrap_or_default())).collect();
            let rule = u32::from_ne_bytes(key[..4].try_into()?);
            println!("rule #{rule}: {} msgs, {} bytes, {} sampled (last {} B)", w[0], w[1], w[2], w[4]);
        }
    }
    println!("{:?}", chain.get("sampler")?.counters);
    Ok(())
}
