//! Embed meshwarp as a library: adopt (or load) the pinned data path, register
//! an app <-> sidecar pair the way a controller would, print its counters.
//!
//! `cargo run -p meshwarp-examples --example embed -- 10.0.0.5 10.0.0.6:8080` (as root)

use std::net::{IpAddr, SocketAddr};

use anyhow::{Context, Result};
use meshwarp_core::{Dataplane, DataplaneConfig, EndpointPair};

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let client: IpAddr = args.next().context("usage: embed CLIENT_IP SERVER_IP:PORT")?.parse()?;
    let server: SocketAddr = args.next().context("usage: embed CLIENT_IP SERVER_IP:PORT")?.parse()?;

    let dp = Dataplane::open(&DataplaneConfig::default())?;
    println!("data path {:?} at {}", dp.origin(), dp.pin_dir().display());
    let pair = EndpointPair::new(client, server.into())?;
    let outcome = dp.upsert(&pair, "embed-example")?;
    println!("{pair}: {outcome:?}");
    for p in dp.pairs() {
        println!("{p}: {:?}", dp.stats(&p)?);
    }
    Ok(())
}
