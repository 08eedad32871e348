//! What a meshed pod's sidecar captures, as meshwarp rules: the translation a
//! mesh controller runs for the pods of its node (the Kubernetes side reads
//! the objects; the meshwarp side sends the result with SyncOwner).
//!
//! Istio's injector adds the `istio-proxy` container (UID 1337) and the
//! `sidecar.istio.io/status` annotation; istio-iptables then redirects the
//! pod's outbound TCP (except the proxy's own, UID 1337) to 15001 and its
//! inbound TCP to 15006, honouring `traffic.sidecar.istio.io/*`
//! include/exclude annotations; the proxy reaches the app from 127.0.0.6.
//! Linkerd's injector adds `linkerd-proxy` (UID 2102) and
//! `linkerd.io/proxy-version`; linkerd-init redirects outbound to 4140 and
//! inbound to 4143, skipping `config.linkerd.io/skip-{inbound,outbound}-ports`.
//!
//! Each captured connection becomes a capture rule (the origin socket and
//! the proxy's accepted socket are paired by the client endpoint); the
//! proxy's own connection to the app becomes a pair. An excluded port or
//! range gets no rule: iptables does not capture it, and meshwarp never
//! accelerates it either.

use std::collections::BTreeSet;
use std::net::IpAddr;

use std::time::{SystemTime, UNIX_EPOCH};

use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use meshwarp_client::pb;
use meshwarp_client::pb::node_service_client::NodeServiceClient;
use tonic::transport::Channel;

/// Which sidecar a pod runs, and how its init container captures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sidecar {
    pub mesh: Mesh,
    pub pod_ip: IpAddr,
    /// The proxy's UID (its own traffic is not captured).
    pub proxy_uid: u32,
    pub outbound_port: u16,
    pub inbound_port: u16,
    /// Where the proxy connects to the app from (Istio: 127.0.0.6).
    pub inbound_source: IpAddr,
    /// Inbound ports captured: `None` every port the pod's containers expose.
    pub inbound_include: Option<BTreeSet<u16>>,
    pub inbound_exclude: BTreeSet<u16>,
    pub outbound_exclude_ports: BTreeSet<u16>,
    /// Outbound destinations captured: `None` all.
    pub outbound_include_ranges: Option<Vec<Cidr>>,
    pub outbound_exclude_ranges: Vec<Cidr>,
    /// The app's ports (every container's but the proxy's).
    pub app_ports: BTreeSet<u16>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mesh {
    Istio,
    Linkerd,
}

impl Mesh {
    pub fn name(self) -> &'static str {
        match self {
            Mesh::Istio => "istio",
            Mesh::Linkerd => "linkerd",
        }
    }
}

/// An address range of an include/exclude annotation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    pub addr: IpAddr,
    pub len: u8,
}

impl Cidr {
    pub fn parse(s: &str) -> Option<Self> {
        let (a, l) = s.trim().split_once('/').unwrap_or((s.trim(), ""));
        let addr: IpAddr = a.parse().ok()?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let len = if l.is_empty() { max } else { l.parse().ok().filter(|&n| n <= max)? };
        Some(Self { addr, len })
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(a), IpAddr::V4(b)) => {
                let mask = if self.len == 0 { 0 } else { u32::MAX << (32 - u32::from(self.len)) };
                u32::from(a) & mask == u32::from(b) & mask
            }
            (IpAddr::V6(a), IpAddr::V6(b)) => {
                let mask = if self.len == 0 { 0 } else { u128::MAX << (128 - u32::from(self.len)) };
                u128::from(a) & mask == u128::from(b) & mask
            }
            _ => false,
        }
    }
}

/// A ports annotation: "8080,9090", "*" (`None`: every port), "" (none).
fn ports(s: &str) -> Option<BTreeSet<u16>> {
    let s = s.trim();
    if s == "*" {
        return None;
    }
    Some(
        s.split(',')
            .flat_map(|p| {
                // Linkerd also takes ranges: "4567-4570".
                let (lo, hi) = p.trim().split_once('-').unwrap_or((p.trim(), p.trim()));
                let (lo, hi) = (lo.parse::<u16>().ok(), hi.parse::<u16>().ok());
                match (lo, hi) {
                    (Some(lo), Some(hi)) if lo <= hi => (lo..=hi).collect::<Vec<_>>(),
                    _ => Vec::new(),
                }
            })
            .collect(),
    )
}

