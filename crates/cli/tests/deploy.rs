//! The deployment (deploy/) checked without a cluster, as strictly as the
//! tools that run here allow:
//!
//! - every manifest, and the Helm chart rendered in both of its modes, decoded
//!   into its Kubernetes API type (k8s-openapi, API v1.33) with unknown or
//!   misspelt fields refused, as the API server's `fieldValidation=Strict` does;
//! - `helm lint --strict` on the chart and `helm template` to render it (helm
//!   is installed by `scripts/install-deps.sh`; under CI=true a missing helm
//!   fails this test, elsewhere it is skipped loudly);
//! - the kustomization names only files that exist;
//! - what meshwarp needs of the agent's DaemonSet: host network and PID, the
//!   node's bpffs, cgroup2 and /run/meshwarp, capabilities rather than
//!   privileged, readiness from gRPC health, and arguments the real binary
//!   accepts.
//!
//! Not checked here: admission (PodSecurity, webhooks), scheduling, and the
//! image itself (no container engine runs on these machines).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, ensure, Context, Result};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use serde::Deserialize;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

/// One decoded object.
#[derive(Debug)]
enum Object {
    Namespace(Box<Namespace>),
    ServiceAccount(Box<ServiceAccount>),
    ClusterRole(Box<ClusterRole>),
    ClusterRoleBinding(Box<ClusterRoleBinding>),
    DaemonSet(Box<DaemonSet>),
}

/// Decodes `v` into `T`, refusing any field `T` does not have.
fn strict<T: for<'de> Deserialize<'de>>(v: serde_norway::Value, what: &str) -> Result<T> {
    let mut unknown = Vec::new();
    let t = serde_ignored::deserialize(v, |path| unknown.push(path.to_string()))
        .map_err(|e| anyhow::anyhow!("{what}: {e}"))?;
    ensure!(unknown.is_empty(), "{what}: fields the Kubernetes API does not have: {unknown:?}");
    Ok(t)
}

/// Every document of a YAML stream, decoded by its kind.
fn objects(yaml: &str, origin: &str) -> Result<Vec<Object>> {
    let mut out = Vec::new();
    for (i, de) in serde_norway::Deserializer::from_str(yaml).enumerate() {
        let v = serde_norway::Value::deserialize(de).with_context(|| format!("{origin}: document {i}"))?;
        if v.is_null() {
            continue;
        }
        let kind = v.get("kind").and_then(|k| k.as_str()).unwrap_or_default().to_string();
        let what = format!("{origin}: {kind} (document {i})");
        out.push(match kind.as_str() {
            "Namespace" => Object::Namespace(Box::new(strict(v, &what)?)),
            "ServiceAccount" => Object::ServiceAccount(Box::new(strict(v, &what)?)),
            "ClusterRole" => Object::ClusterRole(Box::new(strict(v, &what)?)),
            "ClusterRoleBinding" => Object::ClusterRoleBinding(Box::new(strict(v, &what)?)),
            "DaemonSet" => Object::DaemonSet(Box::new(strict(v, &what)?)),
            other => bail!("{what}: a kind this check does not know: {other:?}"),
        });
    }
    Ok(out)
}

