//! The mesh controller's agent side (`meshwarp_examples::mesh::Agent`)
//! against a real node service: it syncs the Istio translation of real
//! injector output, survives a restart of the node service (its call fails,
//! the next reconnects and finds every rule adopted from the pins) and its
//! own restart (a new agent, a newer generation, nothing to change), and
//! renews its lease while nothing changes.
//!
//! Fails (never skips) when CI=true and the kernel refuses BPF.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use meshwarp_core::dataplane::DataplaneConfig;
use meshwarp_examples::mesh::{desired, objects_from_json, Agent};
use meshwarp_grpc_api::daemon::{DaemonOptions, EmbeddedNode};
use meshwarp_grpc_api::pb;
use meshwarp_testbed::{unique_name, ScratchDir, TestCgroup};

fn fixture<T: serde::de::DeserializeOwned>(file: &str) -> Result<Vec<T>> {
    let path = format!("{}/testdata/{file}", env!("CARGO_MANIFEST_DIR"));
    objects_from_json(&std::fs::read_to_string(&path)?).context(path)
}

#[test]
fn the_agent_survives_restarts_of_the_node_service_and_of_itself() -> Result<()> {
    let cgroup = match TestCgroup::new() {
        Ok(c) => c,
        Err(e) if std::env::var("CI").as_deref() != Ok("true") => {
            eprintln!("SKIPPED: cgroup v2 is not available here: {e}");
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    };
    let dir = ScratchDir::new("meshwarp-agent-")?;
    let socket = dir.path("meshwarp.sock");
    let pin_root = PathBuf::from(format!("/sys/fs/bpf/{}", unique_name("meshwarp-agenttest-")));
    let opts = DaemonOptions {
        dataplane: DataplaneConfig {
            pin_root: pin_root.clone(),
            cgroup: Some(cgroup.path.clone()),
            max_rules: 256,
            max_sockets: 256,
            ..DataplaneConfig::default()
        },
        socket: Some(socket.clone()),
        drain_timeout: Duration::from_secs(1),
        ..DaemonOptions::default()
    };
    let _cleanup = Uninstall(pin_root);
    let pods = fixture("istio-pod.json")?;
    let want = desired("node-a", &pods, &fixture("services.json")?, &fixture("endpointslices.json")?);
    ensure!(!want.capture_rules.is_empty() && !want.pairs.is_empty());
    let rules = want.capture_rules.len() + want.pairs.len();
    let rt = tokio::runtime::Runtime::new()?;
    let addr = socket.display().to_string();

    let node = EmbeddedNode::start(opts.clone())?;
    let mut agent = Agent::new(&addr, "mesh-controller", 30);
    ensure!(rt.block_on(agent.sync(&want))? == rules, "the first sync creates every rule");
    ensure!(rt.block_on(agent.sync(&want))? == 0, "nothing new: a lease renewal");
    let listed = |node: &EmbeddedNode| -> Result<usize> {
        let mut c = node.client()?;
        let caps = node.runtime().block_on(c.list_capture_rules(pb::ListCaptureRulesRequest {
            owner: "mesh-controller".into(),
            ..Default::default()
        }))?;
        let pairs = node
            .runtime()
            .block_on(c.list_pairs(pb::ListPairsRequest { owner: "mesh-controller".into(), ..Default::default() }))?;
        Ok(caps.into_inner().rules.len() + pairs.into_inner().pairs.len())
    };
    ensure!(listed(&node)? == rules);

    // The node service restarts (the pins stay): the agent's next call finds
    // the old connection dead, the one after reconnects; nothing to change.
    drop(node);
    let node = EmbeddedNode::start(opts)?;
    let mut outcome = rt.block_on(agent.sync(&want));
    if outcome.is_err() {
        outcome = rt.block_on(agent.sync(&want));
    }
    ensure!(outcome? == 0, "every rule was adopted from the pins");
    ensure!(listed(&node)? == rules);

    // The controller restarts: a new agent, a newer generation.
    let mut again = Agent::new(&addr, "mesh-controller", 30);
    ensure!(rt.block_on(again.sync(&want))? == 0);
    // Its desired state shrinks: the rest goes.
    let mut fewer = want.clone();
    fewer.capture_rules.truncate(1);
    ensure!(rt.block_on(again.sync(&fewer))? == rules - fewer.capture_rules.len() - fewer.pairs.len());
    ensure!(listed(&node)? == 1 + fewer.pairs.len());
    Ok(())
}

/// Removes the test's pins whatever happens.
struct Uninstall(PathBuf);

impl Drop for Uninstall {
    fn drop(&mut self) {
        let _ = meshwarp_core::node::uninstall(&self.0);
    }
}