fn cidrs(s: &str) -> Option<Vec<Cidr>> {
    let s = s.trim();
    if s == "*" {
        return None;
    }
    Some(s.split(',').filter_map(Cidr::parse).collect())
}

/// The value of `flag` in an init container's arguments (`-x VALUE`,
/// `--flag VALUE` or `--flag=VALUE`).
fn arg<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    let eq = format!("{flag}=");
    args.iter().enumerate().find_map(|(i, a)| {
        if a == flag {
            args.get(i + 1).map(String::as_str)
        } else {
            a.strip_prefix(eq.as_str())
        }
    })
}

/// The pod's sidecar as its injector configured it; `None` for a pod
/// without one (or without an IP yet). What the init container
/// (istio-init, linkerd-init) was told wins: it is what iptables captures,
/// mesh-wide settings included; without one (the mesh's CNI plugin writes
/// the rules) the pod's annotations say it.
pub fn sidecar_of(pod: &Pod) -> Option<Sidecar> {
    let ann = pod.metadata.annotations.clone().unwrap_or_default();
    let spec = pod.spec.as_ref()?;
    let pod_ip: IpAddr = pod.status.as_ref()?.pod_ip.as_ref()?.parse().ok()?;
    // A native sidecar is an init container that keeps running.
    let containers = || spec.containers.iter().chain(spec.init_containers.iter().flatten());
    let has = |name: &str| containers().any(|c| c.name == name);
    let (mesh, proxy, init) = if has("istio-proxy") && ann.contains_key("sidecar.istio.io/status") {
        (Mesh::Istio, "istio-proxy", "istio-init")
    } else if has("linkerd-proxy") && ann.contains_key("linkerd.io/proxy-version") {
        (Mesh::Linkerd, "linkerd-proxy", "linkerd-init")
    } else {
        return None;
    };
    let app_ports: BTreeSet<u16> = spec
        .containers
        .iter()
        .filter(|c| c.name != proxy)
        .flat_map(|c| c.ports.iter().flatten())
        .filter(|p| p.protocol.as_deref().unwrap_or("TCP") == "TCP")
        .filter_map(|p| u16::try_from(p.container_port).ok())
        .collect();
    let init_args: Option<Vec<String>> = spec
        .init_containers
        .iter()
        .flatten()
        .find(|c| c.name == init)
        .map(|c| c.command.iter().flatten().chain(c.args.iter().flatten()).cloned().collect());
    // From the init container's arguments if it has them, else from the annotation.
    let setting = |flag: &str, annotation: &str| -> Option<String> {
        match &init_args {
            Some(args) => arg(args, flag).map(str::to_string),
            None => ann.get(annotation).cloned(),
        }
    };
    let port_of = |flag: &str, default: u16| {
        init_args.as_ref().and_then(|a| arg(a, flag)).and_then(|v| v.parse().ok()).unwrap_or(default)
    };
    let uid = |flag: &str, default: u32| {
        let from_init = init_args.as_ref().and_then(|a| arg(a, flag)).and_then(|v| v.parse().ok());
        let from_proxy = containers()
            .find(|c| c.name == proxy)
            .and_then(|c| c.security_context.as_ref()?.run_as_user)
            .and_then(|u| u32::try_from(u).ok());
        from_init.or(from_proxy).unwrap_or(default)
    };
    let port_set = |flag: &str, annotation: &str| setting(flag, annotation).and_then(|v| ports(&v)).unwrap_or_default();
    Some(match mesh {
        Mesh::Istio => Sidecar {
            mesh,
            pod_ip,
            proxy_uid: uid("-u", 1337),
            outbound_port: port_of("-p", 15001),
            inbound_port: port_of("-z", 15006),
            inbound_source: IpAddr::from([127, 0, 0, 6]),
            inbound_include: setting("-b", "traffic.sidecar.istio.io/includeInboundPorts").and_then(|v| ports(&v)),
            inbound_exclude: port_set("-d", "traffic.sidecar.istio.io/excludeInboundPorts"),
            outbound_exclude_ports: port_set("-o", "traffic.sidecar.istio.io/excludeOutboundPorts"),
            outbound_include_ranges: setting("-i", "traffic.sidecar.istio.io/includeOutboundIPRanges")
                .and_then(|v| cidrs(&v)),
            outbound_exclude_ranges: setting("-x", "traffic.sidecar.istio.io/excludeOutboundIPRanges")
                .and_then(|v| cidrs(&v))
                .unwrap_or_default(),
            app_ports,
        },
        Mesh::Linkerd => Sidecar {
            mesh,
            pod_ip,
            proxy_uid: uid("--proxy-uid", 2102),
            outbound_port: port_of("--outgoing-proxy-port", 4140),
            inbound_port: port_of("--incoming-proxy-port", 4143),
            // linkerd2-proxy forwards inbound connections to the app's
            // original destination from the pod's own address.
            inbound_source: pod_ip,
            inbound_include: None,
            inbound_exclude: port_set("--inbound-ports-to-ignore", "config.linkerd.io/skip-inbound-ports"),
            outbound_exclude_ports: port_set("--outbound-ports-to-ignore", "config.linkerd.io/skip-outbound-ports"),
            outbound_include_ranges: None,
            outbound_exclude_ranges: setting("--subnets-to-ignore", "config.linkerd.io/skip-subnets")
                .and_then(|v| cidrs(&v))
                .unwrap_or_default(),
            app_ports,
        },
    })
}

