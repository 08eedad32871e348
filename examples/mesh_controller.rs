//! A mesh controller for one node: watches the pods of its node and the
//! services and endpoint slices of the cluster (kube-rs), translates the
//! Istio- and Linkerd-injected pods into meshwarp capture rules and pairs
//! (`meshwarp_examples::mesh`), and keeps the node agent equal to that with
//! SyncOwner — one call per change, a generation that grows across its own
//! restarts (milliseconds since the epoch), and a lease it renews, so its
//! rules go away if it dies and stays away. When the agent restarts (the
//! call fails, or its instance changes) it syncs again.
//!
//! ```text
//! cargo run -p meshwarp-examples --example mesh_controller -- --node "$NODE_NAME"
//! cargo run -p meshwarp-examples --example mesh_controller -- --node node-a --from-json DIR --once
//! ```
//! `--from-json DIR` reads `pods.json`, `services.json` and
//! `endpointslices.json` (lists as `kubectl get -o json` prints them) instead
//! of an API server, once or every `--interval-ms`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use futures::FutureExt;
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::{reflector, watcher, WatchStreamExt};
use kube::Api;
use meshwarp_examples::mesh::{desired, objects_from_json, Agent};
use tokio_stream::StreamExt;

#[derive(Debug, clap::Parser)]
struct Args {
    /// The node whose pods this controller handles (its agent's socket is local).
    #[arg(long, env = "NODE_NAME")]
    node: String,
    /// Node agent address.
    #[arg(long, default_value = meshwarp_client::DEFAULT_SOCKET)]
    addr: String,
    #[arg(long, default_value = "mesh-controller")]
    owner: String,
    /// The agent removes this controller's rules if it is silent this long.
    #[arg(long, default_value_t = 30)]
    lease_seconds: u32,
    /// Read the objects from this directory's JSON lists instead of an API server.
    #[arg(long)]
    from_json: Option<PathBuf>,
    /// With --from-json: sync once and exit.
    #[arg(long)]
    once: bool,
    #[arg(long, default_value_t = 1000)]
    interval_ms: u64,
}

fn read_list<T: serde::de::DeserializeOwned>(dir: &Path, file: &str) -> Result<Vec<T>> {
    let path = dir.join(file);
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    objects_from_json(&text).with_context(|| format!("parsing {}", path.display()))
}

async fn from_json(args: &Args, dir: &Path, agent: &mut Agent) -> Result<()> {
    loop {
        let (pods, services, slices) = (
            read_list::<Pod>(dir, "pods.json")?,
            read_list::<Service>(dir, "services.json")?,
            read_list::<EndpointSlice>(dir, "endpointslices.json")?,
        );
        let want = desired(&args.node, &pods, &services, &slices);
        let synced = agent.sync(&want).await;
        if args.once {
            let changes = synced?;
            println!(
                "synced: {changes} change(s), {} capture rule(s), {} pair(s)",
                want.capture_rules.len(),
                want.pairs.len()
            );
            return Ok(());
        }
        match synced {
            Ok(0) => {}
            Ok(n) => println!("synced: {n} change(s)"),
            Err(e) => eprintln!("{e}; retrying"),
        }
        tokio::time::sleep(Duration::from_millis(args.interval_ms)).await;
    }
}

async fn from_cluster(args: &Args, agent: &mut Agent) -> Result<()> {
    let client = kube::Client::try_default().await.context("a Kubernetes client (in-cluster or kubeconfig)")?;
    let on_node = watcher::Config::default().fields(&format!("spec.nodeName={}", args.node));
    let (pods, pod_writer) = reflector::store::<Pod>();
    let (services, svc_writer) = reflector::store::<Service>();
    let (slices, slice_writer) = reflector::store::<EndpointSlice>();
    let mut changes = futures_merge(vec![
        Box::pin(watcher(Api::<Pod>::all(client.clone()), on_node).default_backoff().reflect(pod_writer).map(|_| ())),
        Box::pin(
            watcher(Api::<Service>::all(client.clone()), watcher::Config::default())
                .default_backoff()
                .reflect(svc_writer)
                .map(|_| ()),
        ),
        Box::pin(
            watcher(Api::<EndpointSlice>::all(client), watcher::Config::default())
                .default_backoff()
                .reflect(slice_writer)
                .map(|_| ()),
        ),
    ]);
    // The first sync replaces everything this owner had: wait until every
    // store holds the cluster's objects, not a partial view.
    let ready = async {
        while changes.next().await.is_some() {
            if pods.wait_until_ready().now_or_never().is_some()
                && services.wait_until_ready().now_or_never().is_some()
                && slices.wait_until_ready().now_or_never().is_some()
            {
                return;
            }
        }
    };
    ready.await;
    let lease = Duration::from_secs(u64::from(args.lease_seconds.max(3)) / 3);
    let mut tick = tokio::time::interval(lease);
    loop {
        tokio::select! {
            _ = changes.next() => {}
            _ = tick.tick() => {}
        }
        let own = |s: Vec<std::sync::Arc<Pod>>| s.iter().map(|p| (**p).clone()).collect::<Vec<_>>();
        let svcs: Vec<Service> = services.state().iter().map(|s| (**s).clone()).collect();
        let eps: Vec<EndpointSlice> = slices.state().iter().map(|s| (**s).clone()).collect();
        let want = desired(&args.node, &own(pods.state()), &svcs, &eps);
        match agent.sync(&want).await {
            Ok(0) => {}
            Ok(n) => println!("synced: {n} change(s)"),
            Err(e) => eprintln!("{e}; retrying at the next change or tick"),
        }
    }
}

/// The three watch streams (every event, the initial listing's included) as
/// one stream of "something changed".
fn futures_merge(
    streams: Vec<std::pin::Pin<Box<dyn tokio_stream::Stream<Item = ()> + Send>>>,
) -> impl tokio_stream::Stream<Item = ()> {
    tokio_stream::StreamMap::from_iter(streams.into_iter().enumerate()).map(|(_, ())| ())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = <Args as clap::Parser>::parse();
    let mut agent = Agent::new(&args.addr, &args.owner, args.lease_seconds);
    match &args.from_json {
        Some(dir) => from_json(&args, dir, &mut agent).await,
        None => from_cluster(&args, &mut agent).await,
    }
}