/// What the agent (or the uninstall DaemonSet) must have to work on a node.
fn check_daemonset(ds: &DaemonSet, origin: &str) -> Result<()> {
    let name = ds.metadata.name.clone().unwrap_or_default();
    let pod = ds.spec.as_ref().and_then(|s| s.template.spec.as_ref()).context("pod spec")?;
    ensure!(pod.host_network == Some(true), "{origin} {name}: host network");
    let host_paths: Vec<String> =
        pod.volumes.iter().flatten().filter_map(|v| v.host_path.as_ref().map(|h| h.path.clone())).collect();
    ensure!(host_paths.iter().any(|p| p == "/sys/fs/bpf"), "{origin} {name}: the node's bpffs");
    ensure!(host_paths.iter().any(|p| p == "/run/meshwarp"), "{origin} {name}: /run/meshwarp from the node");
    let containers = pod.init_containers.iter().flatten().chain(pod.containers.iter());
    for c in containers.filter(|c| c.image.as_deref().is_some_and(|i| i.contains("meshwarp"))) {
        let sc = c.security_context.as_ref().context("a security context")?;
        ensure!(sc.privileged != Some(true), "{origin} {name}/{}: capabilities, not privileged", c.name);
        let caps = sc.capabilities.as_ref().context("capabilities")?;
        ensure!(caps.drop.iter().flatten().any(|d| d == "ALL"), "{origin} {name}/{}: drops ALL", c.name);
        let add: Vec<&str> = caps.add.iter().flatten().map(String::as_str).collect();
        for need in ["BPF", "NET_ADMIN"] {
            ensure!(add.contains(&need), "{origin} {name}/{}: adds {need}", c.name);
        }
        // The arguments the real binary accepts (clap refuses unknown flags
        // and bad values before it prints help).
        let args: Vec<String> = c.args.clone().unwrap_or_default();
        let out = Command::new(env!("CARGO_BIN_EXE_meshwarp")).args(&args).arg("--help").output()?;
        ensure!(
            out.status.success(),
            "{origin} {name}/{}: `meshwarp {args:?}`: {}",
            c.name,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    if name == "meshwarp" {
        ensure!(pod.host_pid == Some(true), "{origin}: host PID (the reader guard reads /proc/<pid>/exe)");
        ensure!(host_paths.iter().any(|p| p == "/sys/fs/cgroup"), "{origin}: the node's cgroup2 hierarchy");
        let agent = pod.containers.first().context("the agent container")?;
        let probe = agent.readiness_probe.as_ref().and_then(|p| p.exec.as_ref()).context("an exec readiness probe")?;
        let cmd = probe.command.clone().unwrap_or_default();
        ensure!(cmd.iter().any(|a| a == "health"), "{origin}: readiness from gRPC health: {cmd:?}");
        let probe_args = cmd.iter().skip(1).cloned().chain(["--help".to_string()]);
        let out = Command::new(env!("CARGO_BIN_EXE_meshwarp")).args(probe_args).output()?;
        ensure!(out.status.success(), "{origin}: the probe's command: {}", String::from_utf8_lossy(&out.stderr));
        let grace = pod.termination_grace_period_seconds.unwrap_or(30);
        let drain = agent.args.iter().flatten().find_map(|a| a.strip_prefix("--drain-timeout=")).unwrap_or("10");
        ensure!(grace > drain.parse::<i64>()?, "{origin}: the grace period outlasts the drain");
    }
    Ok(())
}

fn kinds(objs: &[Object]) -> Vec<&'static str> {
    objs.iter()
        .map(|o| match o {
            Object::Namespace(_) => "Namespace",
            Object::ServiceAccount(_) => "ServiceAccount",
            Object::ClusterRole(_) => "ClusterRole",
            Object::ClusterRoleBinding(_) => "ClusterRoleBinding",
            Object::DaemonSet(_) => "DaemonSet",
        })
        .collect()
}

fn check_all(objs: &[Object], origin: &str) -> Result<()> {
    for o in objs {
        if let Object::DaemonSet(ds) = o {
            check_daemonset(ds, origin)?;
        }
        if let Object::Namespace(n) = o {
            let labels = n.metadata.labels.clone().unwrap_or_default();
            let pss = labels.get("pod-security.kubernetes.io/enforce").map(String::as_str);
            ensure!(
                pss == Some("privileged"),
                "{origin}: the agent's host namespaces need the privileged PodSecurity level"
            );
        }
        if let Object::ServiceAccount(sa) = o {
            if sa.metadata.name.as_deref() == Some("meshwarp") {
                ensure!(sa.automount_service_account_token == Some(false), "{origin}: the agent needs no API token");
            }
        }
        if let Object::ClusterRoleBinding(b) = o {
            let subject = b.subjects.iter().flatten().next().context("a subject")?;
            ensure!(subject.kind == "ServiceAccount" && b.role_ref.name == "meshwarp-controller", "{origin}: {b:?}");
        }
        if let Object::ClusterRole(r) = o {
            // The controller reads; it never writes to the cluster.
            for rule in r.rules.iter().flatten() {
                ensure!(
                    rule.verbs.iter().all(|v| ["get", "list", "watch"].contains(&v.as_str())),
                    "{origin}: {rule:?}"
                );
            }
        }
    }
    Ok(())
}

#[test]
fn plain_manifests_decode_strictly_and_carry_what_the_agent_needs() -> Result<()> {
    let dir = deploy_dir().join("kubernetes");
    let kustomization: serde_norway::Value =
        serde_norway::from_str(&std::fs::read_to_string(dir.join("kustomization.yaml"))?)?;
    let listed: Vec<String> = kustomization["resources"]
        .as_sequence()
        .context("resources")?
        .iter()
        .filter_map(|r| r.as_str().map(str::to_string))
        .collect();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml") && !p.ends_with("kustomization.yaml"))
        .collect();
    files.sort();
    for f in &files {
        let name = f.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
        ensure!(listed.contains(&name) || name == "uninstall-daemonset.yaml", "{name} is not in the kustomization");
        let objs = objects(&std::fs::read_to_string(f)?, &name)?;
        ensure!(!objs.is_empty(), "{name}: no object");
        check_all(&objs, &name)?;
    }
    for r in &listed {
        ensure!(dir.join(r).exists(), "the kustomization names {r}, which does not exist");
    }
    // A field Kubernetes does not have is caught (the check can fail).
    let typo = "apiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: x\nautomountServiceAcountToken: false\n";
    let err = objects(typo, "typo").unwrap_err().to_string();
    ensure!(err.contains("automountServiceAcountToken"), "{err}");
    Ok(())
}

fn helm() -> Option<PathBuf> {
    let found = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("helm"))
        .find(|p| p.is_file());
    if found.is_none() {
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("helm is missing (scripts/install-deps.sh installs it); CI=true: failing, not skipping");
        }
        eprintln!("SKIPPED: helm is not installed (scripts/install-deps.sh installs it): the chart is not checked");
    }
    found
}