impl Sidecar {
    /// Whether the init container captures the app's connection to `dst:port`.
    pub fn captures_outbound(&self, dst: IpAddr, port: u16) -> bool {
        // The pod calling itself goes over lo, which neither mesh captures.
        dst != self.pod_ip
            && !self.outbound_exclude_ports.contains(&port)
            && !self.outbound_exclude_ranges.iter().any(|c| c.contains(dst))
            && self.outbound_include_ranges.as_ref().is_none_or(|r| r.iter().any(|c| c.contains(dst)))
            && dst.is_ipv4() == self.pod_ip.is_ipv4()
    }

    /// Whether it captures connections to the pod's `port`.
    pub fn captures_inbound(&self, port: u16) -> bool {
        port != self.inbound_port
            && port != self.outbound_port
            && !self.inbound_exclude.contains(&port)
            && self.inbound_include.as_ref().is_none_or(|p| p.contains(&port))
    }
}

/// A destination a pod may call: a service's cluster IP, or for a headless
/// service each ready endpoint.
pub fn destinations(services: &[Service], slices: &[EndpointSlice]) -> BTreeSet<(IpAddr, u16)> {
    let mut out = BTreeSet::new();
    for s in services {
        let Some(spec) = &s.spec else { continue };
        let tcp_ports: Vec<u16> = spec
            .ports
            .iter()
            .flatten()
            .filter(|p| p.protocol.as_deref().unwrap_or("TCP") == "TCP")
            .filter_map(|p| u16::try_from(p.port).ok())
            .collect();
        let ips: Vec<IpAddr> = spec.cluster_ips.iter().flatten().filter_map(|ip| ip.parse().ok()).collect();
        if !ips.is_empty() {
            out.extend(ips.iter().flat_map(|ip| tcp_ports.iter().map(move |p| (*ip, *p))));
            continue;
        }
        // Headless: the pods are called directly.
        let name = s.metadata.name.as_deref().unwrap_or_default();
        let ns = s.metadata.namespace.as_deref();
        for slice in slices.iter().filter(|e| {
            e.metadata.namespace.as_deref() == ns
                && e.metadata.labels.as_ref().and_then(|l| l.get("kubernetes.io/service-name")).map(String::as_str)
                    == Some(name)
        }) {
            let ports: Vec<u16> = slice
                .ports
                .iter()
                .flatten()
                .filter(|p| p.protocol.as_deref().unwrap_or("TCP") == "TCP")
                .filter_map(|p| p.port.and_then(|p| u16::try_from(p).ok()))
                .collect();
            for ep in slice.endpoints.iter().filter(|e| e.conditions.as_ref().and_then(|c| c.ready) != Some(false)) {
                for ip in ep.addresses.iter().filter_map(|a| a.parse::<IpAddr>().ok()) {
                    out.extend(ports.iter().map(|p| (ip, *p)));
                }
            }
        }
    }
    out
}

