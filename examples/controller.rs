//! A controller that keeps a node's endpoint pairs equal to a file, over the
//! gRPC API: creates what is missing, deletes what it owns and the file no
//! longer lists, and watches the node so that a change made by someone else,
//! or a restart of the daemon, triggers a resync.
//!
//! The file has one pair per line, `CLIENT_IP SERVER_IP:PORT`; `#` comments.
//! It needs only `meshwarp-client` (generated types and the connection
//! helper), which links no BPF library (this examples crate as a whole still
//! builds libbpf, for the embedding examples).
//!
//! `cargo run -p meshwarp-examples --example controller -- --file pairs.txt [--once]`

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use anyhow::{bail, Context, Result};
use meshwarp_client::pb::node_service_client::NodeServiceClient;
use meshwarp_client::pb::{self, watch_response::Resource};
use tokio_stream::StreamExt;
use tonic::transport::Channel;

#[derive(Debug, clap::Parser)]
struct Args {
    /// Node service address.
    #[arg(long, default_value = meshwarp_client::DEFAULT_SOCKET)]
    addr: String,
    /// Owner of the pairs this controller manages.
    #[arg(long, default_value = "file-controller")]
    owner: String,
    #[arg(long)]
    file: PathBuf,
    /// Sync once and exit.
    #[arg(long)]
    once: bool,
}

type Pair = (String, String, u32);

fn read_file(path: &PathBuf) -> Result<BTreeSet<Pair>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = BTreeSet::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut it = line.split_whitespace();
        let (Some(client), Some(server), None) = (it.next(), it.next(), it.next()) else {
            bail!("{}:{}: want `CLIENT_IP SERVER_IP:PORT`", path.display(), n + 1);
        };
        let server: std::net::SocketAddr =
            server.parse().with_context(|| format!("{}:{}: {server:?}", path.display(), n + 1))?;
        out.insert((client.to_string(), server.ip().to_string(), u32::from(server.port())));
    }
    Ok(out)
}

fn to_pb(p: &Pair) -> pb::EndpointPair {
    pb::EndpointPair {
        client_ip: p.0.clone(),
        server: Some(pb::Endpoint { ip: p.1.clone(), port: p.2 }),
        ..Default::default()
    }
}

/// Makes the node's pairs of `owner` equal to `want`; returns the revision and
/// instance to watch from.
async fn sync(c: &mut NodeServiceClient<Channel>, owner: &str, want: &BTreeSet<Pair>) -> Result<(u64, String)> {
    let listed = c.list_pairs(pb::ListPairsRequest { owner: owner.into(), ..Default::default() }).await?.into_inner();
    let have: BTreeSet<Pair> = listed
        .pairs
        .iter()
        .filter_map(|p| p.server.as_ref().map(|s| (p.client_ip.clone(), s.ip.clone(), s.port)))
        .collect();
    let create: Vec<_> = want.difference(&have).map(to_pb).collect();
    let delete: Vec<_> = have
        .difference(want)
        .map(|p| pb::PairKey { client_ip: p.0.clone(), server: Some(pb::Endpoint { ip: p.1.clone(), port: p.2 }) })
        .collect();
    let mut revision = listed.revision;
    if !create.is_empty() {
        let n = create.len();
        revision = c
            .batch_upsert_pairs(pb::BatchUpsertPairsRequest { pairs: create, owner: owner.into() })
            .await?
            .into_inner()
            .revision;
        println!("created {n} pairs");
    }
    if !delete.is_empty() {
        let n = delete.len();
        revision = c
            .batch_delete_pairs(pb::BatchDeletePairsRequest { keys: delete, owner: owner.into(), allow_missing: true })
            .await?
            .into_inner()
            .revision;
        println!("deleted {n} pairs");
    }
    Ok((revision, listed.instance_id))
}

fn mtime(path: &PathBuf) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = <Args as clap::Parser>::parse();
    let mut backoff = Duration::from_millis(200);
    loop {
        let result: Result<()> = async {
            let mut c = meshwarp_client::connect(&args.addr).await?;
            let want = read_file(&args.file)?;
            let (revision, instance) = sync(&mut c, &args.owner, &want).await?;
            println!("in sync at revision {revision} of node {instance}");
            if args.once {
                return Ok(());
            }
            backoff = Duration::from_millis(200);
            let seen = mtime(&args.file);
            let mut events =
                c.watch(pb::WatchRequest { after_revision: revision, instance_id: instance }).await?.into_inner();
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    ev = events.next() => match ev {
                        // OUT_OF_RANGE (restart, fell behind) or a closed stream: resync.
                        None => bail!("watch stream ended"),
                        Some(Err(s)) => bail!("watch: {}", s.message()),
                        Some(Ok(ev)) => {
                            let foreign = match &ev.resource {
                                Some(Resource::Pair(p)) => p.owner != args.owner,
                                _ => false,
                            };
                            if !foreign {
                                // One of ours changed behind our back: converge again.
                                let (r, _) = sync(&mut c, &args.owner, &read_file(&args.file)?).await?;
                                println!("resynced at revision {r} after event {}", ev.revision);
                            }
                        }
                    },
                    _ = tick.tick() => {
                        if mtime(&args.file) != seen {
                            bail!("{} changed", args.file.display());
                        }
                    }
                }
            }
        }
        .await;
        match result {
            Ok(()) => return Ok(()),
            Err(e) => {
                eprintln!("{e:#}; resyncing in {backoff:?}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}