#[test]
fn the_helm_chart_lints_and_renders_strictly_in_both_modes() -> Result<()> {
    let Some(helm) = helm() else { return Ok(()) };
    let chart = deploy_dir().join("helm/meshwarp");
    let lint = Command::new(&helm).arg("lint").arg("--strict").arg(&chart).output()?;
    ensure!(
        lint.status.success(),
        "helm lint: {}{}",
        String::from_utf8_lossy(&lint.stdout),
        String::from_utf8_lossy(&lint.stderr)
    );
    for (mode, set, agent) in
        [("agent", "cleanup.enabled=false", "meshwarp"), ("cleanup", "cleanup.enabled=true", "meshwarp-uninstall")]
    {
        let out = Command::new(&helm)
            .args(["template", "meshwarp"])
            .arg(&chart)
            .args(["--kube-version", "1.33.0", "--set", set])
            .output()?;
        ensure!(out.status.success(), "helm template ({mode}): {}", String::from_utf8_lossy(&out.stderr));
        let objs = objects(&String::from_utf8(out.stdout)?, &format!("chart ({mode})"))?;
        ensure!(
            kinds(&objs)
                == ["Namespace", "ServiceAccount", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "DaemonSet"],
            "chart ({mode}): {:?}",
            kinds(&objs)
        );
        let ds =
            objs.iter().find_map(|o| if let Object::DaemonSet(d) = o { Some(d) } else { None }).context("DaemonSet")?;
        ensure!(ds.metadata.name.as_deref() == Some(agent), "chart ({mode}) runs {:?}", ds.metadata.name);
        check_all(&objs, &format!("chart ({mode})"))?;
    }
    Ok(())
}