/// The objects of a JSON document as `kubectl get -o json` prints it: a
/// List's items, or the one object it is.
pub fn objects_from_json<T: serde::de::DeserializeOwned>(text: &str) -> Result<Vec<T>, serde_json::Error> {
    let v: serde_json::Value = serde_json::from_str(text)?;
    match v.get("items").and_then(|i| i.as_array()) {
        Some(items) => items.iter().map(|i| T::deserialize(i)).collect(),
        None => Ok(vec![T::deserialize(v)?]),
    }
}

fn endpoint(ip: IpAddr, port: u16) -> Option<pb::Endpoint> {
    Some(pb::Endpoint { ip: ip.to_string(), port: u32::from(port) })
}

/// The rules of one node: for each meshed pod on it, its captured outbound
/// connections to every destination, its captured inbound ports, and its
/// proxy's connections to the app.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Desired {
    pub pairs: Vec<pb::EndpointPair>,
    pub capture_rules: Vec<pb::CaptureRule>,
}

pub fn desired(node: &str, pods: &[Pod], services: &[Service], slices: &[EndpointSlice]) -> Desired {
    let dests = destinations(services, slices);
    let mut d = Desired::default();
    let lo = |ip: IpAddr| {
        if ip.is_ipv4() {
            IpAddr::from([127, 0, 0, 1])
        } else {
            IpAddr::from([0u16, 0, 0, 0, 0, 0, 0, 1])
        }
    };
    for pod in pods {
        if pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) != Some(node) {
            continue;
        }
        let Some(sc) = sidecar_of(pod) else { continue };
        for &(dst, port) in dests.iter().filter(|(ip, p)| sc.captures_outbound(*ip, *p)) {
            d.capture_rules.push(pb::CaptureRule {
                client_ip: sc.pod_ip.to_string(),
                original_dst: endpoint(dst, port),
                listener: endpoint(lo(sc.pod_ip), sc.outbound_port),
                ..Default::default()
            });
        }
        for &port in sc.app_ports.iter().filter(|p| sc.captures_inbound(**p)) {
            d.capture_rules.push(pb::CaptureRule {
                original_dst: endpoint(sc.pod_ip, port),
                listener: endpoint(sc.pod_ip, sc.inbound_port),
                ..Default::default()
            });
            d.pairs.push(pb::EndpointPair {
                client_ip: sc.inbound_source.to_string(),
                server: endpoint(sc.pod_ip, port),
                ..Default::default()
            });
        }
    }
    d
}

/// Why a sync did not reach the node agent.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error(transparent)]
    Connect(#[from] meshwarp_client::ClientError),
    #[error("SyncOwner: {} ({:?})", .0.message(), .0.code())]
    Rpc(tonic::Status),
}

/// The node agent, as the controller sees it: one SyncOwner per change, a
/// lease renewal otherwise.
#[derive(Debug)]
pub struct Agent {
    addr: String,
    owner: String,
    lease_seconds: u32,
    client: Option<NodeServiceClient<Channel>>,
    /// What the agent holds since the last successful sync (None: unknown).
    synced: Option<Desired>,
    /// The last generation sent.
    generation: u64,
}

impl Agent {
    /// Larger at every call, also across restarts of the controller
    /// (milliseconds since the epoch), so a restarted controller is never
    /// stale; never smaller than the last, should the clock step back.
    fn next_generation(&mut self) -> u64 {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        self.generation = now.max(self.generation + 1);
        self.generation
    }
}

impl Agent {
    pub fn new(addr: &str, owner: &str, lease_seconds: u32) -> Self {
        Self {
            addr: addr.to_string(),
            owner: owner.to_string(),
            lease_seconds,
            client: None,
            synced: None,
            generation: 0,
        }
    }

    /// Makes the agent hold `want`: a SyncOwner when it changed (or the
    /// agent may have forgotten it), else a lease renewal. A failed call
    /// drops the connection; the next one reconnects and syncs in full.
    /// Returns the changes the agent made.
    pub async fn sync(&mut self, want: &Desired) -> Result<usize, SyncError> {
        if let (true, Some(c)) = (self.synced.as_ref() == Some(want), self.client.as_mut()) {
            if c.renew_lease(pb::RenewLeaseRequest { owner: self.owner.clone() }).await.is_ok() {
                return Ok(0);
            }
            // The agent forgot this owner (it restarted): sync in full.
        }
        let generation = self.next_generation();
        let c = match self.client.as_mut() {
            Some(c) => c,
            None => self.client.insert(meshwarp_client::connect(&self.addr).await?),
        };
        let req = pb::SyncOwnerRequest {
            owner: self.owner.clone(),
            generation,
            pairs: want.pairs.clone(),
            capture_rules: want.capture_rules.clone(),
            routes: Vec::new(),
            lease_seconds: self.lease_seconds,
        };
        match c.sync_owner(req).await {
            Ok(r) => {
                self.synced = Some(want.clone());
                Ok(r.into_inner().changes.len())
            }
            Err(e) => {
                self.client = None;
                self.synced = None;
                Err(SyncError::Rpc(e))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list<T: serde::de::DeserializeOwned>(file: &str) -> Vec<T> {
        let text = std::fs::read_to_string(format!("{}/testdata/{file}", env!("CARGO_MANIFEST_DIR"))).unwrap();
        objects_from_json(&text).unwrap()
    }

    fn pod(file: &str) -> Pod {
        list::<Pod>(file).remove(0)
    }

    fn dsts(d: &Desired, listener_port: u32) -> Vec<String> {
        d.capture_rules
            .iter()
            .filter(|c| c.listener.as_ref().is_some_and(|l| l.port == listener_port))
            .map(|c| c.original_dst.as_ref().map(|e| format!("{}:{}", e.ip, e.port)).unwrap_or_default())
            .collect()
    }

    #[test]
    fn istio_injected_pod_gets_what_istio_iptables_captures() {
        let (p, services, slices) =
            (pod("istio-pod.json"), list::<Service>("services.json"), list::<EndpointSlice>("endpointslices.json"));
        let sc = sidecar_of(&p).unwrap();
        assert_eq!((sc.mesh, sc.proxy_uid, sc.outbound_port, sc.inbound_port), (Mesh::Istio, 1337, 15001, 15006));
        let d = desired("node-a", std::slice::from_ref(&p), &services, &slices);
        // Outbound: ratings yes; postgres (excluded port 5432) and legacy
        // (excluded range 10.96.200.0/24) never; DNS over TCP yes, over UDP not TCP.
        let out = dsts(&d, 15001);
        assert!(out.contains(&"10.96.12.40:9080".to_string()), "{out:?}");
        assert!(out.contains(&"10.96.0.10:53".to_string()), "{out:?}");
        assert!(!out.iter().any(|o| o.ends_with(":5432") || o.starts_with("10.96.200.")), "{out:?}");
        // Headless services: their ready endpoints, not the terminating one.
        assert!(out.contains(&"10.244.2.31:8080".to_string()) && !out.contains(&"10.244.1.40:8080".to_string()));
        assert!(d
            .capture_rules
            .iter()
            .filter(|c| c.listener.as_ref().is_some_and(|l| l.port == 15001))
            .all(|c| { c.client_ip == "10.244.1.17" && c.listener.as_ref().is_some_and(|l| l.ip == "127.0.0.1") }));
        // Inbound: 9080 captured to pod_ip:15006 (9081 excluded; the proxy's 15090 is not the app's).
        assert_eq!(dsts(&d, 15006), vec!["10.244.1.17:9080"]);
        assert_eq!(d.pairs.len(), 1);
        assert_eq!(d.pairs[0].client_ip, "127.0.0.6");
        assert_eq!(d.pairs[0].server, endpoint("10.244.1.17".parse().unwrap(), 9080));
        // Another node's controller registers nothing for it.
        assert_eq!(desired("node-b", &[p], &services, &slices), Desired::default());
    }

    #[test]
    fn linkerd_injected_pod_skips_its_skip_ports() {
        let (p, services, slices) =
            (pod("linkerd-pod.json"), list::<Service>("services.json"), list::<EndpointSlice>("endpointslices.json"));
        let sc = sidecar_of(&p).unwrap();
        assert_eq!((sc.mesh, sc.proxy_uid, sc.outbound_port, sc.inbound_port), (Mesh::Linkerd, 2102, 4140, 4143));
        let d = desired("node-a", &[p], &services, &slices);
        let out = dsts(&d, 4140);
        assert!(out.contains(&"10.96.12.40:9080".to_string()), "{out:?}");
        assert!(!out.iter().any(|o| o.ends_with(":6379")), "skip-outbound-ports 6379: {out:?}");
        assert_eq!(dsts(&d, 4143), vec!["10.244.1.23:8080"], "8081 is skipped, the proxy's ports are not the app's");
        assert_eq!(d.pairs[0].client_ip, "10.244.1.23");
    }

    #[test]
    fn the_init_containers_arguments_win_and_native_sidecars_count() {
        // A mesh-wide exclusion the injector passed to istio-init only.
        let mut p = pod("istio-pod.json");
        let ann = p.metadata.annotations.as_mut().unwrap();
        ann.retain(|k, _| !k.starts_with("traffic.sidecar.istio.io/"));
        let spec = p.spec.as_mut().unwrap();
        let init = spec.init_containers.as_mut().unwrap();
        let args = init[0].args.as_mut().unwrap();
        let o = args.iter().position(|a| a == "-o").unwrap();
        args[o + 1] = "5432,6379".into();
        let sc = sidecar_of(&p).unwrap();
        assert_eq!(sc.outbound_exclude_ports, BTreeSet::from([5432, 6379]));
        assert!(!sc.captures_outbound("10.96.30.5".parse().unwrap(), 6379));
        assert!(!sc.captures_inbound(9081), "-d from istio-init");
        assert!(!sc.captures_outbound(sc.pod_ip, 9080), "itself, over lo");
        // Without istio-init (Istio's CNI plugin), the annotations say it.
        let mut cni = pod("istio-pod.json");
        cni.spec.as_mut().unwrap().init_containers = None;
        assert!(!sidecar_of(&cni).unwrap().captures_inbound(9081));
        // The proxy as a native sidecar (an init container that keeps running).
        let mut native = pod("linkerd-pod.json");
        let spec = native.spec.as_mut().unwrap();
        let proxy = spec.containers.remove(0);
        assert_eq!(proxy.name, "linkerd-proxy");
        spec.init_containers.as_mut().unwrap().push(proxy);
        let sc = sidecar_of(&native).unwrap();
        assert_eq!((sc.mesh, sc.proxy_uid, sc.app_ports.clone()), (Mesh::Linkerd, 2102, BTreeSet::from([8080, 8081])));
        assert!(!sc.captures_inbound(4190) && !sc.captures_inbound(8081), "--inbound-ports-to-ignore");
    }

    #[test]
    fn pods_without_a_sidecar_and_annotation_syntax() {
        let mut p = pod("istio-pod.json");
        p.metadata.annotations.as_mut().unwrap().remove("sidecar.istio.io/status");
        assert!(sidecar_of(&p).is_none(), "the container alone is not injection");
        assert_eq!(ports("*"), None);
        assert_eq!(ports("80, 4567-4569,x"), Some(BTreeSet::from([80, 4567, 4568, 4569])));
        let c = Cidr::parse("10.96.0.0/12").unwrap();
        assert!(c.contains("10.100.1.1".parse().unwrap()) && !c.contains("10.112.0.1".parse().unwrap()));
        assert!(Cidr::parse("10.0.0.0/33").is_none());
        assert!(Cidr::parse("fd00::/8").unwrap().contains("fd12::1".parse().unwrap()));
    }
}
