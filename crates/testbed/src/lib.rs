//! Namespace topologies and traffic for tests, benches and the demo: one crate
//! so all three exercise the same "node with pods" shape.
//!
//! Everything lives in network namespaces created here with unique names and
//! removed on drop (RAII); nothing touches the host's own interfaces. Links,
//! addresses and iptables rules are set with iproute2 and iptables inside those
//! namespaces, as kernel selftests do.

use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use nix::sched::{setns, CloneFlags};
use socket2::{Domain, Socket, Type};

use meshwarp_core::dataplane::{Dataplane, DataplaneConfig, DataplaneError};
use meshwarp_core::node::uninstall;

#[derive(Debug, thiserror::Error)]
pub enum TestbedError {
    #[error("`{cmd}` failed: {stderr}")]
    Command { cmd: String, stderr: String },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Sys(#[from] meshwarp_core::sys::SysError),
    #[error("data integrity: {0}")]
    Integrity(String),
    #[error(transparent)]
    Dataplane(#[from] DataplaneError),
}

type Result<T> = std::result::Result<T, TestbedError>;

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> TestbedError {
    let what = what.into();
    move |source| TestbedError::Io { what, source }
}

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A name unique to this process and call, at most `max` bytes.
pub fn unique_name(prefix: &str) -> String {
    format!("{prefix}{}-{}", std::process::id() % 100_000, SEQ.fetch_add(1, Ordering::Relaxed))
}

/// Removes what test processes that died without running their guards' drop
/// (a timeout's SIGKILL, a killed bench) left behind, named by their process
/// id (see [`unique_name`]): pin roots, whose programs stay attached to every
/// socket call of the host (tracepoints are global) and slow every later
/// test and measurement; network namespaces; cgroups. Only names whose
/// process id no live process has; once per process.
pub fn sweep_leftovers() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let entries = |dir: &Path| -> Vec<(String, PathBuf)> {
            std::fs::read_dir(dir)
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|e| Some((e.file_name().into_string().ok()?, e.path())))
                .collect()
        };
        // Listed before the live processes are: what a process started
        // after that snapshot makes is not in these lists.
        let pins = entries(Path::new("/sys/fs/bpf"));
        let netns = entries(Path::new("/run/netns"));
        let cgroup_root = meshwarp_core::sys::cgroup2_root().ok();
        let cgroups = cgroup_root.as_deref().map(entries).unwrap_or_default();
        let live: std::collections::HashSet<u32> = std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .map(|pid| pid % 100_000)
            .collect();
        let dead = |tag: Option<&str>| tag.and_then(|t| t.parse::<u32>().ok()).is_some_and(|p| !live.contains(&p));
        // meshwarp-<what>-<pid>-<n>
        let ours = |name: &str| name.starts_with("meshwarp-") && dead(name.split('-').nth(2));
        for (name, path) in pins {
            if ours(&name) {
                // Refused while a process holds the pins (one in another PID
                // namespace, say): those are not leftovers.
                match meshwarp_core::node::uninstall_unheld(&path) {
                    Ok(()) => eprintln!("testbed: removed the pins a dead test process left at {}", path.display()),
                    Err(e) => eprintln!("testbed: could not remove the leftover pins at {}: {e}", path.display()),
                }
            }
        }
        // mw<pid>-<n><role>
        for (name, _) in netns {
            let pid = name.strip_prefix("mw").and_then(|r| r.split('-').next());
            if pid.is_some_and(|p| !p.is_empty()) && dead(pid) && run("ip", &["netns", "del", &name]).is_ok() {
                eprintln!("testbed: removed the network namespace {name} a dead test process left");
            }
        }
        for (name, path) in cgroups {
            // rmdir refuses a cgroup that still has processes.
            if ours(&name) && std::fs::remove_dir(&path).is_ok() {
                eprintln!("testbed: removed the cgroup {} a dead test process left", path.display());
            }
        }
    });
}

/// Runs a command; its stderr goes into the error.
pub fn run(cmd: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .map_err(io_err(format!("running {cmd} (is it installed? `make deps` installs it)")))?;
    if !out.status.success() {
        return Err(TestbedError::Command {
            cmd: format!("{cmd} {}", args.join(" ")),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A namespace's TCP congestion control sysctl (per namespace since 4.15).
const TCP_CONGESTION_CONTROL: &str = "/proc/sys/net/ipv4/tcp_congestion_control";

/// A network namespace, deleted on drop.
#[derive(Debug)]
pub struct NetNs {
    name: String,
}

impl NetNs {
    /// Creates `mw<pid>-<n><role>`, with loopback up.
    pub fn new(role: &str) -> Result<Self> {
        sweep_leftovers();
        let name = format!("{}{role}", unique_name("mw"));
        run("ip", &["netns", "add", &name])?;
        let ns = Self { name };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The namespace's bind mount, to enter it.
    pub fn path(&self) -> PathBuf {
        Path::new("/var/run/netns").join(&self.name)
    }

    /// `ip -n <ns> ARGS`.
    pub fn ip(&self, args: &[&str]) -> Result<String> {
        let mut all = vec!["-n", &self.name];
        all.extend_from_slice(args);
        run("ip", &all)
    }

    /// Turns TCP Fast Open on for clients and servers in this namespace
    /// (`net.ipv4.tcp_fastopen=3`).
    pub fn fast_open_on(&self) -> Result<()> {
        self.enter(|| std::fs::write("/proc/sys/net/ipv4/tcp_fastopen", "3"))?
            .map_err(io_err(format!("net.ipv4.tcp_fastopen=3 in {}", self.name)))
    }

    /// The namespace's TCP congestion control
    /// (`net.ipv4.tcp_congestion_control`); a new namespace starts with the
    /// host's.
    pub fn congestion_control(&self) -> Result<String> {
        let path = TCP_CONGESTION_CONTROL;
        let name = self
            .enter(|| std::fs::read_to_string(path))?
            .map_err(io_err(format!("reading {path} in {}", self.name)))?;
        Ok(name.trim().to_string())
    }

    /// Sets the namespace's TCP congestion control for sockets made from
    /// now on (the kernel loads its module if it can). A namespace other
    /// than the host's may only choose one the host allows
    /// (`net.ipv4.tcp_allowed_congestion_control`, EPERM otherwise).
    pub fn set_congestion_control(&self, name: &str) -> Result<()> {
        let path = TCP_CONGESTION_CONTROL;
        self.enter(|| std::fs::write(path, name))?.map_err(io_err(format!(
            "{path}={name} in {} (it must be in the host's net.ipv4.tcp_allowed_congestion_control; \
             see tcp_available_congestion_control)",
            self.name
        )))
    }

    /// Applies `MESHWARP_BENCH_CC` (a congestion control name) to the
    /// namespace when it is set, and returns the one in effect, for a
    /// bench's table header: loopback numbers differ by congestion control
    /// (BBR paces, cubic does not), and a namespace inherits the host's.
    pub fn bench_congestion_control(&self) -> Result<String> {
        if let Some(name) = std::env::var("MESHWARP_BENCH_CC").ok().filter(|n| !n.is_empty()) {
            self.set_congestion_control(&name)?;
        }
        self.congestion_control()
    }

    /// Runs a program inside the namespace (`ip netns exec`).
    pub fn exec(&self, cmd: &[&str]) -> Result<String> {
        let mut all = vec!["netns", "exec", &self.name];
        all.extend_from_slice(cmd);
        run("ip", &all)
    }

    /// Runs `f` on a thread that has entered this namespace. Sockets made
    /// there stay in this namespace wherever they are used afterwards.
    pub fn enter<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T> {
        Ok(meshwarp_core::sys::run_in_netns(Some(&self.path()), f)?)
    }

    /// A TCP listener bound inside this namespace, non-blocking from the
    /// start (as event-driven servers make theirs).
    pub fn listen(&self, addr: SocketAddr) -> Result<TcpListener> {
        self.listen_with(addr, |_| Ok(()))
    }

    /// As [`NetNs::listen`], with `setup` run on the socket before it binds
    /// (socket options its accepted sockets inherit).
    pub fn listen_with(
        &self,
        addr: SocketAddr,
        setup: impl FnOnce(&Socket) -> io::Result<()> + Send,
    ) -> Result<TcpListener> {
        self.enter(|| {
            let s = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
            s.set_reuse_address(true)?;
            if addr.is_ipv6() {
                s.set_only_v6(true)?;
            }
            setup(&s)?;
            s.set_nonblocking(true)?;
            s.bind(&addr.into())?;
            s.listen(1024)?;
            Ok::<_, io::Error>(TcpListener::from(s))
        })?
        .map_err(io_err(format!("listening on {addr} in {}", self.name)))
    }

    /// A non-blocking TCP connection made from inside this namespace.
    pub fn connect(&self, addr: SocketAddr) -> Result<TcpStream> {
        self.connect_with(addr, |_| Ok(()))
    }

    /// As [`NetNs::connect`], with `setup` run on the socket before it
    /// connects (options set before the handshake).
    pub fn connect_with(
        &self,
        addr: SocketAddr,
        setup: impl FnOnce(&Socket) -> io::Result<()> + Send,
    ) -> Result<TcpStream> {
        self.enter(|| {
            let s = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
            setup(&s)?;
            connect_nonblocking(s, addr, Duration::from_secs(5))
        })?
        .map_err(io_err(format!("connecting to {addr} from {}", self.name)))
    }

    /// As [`NetNs::connect`], bound to `local` first (with SO_REUSEADDR when
    /// `reuse`, so a 4-tuple can be used again).
    pub fn connect_from(&self, local: Option<SocketAddr>, addr: SocketAddr, reuse: bool) -> Result<TcpStream> {
        self.connect_with(addr, |s| {
            if reuse {
                s.set_reuse_address(true)?;
            }
            if let Some(l) = local {
                s.bind(&l.into())?;
            }
            Ok(())
        })
    }

    /// An interface counter from /sys/class/net/IFACE/statistics.
    pub fn link_counter(&self, iface: &str, counter: &str) -> Result<u64> {
        let out = self.exec(&["cat", &format!("/sys/class/net/{iface}/statistics/{counter}")])?;
        out.trim().parse().map_err(|_| TestbedError::Integrity(format!("counter {iface}/{counter}: {out:?}")))
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        if let Err(e) = run("ip", &["netns", "del", &self.name]) {
            tracing::warn!(ns = %self.name, "removing netns: {e}");
        }
    }
}

/// A pod: a namespace with `eth0`, whose peer is attached to the node's bridge.
#[derive(Debug)]
pub struct Pod {
    pub ns: NetNs,
    pub v4: Ipv4Addr,
    pub v6: Ipv6Addr,
    /// Name of the veth end in the node namespace.
    pub host_veth: String,
}

impl Pod {
    pub fn addr(&self, v6: bool) -> IpAddr {
        if v6 {
            IpAddr::V6(self.v6)
        } else {
            IpAddr::V4(self.v4)
        }
    }
}

/// Pod subnet (RFC 2544 benchmarking range: never routed off this machine).
pub const POD_NET4: [u8; 3] = [198, 18, 0];
/// Service addresses that only exist as iptables capture targets.
pub const SERVICE_V4: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);
/// Pod subnet for IPv6 (documentation range).
pub const POD_NET6: &str = "2001:db8:1::";
pub const SERVICE_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x9, 0, 0, 0, 0, 0x10);

/// One "node" (a namespace with bridge `br0`, like cni0) and pods on it.
#[derive(Debug)]
pub struct NodeWithPods {
    // Pods first: their namespaces go before the node's.
    pub pods: Vec<Pod>,
    pub node: NetNs,
}

impl NodeWithPods {
    /// A node with `n` pods on 198.18.0.0/24 and 2001:db8:1::/64, dual stack,
    /// each with default routes via the bridge.
    pub fn new(n: usize) -> Result<Self> {
        Self::with_subnet(n, POD_NET4, POD_NET6)
    }

    /// As [`NodeWithPods::new`] with the node's own pod subnets
    /// (`net4`.0/24 and `net6`/64, `net6` ending in "::").
    pub fn with_subnet(n: usize, net4: [u8; 3], net6: &str) -> Result<Self> {
        let node = NetNs::new("node")?;
        node.ip(&["link", "add", "br0", "type", "bridge"])?;
        node.ip(&["addr", "add", &format!("{}.1/24", dotted(net4)), "dev", "br0"])?;
        node.ip(&["addr", "add", &format!("{net6}1/64"), "dev", "br0", "nodad"])?;
        node.ip(&["link", "set", "br0", "up"])?;
        let mut pods = Vec::new();
        for i in 0..n {
            let ns = NetNs::new(&format!("pod{i}"))?;
            let host_veth = format!("vpod{i}");
            node.ip(&["link", "add", &host_veth, "type", "veth", "peer", "name", "eth0", "netns", ns.name()])?;
            node.ip(&["link", "set", &host_veth, "master", "br0", "up"])?;
            let host = u8::try_from(i + 2).unwrap_or(u8::MAX);
            let v4 = Ipv4Addr::new(net4[0], net4[1], net4[2], host);
            let v6: Ipv6Addr =
                format!("{net6}{host:x}").parse().map_err(|_| TestbedError::Integrity("pod v6 address".into()))?;
            ns.ip(&["addr", "add", &format!("{v4}/24"), "dev", "eth0"])?;
            ns.ip(&["addr", "add", &format!("{v6}/64"), "dev", "eth0", "nodad"])?;
            ns.ip(&["link", "set", "eth0", "up"])?;
            ns.ip(&["route", "add", "default", "via", &format!("{}.1", dotted(net4))])?;
            ns.ip(&["-6", "route", "add", "default", "via", &format!("{net6}1")])?;
            pods.push(Pod { ns, v4, v6, host_veth });
        }
        Ok(Self { pods, node })
    }

    /// Bytes that crossed the node side of pod `i`'s veth, both directions.
    pub fn veth_bytes(&self, i: usize) -> Result<u64> {
        let v = &self.pods[i].host_veth;
        Ok(self.node.link_counter(v, "rx_bytes")? + self.node.link_counter(v, "tx_bytes")?)
    }

    /// Bytes through the bridge device (frames the node routes to or from pods).
    pub fn bridge_bytes(&self) -> Result<u64> {
        Ok(self.node.link_counter("br0", "rx_bytes")? + self.node.link_counter("br0", "tx_bytes")?)
    }
}

/// Two nodes, each with a bridge and pods, joined by a vxlan overlay
/// (`vxlan0`, like flannel.1) over a veth underlay (`ul0`). Node A's pods are
/// 198.18.1.0/24 and 2001:db8:1::/64, node B's 198.18.2.0/24 and 2001:db8:2::/64;
/// the overlay link is 198.18.255.0/24 and 2001:db8:ff::/64 (.1/::1 on A).
#[derive(Debug)]
pub struct TwoNodes {
    pub a: NodeWithPods,
    pub b: NodeWithPods,
}

impl TwoNodes {
    pub fn new(pods_per_node: usize) -> Result<Self> {
        let a = NodeWithPods::with_subnet(pods_per_node, [198, 18, 1], "2001:db8:1::")?;
        let b = NodeWithPods::with_subnet(pods_per_node, [198, 18, 2], "2001:db8:2::")?;
        a.node.ip(&["link", "add", "ul0", "type", "veth", "peer", "name", "ul0", "netns", b.node.name()])?;
        let nodes =
            [(&a, "1", "2", "2001:db8:2::/64", "198.18.2.0/24"), (&b, "2", "1", "2001:db8:1::/64", "198.18.1.0/24")];
        for (n, me, peer, other6, other4) in nodes {
            let ns = &n.node;
            ns.ip(&["addr", "add", &format!("198.51.100.{me}/24"), "dev", "ul0"])?;
            ns.ip(&["link", "set", "ul0", "up"])?;
            ns.ip(&[
                "link",
                "add",
                "vxlan0",
                "type",
                "vxlan",
                "id",
                "42",
                "local",
                &format!("198.51.100.{me}"),
                "remote",
                &format!("198.51.100.{peer}"),
                "dstport",
                "4789",
                "dev",
                "ul0",
            ])?;
            ns.ip(&["addr", "add", &format!("198.18.255.{me}/24"), "dev", "vxlan0"])?;
            ns.ip(&["addr", "add", &format!("2001:db8:ff::{me}/64"), "dev", "vxlan0", "nodad"])?;
            ns.ip(&["link", "set", "vxlan0", "up"])?;
            ns.ip(&["route", "add", other4, "via", &format!("198.18.255.{peer}")])?;
            ns.ip(&["-6", "route", "add", other6, "via", &format!("2001:db8:ff::{peer}")])?;
            ns.exec(&["sysctl", "-qw", "net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"])?;
        }
        Ok(Self { a, b })
    }
}

/// How pod-to-pod traffic leaves the sending node in [`TwoNodes::install_fast_path`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverlayEgress {
    /// `bpf_redirect` to vxlan0 with the MACs rewritten for the peer's vxlan0.
    Redirect,
    /// `bpf_redirect_neigh` to vxlan0 via the peer's overlay address.
    RedirectNeigh,
}

/// An interface of a namespace, looked up over netlink.
pub fn link_in(ns: &NetNs, name: &str) -> Result<meshwarp_core::netlink::Link> {
    let iface = meshwarp_core::tc::IfaceRef::Name(name.to_string());
    meshwarp_core::netlink::in_netns(Some(&ns.path()), async |h| meshwarp_core::netlink::link(&h, &iface).await)
        .map_err(|e| TestbedError::Integrity(format!("{name} in {}: {e}", ns.name())))
}

impl TwoNodes {
    /// Attaches `tc_a`/`tc_b` (the nodes' tc data paths) to pod 0's veth and
    /// vxlan0 ingress and installs the routes that take pod A0 <-> pod B0
    /// traffic around both bridges: pod veth ingress -> vxlan egress, and
    /// vxlan ingress -> `bpf_redirect_peer` straight into the pod.
    pub fn install_fast_path(
        &self,
        tc_a: &meshwarp_core::tc::TcDataplane,
        tc_b: &meshwarp_core::tc::TcDataplane,
        v6: bool,
        egress: OverlayEgress,
    ) -> Result<()> {
        use meshwarp_core::tc::{Direction, IfaceRef, InterfaceRoute, MacRewrite, Prefix, RouteAction};
        let tc_err = |e: meshwarp_core::tc::TcError| TestbedError::Integrity(e.to_string());
        let mac = |l: &meshwarp_core::netlink::Link| l.mac.unwrap_or_default();
        let (subnet_len, host_len) = if v6 { (64, 128) } else { (24, 32) };
        let sides = [(&self.a, tc_a, &self.b, "2"), (&self.b, tc_b, &self.a, "1")];
        for (me, tc, peer, peer_id) in sides {
            for iface in ["vpod0", "vxlan0"] {
                tc.attach(&IfaceRef::Name(iface.into()), Direction::Ingress).map_err(tc_err)?;
            }
            let (my_vx, peer_vx) = (link_in(&me.node, "vxlan0")?, link_in(&peer.node, "vxlan0")?);
            let (bridge, pod) = (link_in(&me.node, "br0")?, link_in(&me.pods[0].ns, "eth0")?);
            let next_hop: IpAddr = if v6 { format!("2001:db8:ff::{peer_id}") } else { format!("198.18.255.{peer_id}") }
                .parse()
                .map_err(|_| TestbedError::Integrity("next hop".into()))?;
            let vxlan = IfaceRef::Name("vxlan0".into());
            let (action, rewrite) = match egress {
                OverlayEgress::Redirect => {
                    (RouteAction::Redirect(vxlan), Some(MacRewrite { src: mac(&my_vx), dst: mac(&peer_vx) }))
                }
                OverlayEgress::RedirectNeigh => {
                    (RouteAction::RedirectNeigh { to: vxlan, next_hop: Some(next_hop) }, None)
                }
            };
            let prefix =
                |ip: IpAddr, len| Prefix::new("dst", ip, len).map_err(|e| TestbedError::Integrity(e.to_string()));
            let out = InterfaceRoute {
                attach: IfaceRef::Name("vpod0".into()),
                direction: Direction::Ingress,
                dst: prefix(peer.pods[0].addr(v6), subnet_len)?,
                src: None,
                action,
                rewrite,
            };
            let into_pod = InterfaceRoute {
                attach: IfaceRef::Name("vxlan0".into()),
                direction: Direction::Ingress,
                dst: prefix(me.pods[0].addr(v6), host_len)?,
                src: None,
                action: RouteAction::RedirectPeer(IfaceRef::Name("vpod0".into())),
                rewrite: Some(MacRewrite { src: mac(&bridge), dst: mac(&pod) }),
            };
            tc.insert_route(&out, "testbed").map_err(tc_err)?;
            tc.insert_route(&into_pod, "testbed").map_err(tc_err)?;
        }
        Ok(())
    }

    /// Bytes through both nodes' bridges.
    pub fn bridge_bytes(&self) -> Result<u64> {
        Ok(self.a.bridge_bytes()? + self.b.bridge_bytes()?)
    }
}

fn dotted(a: [u8; 3]) -> String {
    format!("{}.{}.{}", a[0], a[1], a[2])
}

/// Captures TCP to `dst:port` in `ns` to a local listener on `to_port` with
/// iptables nat REDIRECT in `chain`.
fn redirect(ns: &NetNs, chain: &str, dst: IpAddr, port: u16, to_port: u16) -> Result<()> {
    let tool = if dst.is_ipv6() { "ip6tables" } else { "iptables" };
    let (dst, port, to) = (dst.to_string(), port.to_string(), to_port.to_string());
    let rule = ["-p", "tcp", "-d", &dst, "--dport", &port, "-j", "REDIRECT", "--to-ports", &to];
    let mut cmd = vec![tool, "-w", "-t", "nat", "-A", chain];
    cmd.extend_from_slice(&rule);
    ns.exec(&cmd)?;
    Ok(())
}

/// Outbound capture, as Istio's 15001: connections made inside `ns` to
/// `service:port` go to a local listener on `to_port` (nat OUTPUT).
pub fn redirect_output(ns: &NetNs, service: IpAddr, port: u16, to_port: u16) -> Result<()> {
    redirect(ns, "OUTPUT", service, port, to_port)
}

/// Inbound capture, as Istio's 15006: connections arriving in `ns` for
/// `pod:port` go to a local listener on `to_port` (nat PREROUTING).
pub fn redirect_prerouting(ns: &NetNs, pod: IpAddr, port: u16, to_port: u16) -> Result<()> {
    redirect(ns, "PREROUTING", pod, port, to_port)
}

// ---------------------------------------------------------------------------
// Traffic

/// A deterministic byte stream: position `i` of stream `seed` is always the
/// same byte, so a reader detects loss, duplication and reordering exactly.
#[derive(Debug, Clone)]
pub struct Pattern {
    state: u64,
}

impl Pattern {
    pub fn new(seed: u64) -> Self {
        Self { state: seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1 }
    }

    fn next_u64(&mut self) -> u64 {
        // xorshift64*
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        self.state.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

/// Chunk sizes for writes and reads: varied and deterministic per seed, so
/// partial reads and writes of every shape occur.
fn chunk_len(rng: &mut Pattern, max: usize) -> usize {
    let mut b = [0u8; 8];
    rng.fill(&mut b);
    let r = u64::from_le_bytes(b) as usize;
    match r % 4 {
        0 => 1 + r % 7,
        1 => 1 + r % 1500,
        2 => 1 + r % 65536,
        _ => max,
    }
    .min(max)
    .max(1)
}

/// Connects `s` without blocking (the socket is non-blocking before the
/// handshake completes, as an event-driven client's is) and waits for the
/// handshake; returns the connected, non-blocking stream.
pub fn connect_nonblocking(s: Socket, addr: SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
    s.set_nonblocking(true)?;
    match s.connect(&addr.into()) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {
            wait_ready(s.as_raw_fd(), libc::POLLOUT, Some(Instant::now() + timeout))?;
            if let Some(e) = s.take_error()? {
                return Err(e);
            }
        }
        Err(e) => return Err(e),
    }
    Ok(TcpStream::from(s))
}

/// Waits until `fd` is ready for `events` (POLLIN/POLLOUT), or the deadline.
pub fn wait_ready(fd: RawFd, events: libc::c_short, deadline: Option<Instant>) -> io::Result<()> {
    loop {
        let ms = match deadline {
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(io::Error::new(io::ErrorKind::TimedOut, "timed out waiting for the socket"));
                }
                i32::try_from(left.as_millis()).unwrap_or(i32::MAX).max(1)
            }
            None => -1,
        };
        let mut p = libc::pollfd { fd, events, revents: 0 };
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut p, 1, ms) };
        if n > 0 {
            return Ok(());
        }
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

fn is_nonblocking(fd: RawFd) -> bool {
    // SAFETY: F_GETFL on a valid fd.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    fl >= 0 && fl & libc::O_NONBLOCK != 0
}

/// One read of what is there, waiting (poll) until the socket is readable.
/// On a non-blocking socket EAGAIN means "wait"; on a blocking one it is an
/// error, returned as such: an application would not expect it either. The
/// read comes first and the mode is asked only after an EAGAIN, so that a
/// blocking round trip costs its two system calls and nothing more (the
/// request/response benches time exactly that).
pub fn read_ready<S: Read + AsFd>(s: &mut S, buf: &mut [u8], timeout: Option<Duration>) -> io::Result<usize> {
    let deadline = timeout.map(|t| Instant::now() + t);
    let fd = s.as_fd().as_raw_fd();
    let mut nonblocking = None;
    loop {
        match s.read(buf) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if !*nonblocking.get_or_insert_with(|| is_nonblocking(fd)) {
                    return Err(e);
                }
                wait_ready(fd, libc::POLLIN, deadline)?;
            }
            other => return other,
        }
    }
}

/// `read_exact` over [`read_ready`].
pub fn read_exact_ready<S: Read + AsFd>(s: &mut S, mut buf: &mut [u8], timeout: Option<Duration>) -> io::Result<()> {
    while !buf.is_empty() {
        let n = read_ready(s, buf, timeout)?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        buf = &mut buf[n..];
    }
    Ok(())
}

/// One write of as much as the socket takes, waiting until it is writable.
pub fn write_ready<S: Write + AsFd>(s: &mut S, data: &[u8], timeout: Option<Duration>) -> io::Result<usize> {
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        match s.write(data) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                wait_ready(s.as_fd().as_raw_fd(), libc::POLLOUT, deadline)?;
            }
            other => return other,
        }
    }
}

/// `write_all` over [`write_ready`].
pub fn write_all_ready<S: Write + AsFd>(s: &mut S, mut data: &[u8], timeout: Option<Duration>) -> io::Result<()> {
    while !data.is_empty() {
        let n = write_ready(s, data, timeout)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "peer stopped reading"));
        }
        data = &data[n..];
    }
    Ok(())
}

/// Writes `len` bytes of stream `seed` in varied chunk sizes, then half-closes.
pub fn send_pattern(mut s: &TcpStream, seed: u64, len: usize) -> io::Result<u64> {
    let timeout = s.write_timeout()?;
    // Bytes are generated in 8-byte words; keep chunk boundaries word-aligned
    // relative to the stream so the generator state matches the reader's.
    let mut gen = Pattern::new(seed);
    let mut sizes = Pattern::new(seed ^ 0x5151);
    let mut buf = vec![0u8; 256 * 1024];
    let mut pending: Vec<u8> = Vec::new();
    let mut sent = 0usize;
    let mut hash = Fnv::default();
    while sent < len {
        if pending.is_empty() {
            let n = (len - sent).min(buf.len());
            gen.fill(&mut buf[..n.div_ceil(8) * 8]);
            pending.extend_from_slice(&buf[..n]);
        }
        let want = chunk_len(&mut sizes, pending.len());
        let n = write_ready(&mut s, &pending[..want], timeout)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "peer stopped reading"));
        }
        hash.update(&pending[..n]);
        pending.drain(..n);
        sent += n;
    }
    s.flush()?;
    s.shutdown(Shutdown::Write)?;
    Ok(hash.0)
}

/// Reads stream `seed` until EOF in varied chunk sizes; checks every byte and
/// that exactly `len` arrived. Returns the FNV-1a hash of what was read.
pub fn recv_pattern(mut s: &TcpStream, seed: u64, len: usize) -> std::result::Result<u64, TestbedError> {
    let mut gen = Pattern::new(seed);
    let mut sizes = Pattern::new(seed ^ 0xA3A3);
    let mut expect: Vec<u8> = Vec::new();
    let mut buf = vec![0u8; 256 * 1024];
    let mut got = 0usize;
    let mut hash = Fnv::default();
    let timeout = s.read_timeout().map_err(io_err("read timeout"))?;
    loop {
        let want = chunk_len(&mut sizes, buf.len());
        let n = read_ready(&mut s, &mut buf[..want], timeout)
            .map_err(io_err(format!("reading stream {seed} at byte {got}")))?;
        if n == 0 {
            break;
        }
        if got + n > len {
            return Err(TestbedError::Integrity(format!("stream {seed}: {} bytes, more than the {len} sent", got + n)));
        }
        while expect.len() < n {
            let mut w = [0u8; 8];
            gen.fill(&mut w);
            expect.extend_from_slice(&w);
        }
        if buf[..n] != expect[..n] {
            let at = buf[..n].iter().zip(&expect[..n]).position(|(a, b)| a != b).unwrap_or(0);
            return Err(TestbedError::Integrity(format!("stream {seed}: wrong byte at offset {}", got + at)));
        }
        hash.update(&buf[..n]);
        expect.drain(..n);
        got += n;
    }
    if got != len {
        return Err(TestbedError::Integrity(format!("stream {seed}: {got} of {len} bytes arrived")));
    }
    Ok(hash.0)
}

/// FNV-1a, to report a checksum of each stream.
#[derive(Debug)]
pub struct Fnv(pub u64);

impl Default for Fnv {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    pub fn update(&mut self, data: &[u8]) {
        for b in data {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
        }
    }
}

/// Sends `len` bytes each way over one connection at the same time (seeds
/// `seed` client->server and `seed+1` back), checking both, within `timeout`.
/// Its four threads share the CPU the caller runs on: the adaptive policy
/// sends a large write around a reader copying out on another CPU
/// (reader_concurrent, a choice of timing), and the callers count what was
/// redirected. Tests of that choice place their threads themselves.
pub fn exchange(client: TcpStream, server: TcpStream, seed: u64, len: usize, timeout: Duration) -> Result<()> {
    for s in [&client, &server] {
        s.set_read_timeout(Some(timeout)).map_err(io_err("set timeout"))?;
        s.set_write_timeout(Some(timeout)).map_err(io_err("set timeout"))?;
    }
    let cpu =
        nix::sched::sched_getcpu().map_err(|e| TestbedError::Io { what: "sched_getcpu".into(), source: e.into() })?;
    let (c, s) = (Arc::new(client), Arc::new(server));
    thread::scope(|scope| {
        let c1 = Arc::clone(&c);
        let s1 = Arc::clone(&s);
        let pin_io = move || pin_thread(cpu).map_err(|e| io::Error::other(e.to_string()));
        let tx_c = scope.spawn(move || pin_io().and_then(|()| send_pattern(&c1, seed, len)));
        let tx_s = scope.spawn(move || pin_io().and_then(|()| send_pattern(&s1, seed + 1, len)));
        let rx_s = scope.spawn(|| pin_thread(cpu).and_then(|()| recv_pattern(&s, seed, len)));
        let rx_c = scope.spawn(|| pin_thread(cpu).and_then(|()| recv_pattern(&c, seed + 1, len)));
        let join = |h: thread::ScopedJoinHandle<'_, io::Result<u64>>, what: &str| {
            h.join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p))
                .map_err(io_err(format!("{what} of stream {seed}")))
        };
        let sent_c = join(tx_c, "client send")?;
        let sent_s = join(tx_s, "server send")?;
        let got_s = rx_s.join().unwrap_or_else(|p| std::panic::resume_unwind(p))?;
        let got_c = rx_c.join().unwrap_or_else(|p| std::panic::resume_unwind(p))?;
        if sent_c != got_s || sent_s != got_c {
            return Err(TestbedError::Integrity(format!("stream {seed}: checksums differ")));
        }
        Ok(())
    })
}

/// Accepts one connection within `timeout`; the socket is non-blocking.
pub fn accept_timeout(l: &TcpListener, timeout: Duration) -> Result<TcpStream> {
    l.set_nonblocking(true).map_err(io_err("nonblocking listener"))?;
    let deadline = Instant::now() + timeout;
    loop {
        match l.accept() {
            Ok((s, _)) => {
                // accept() does not pass O_NONBLOCK on; an event-driven server sets it.
                s.set_nonblocking(true).map_err(io_err("non-blocking socket"))?;
                return Ok(s);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(io_err("accept")(e)),
        }
    }
}

/// Echoes fixed-size messages back until EOF (the server side of a ping-pong).
pub fn spawn_echo(stream: TcpStream, msg_len: usize) -> thread::JoinHandle<io::Result<()>> {
    thread::spawn(move || {
        let mut s = stream;
        let mut buf = vec![0u8; msg_len];
        loop {
            match read_exact_ready(&mut s, &mut buf, None) {
                Ok(()) => write_all_ready(&mut s, &buf, None)?,
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    })
}

/// A server that echoes every byte back on each connection it accepts and
/// half-closes after EOF; stops when dropped.
#[derive(Debug)]
pub struct StreamEcho {
    stop: Arc<std::sync::atomic::AtomicBool>,
    handle: Option<thread::JoinHandle<()>>,
}

impl StreamEcho {
    pub fn start(listener: TcpListener) -> Result<Self> {
        listener.set_nonblocking(true).map_err(io_err("nonblocking echo listener"))?;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop2 = Arc::clone(&stop);
        let handle = thread::spawn(move || {
            while !stop2.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((s, _)) => {
                        let _ = s.set_nonblocking(true);
                        let _ = s.set_nodelay(true);
                        if let Ok(w) = s.try_clone() {
                            thread::spawn(move || pump(s, w));
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => thread::sleep(Duration::from_millis(1)),
                    Err(_) => return,
                }
            }
        });
        Ok(Self { stop, handle: Some(handle) })
    }
}

impl Drop for StreamEcho {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Sends `len` bytes of stream `seed` through an echo and checks what comes
/// back, byte for byte, both directions at once; half-closes at the end.
pub fn echo_integrity(s: TcpStream, seed: u64, len: usize, timeout: Duration) -> Result<()> {
    s.set_read_timeout(Some(timeout)).map_err(io_err("set timeout"))?;
    s.set_write_timeout(Some(timeout)).map_err(io_err("set timeout"))?;
    thread::scope(|scope| {
        let tx = scope.spawn(|| send_pattern(&s, seed, len));
        let got = recv_pattern(&s, seed, len)?;
        let sent = tx
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
            .map_err(io_err(format!("sending stream {seed}")))?;
        if sent != got {
            return Err(TestbedError::Integrity(format!("stream {seed}: echo checksum differs")));
        }
        Ok(())
    })
}

/// One round trip: write `msg`, read the echo back into `buf`.
pub fn round_trip<S: Read + Write + AsFd>(s: &mut S, msg: &[u8], buf: &mut [u8]) -> io::Result<()> {
    write_all_ready(s, msg, None)?;
    read_exact_ready(s, buf, None)
}

/// Echoes a connection back, reading it with splice(2) into a pipe (by
/// system call number: nothing in this program's ELF says it splices), until
/// EOF; then half-closes. An error ends it (a reset connection, a timeout).
pub fn splice_echo(mut s: TcpStream, timeout: Duration) -> Result<()> {
    let (r, w) = meshwarp_core::sys::pipe().map_err(io_err("pipe"))?;
    let mut pipe_r = std::fs::File::from(r);
    let mut buf = vec![0u8; 65536];
    let deadline = Instant::now() + timeout;
    loop {
        wait_ready(s.as_raw_fd(), libc::POLLIN, Some(deadline)).map_err(io_err("waiting to splice"))?;
        let n = match meshwarp_core::sys::splice(s.as_raw_fd(), w.as_raw_fd(), buf.len(), libc::SPLICE_F_NONBLOCK) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                // Readable, yet nothing to splice: bytes only recv() sees.
                if Instant::now() > deadline {
                    return Err(io_err("splice")(io::ErrorKind::TimedOut.into()));
                }
                thread::sleep(Duration::from_millis(1));
                continue;
            }
            Err(e) => return Err(io_err("splice")(e)),
        };
        pipe_r.read_exact(&mut buf[..n]).map_err(io_err("reading the pipe"))?;
        write_all_ready(&mut s, &buf[..n], Some(timeout)).map_err(io_err("echoing"))?;
    }
    s.shutdown(Shutdown::Write).map_err(io_err("half-close"))?;
    Ok(())
}

/// A proxy like a sidecar's capture listener: accepts connections, records
/// each one's original destination (SO_ORIGINAL_DST), connects to `upstream`
/// and copies both ways, passing half-closes through.
#[derive(Debug)]
pub struct CaptureProxy {
    pub addr: SocketAddr,
    pub original_dsts: Arc<Mutex<Vec<SocketAddr>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    handle: Option<thread::JoinHandle<()>>,
}

impl CaptureProxy {
    /// Listens on `listen` inside `ns`, forwarding to `upstream` (connected
    /// from `ns` too).
    pub fn start(ns: &NetNs, listen: SocketAddr, upstream: SocketAddr) -> Result<Self> {
        Self::start_from(ns, listen, upstream, None)
    }

    /// As [`CaptureProxy::start`], connecting upstream from `source` (e.g.
    /// Istio's inbound passthrough address 127.0.0.6).
    pub fn start_from(ns: &NetNs, listen: SocketAddr, upstream: SocketAddr, source: Option<IpAddr>) -> Result<Self> {
        Self::start_as(ns, listen, upstream, source, None)
    }

    /// As [`CaptureProxy::start_from`], its upstream sockets owned by `uid`
    /// (their fsuid), as a sidecar's are (Istio's 1337, Linkerd's 2102): an
    /// iptables `-m owner --uid-owner` rule then lets them out uncaptured.
    pub fn start_as(
        ns: &NetNs,
        listen: SocketAddr,
        upstream: SocketAddr,
        source: Option<IpAddr>,
        uid: Option<u32>,
    ) -> Result<Self> {
        let listener = ns.listen(listen)?;
        listener.set_nonblocking(true).map_err(io_err("nonblocking proxy listener"))?;
        let file = std::fs::File::open(ns.path()).map_err(io_err("opening netns"))?;
        let original_dsts = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (dsts, stop2) = (Arc::clone(&original_dsts), Arc::clone(&stop));
        let handle = thread::spawn(move || {
            // Upstream connections are made from the pod's namespace.
            if setns(file.as_fd(), CloneFlags::CLONE_NEWNET).is_err() {
                return;
            }
            if let Some(uid) = uid {
                // This thread's sockets get `uid` (setfsuid is per thread).
                // SAFETY: a plain system call on the calling thread.
                unsafe { libc::setfsuid(uid) };
            }
            while !stop2.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((down, _)) => {
                        let _ = down.set_nonblocking(true);
                        let _ = down.set_nodelay(true);
                        if let Some(d) = original_dst(&down) {
                            lock(&dsts).push(d);
                        }
                        let Ok(up) = connect_from(source, upstream) else {
                            continue;
                        };
                        pump_both(down, up);
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => thread::sleep(Duration::from_millis(1)),
                    Err(_) => return,
                }
            }
        });
        Ok(Self { addr: listen, original_dsts, stop, handle: Some(handle) })
    }
}

impl Drop for CaptureProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn connect_from(source: Option<IpAddr>, to: SocketAddr) -> io::Result<TcpStream> {
    let s = Socket::new(Domain::for_address(to), Type::STREAM, None)?;
    if let Some(src) = source {
        s.bind(&SocketAddr::new(src, 0).into())?;
    }
    s.set_tcp_nodelay(true)?;
    connect_nonblocking(s, to, Duration::from_secs(5))
}

fn pump_both(a: TcpStream, b: TcpStream) {
    let (Ok(a2), Ok(b2)) = (a.try_clone(), b.try_clone()) else {
        return;
    };
    thread::spawn(move || pump(a, b2));
    thread::spawn(move || pump(b, a2));
}

/// Copies until EOF, then half-closes the other side. An error ends it too
/// (its close then resets the connection if bytes are unread): said on
/// stderr, which a failing test shows.
fn pump(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut copied = 0u64;
    loop {
        match read_ready(&mut from, &mut buf, None) {
            Ok(0) => break,
            Err(e) => {
                eprintln!("pump {:?} -> {:?}: read failed after {copied} B: {e}", from.peer_addr(), to.peer_addr());
                break;
            }
            Ok(n) => {
                if let Err(e) = write_all_ready(&mut to, &buf[..n], None) {
                    eprintln!(
                        "pump {:?} -> {:?}: write failed after {copied} B: {e}",
                        from.peer_addr(),
                        to.peer_addr()
                    );
                    break;
                }
                copied += n as u64;
            }
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

/// The destination a connection had before iptables REDIRECT rewrote it.
pub fn original_dst(s: &TcpStream) -> Option<SocketAddr> {
    const SO_ORIGINAL_DST: libc::c_int = 80; // also IP6T_SO_ORIGINAL_DST
    let level = if s.local_addr().ok()?.is_ipv6() { libc::SOL_IPV6 } else { libc::SOL_IP };
    // SAFETY: the kernel writes at most `len` bytes of a sockaddr into storage.
    let ((), addr) = unsafe {
        socket2::SockAddr::try_init(|storage, len| {
            if libc::getsockopt(s.as_raw_fd(), level, SO_ORIGINAL_DST, storage.cast(), len) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        })
    }
    .ok()?;
    addr.as_socket()
}

/// Reads `len` bytes as nginx does (ngx_unix_recv with epoll and FIONREAD):
/// epoll edge-triggered; a read that fills its 1 KiB buffer asks FIONREAD
/// how much is left, reads that much, and, told 0, waits for the next
/// event. Fails if no event comes for `idle` while bytes are outstanding.
pub fn fionread_reader(s: &TcpStream, len: usize, idle: Duration) -> Result<Vec<u8>> {
    use std::os::fd::{FromRawFd, OwnedFd};
    const BUF: usize = 1024;
    let sys = |what: &str| io_err(what.to_string())(io::Error::last_os_error());
    s.set_nonblocking(true).map_err(io_err("nonblocking"))?;
    let fd = s.as_raw_fd();
    // SAFETY: plain epoll and socket calls on a valid descriptor; `ep` is
    // owned and closed on return.
    let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if ep < 0 {
        return Err(sys("epoll_create1"));
    }
    // SAFETY: a new descriptor nothing else owns.
    let ep = unsafe { OwnedFd::from_raw_fd(ep) };
    let mut ev = libc::epoll_event { events: (libc::EPOLLIN | libc::EPOLLRDHUP | libc::EPOLLET) as u32, u64: 0 };
    // SAFETY: see above.
    if unsafe { libc::epoll_ctl(ep.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) } != 0 {
        return Err(sys("epoll_ctl"));
    }
    let (mut out, mut buf) = (Vec::with_capacity(len), [0u8; BUF]);
    let (mut ready, mut available, mut told) = (false, -1i64, None);
    while out.len() < len {
        if !ready {
            // SAFETY: see above.
            let n = unsafe { libc::epoll_wait(ep.as_raw_fd(), &mut ev, 1, idle.as_millis() as i32) };
            if n <= 0 {
                return Err(TestbedError::Integrity(format!(
                    "no event for {idle:?} with {} of {len} bytes read (FIONREAD last said {told:?})",
                    out.len()
                )));
            }
            (ready, available) = (true, -1);
        }
        if available == 0 {
            ready = false;
            continue;
        }
        // SAFETY: see above; at most BUF bytes into buf.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), BUF, 0) };
        if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::WouldBlock {
            ready = false;
            continue;
        }
        if n <= 0 {
            return Err(TestbedError::Integrity(format!(
                "recv: {n} ({}) with {} of {len} bytes read",
                io::Error::last_os_error(),
                out.len()
            )));
        }
        let n = n as usize;
        out.extend_from_slice(&buf[..n]);
        if available >= 0 {
            available -= n as i64;
            if available < 0 {
                (available, ready) = (0, false);
            }
        } else if n == BUF {
            let mut nread: libc::c_int = 0;
            // SAFETY: FIONREAD writes one int.
            if unsafe { libc::ioctl(fd, libc::FIONREAD, &mut nread) } != 0 {
                return Err(sys("FIONREAD"));
            }
            told = Some(nread);
            available = i64::from(nread);
        }
        if n < BUF {
            (available, ready) = (0, false);
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------
// Holding a thread still

/// A thread of this process held still, as a debugger holds it: a forked
/// child attaches to it (`PTRACE_SEIZE`, `PTRACE_INTERRUPT`) and lets it go
/// when this is dropped, or when this process dies (the child then reads EOF).
/// Tests hold the data path's guard thread with it, so that what the kernel
/// does before user space answers an event can be made to happen first.
#[derive(Debug)]
pub struct HeldThread {
    child: libc::pid_t,
    release: Option<std::os::fd::OwnedFd>,
    pub tid: libc::pid_t,
}

impl HeldThread {
    /// Holds the one thread of this process named `comm`.
    pub fn named(comm: &str) -> Result<Self> {
        let tasks = std::fs::read_dir("/proc/self/task").map_err(io_err("listing /proc/self/task"))?;
        let tids: Vec<libc::pid_t> = tasks
            .flatten()
            .filter(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim_end() == comm))
            .filter_map(|t| t.file_name().to_str()?.parse().ok())
            .collect();
        match tids[..] {
            [tid] => Self::hold(tid),
            _ => Err(TestbedError::Integrity(format!("{} threads named {comm:?} in this process", tids.len()))),
        }
    }

    /// Holds thread `tid` of this process until drop.
    pub fn hold(tid: libc::pid_t) -> Result<Self> {
        use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};
        let pipe = || -> Result<(OwnedFd, OwnedFd)> {
            let mut fds = [0; 2];
            // SAFETY: pipe2 writes two descriptors into fds.
            if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
                return Err(io_err("pipe2")(io::Error::last_os_error()));
            }
            // SAFETY: both are new descriptors that nothing else owns.
            Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
        };
        let (ready_r, ready_w) = pipe()?;
        let (release_r, release_w) = pipe()?;
        // SAFETY: the child of this multi-threaded process makes only system
        // calls (no allocation, no lock) and leaves with _exit.
        let child = unsafe { libc::fork() };
        if child == 0 {
            let (ready, release) = (ready_w.into_raw_fd(), release_r.into_raw_fd());
            // SAFETY: system calls on descriptors and a tid; see above.
            unsafe {
                libc::close(release_w.into_raw_fd());
                libc::close(ready_r.into_raw_fd());
                // Nothing else of the parent's: another HeldThread's
                // release pipe kept open here would never read EOF.
                let (lo, hi) = (ready.min(release) as libc::c_uint, ready.max(release) as libc::c_uint);
                for (from, to) in [(3, lo.saturating_sub(1)), (lo + 1, hi - 1), (hi + 1, libc::c_uint::MAX)] {
                    if from <= to {
                        libc::syscall(libc::SYS_close_range, from, to, 0);
                    }
                }
                let mut status = 0;
                let held = libc::ptrace(libc::PTRACE_SEIZE, tid, 0, 0) == 0
                    && libc::ptrace(libc::PTRACE_INTERRUPT, tid, 0, 0) == 0
                    && libc::waitpid(tid, &mut status, libc::__WALL) == tid;
                let errno = if held { 0 } else { *libc::__errno_location() as u8 };
                libc::write(ready, [held as u8, errno].as_ptr().cast(), 2);
                let mut b = 0u8;
                while libc::read(release, (&mut b as *mut u8).cast(), 1) < 0 && *libc::__errno_location() == libc::EINTR
                {
                }
                libc::ptrace(libc::PTRACE_DETACH, tid, 0, 0);
                libc::_exit(0);
            }
        }
        if child < 0 {
            return Err(io_err("fork")(io::Error::last_os_error()));
        }
        drop((ready_w, release_r));
        let mut held = Self { child, release: Some(release_w), tid };
        let mut answer = [0u8; 2];
        std::fs::File::from(ready_r).read_exact(&mut answer).map_err(io_err("waiting for the holding child"))?;
        if answer[0] != 1 {
            held.release = None;
            return Err(io_err(format!("holding thread {tid} with ptrace"))(io::Error::from_raw_os_error(i32::from(
                answer[1],
            ))));
        }
        Ok(held)
    }
}

impl Drop for HeldThread {
    fn drop(&mut self) {
        // EOF on the child's pipe: it detaches, and the thread runs on.
        self.release = None;
        let mut status = 0;
        // SAFETY: waits for our own child.
        unsafe { libc::waitpid(self.child, &mut status, 0) };
    }
}

// ---------------------------------------------------------------------------
// Zero-copy sends (SO_ZEROCOPY, MSG_ZEROCOPY)

/// `SO_ZEROCOPY` (asm-generic/socket.h; x86 and arm64 alike).
pub const SO_ZEROCOPY: i32 = 60;
/// `MSG_ZEROCOPY` (linux/socket.h).
pub const MSG_ZEROCOPY: i32 = 0x400_0000;
/// `SO_EE_ORIGIN_ZEROCOPY` (linux/errqueue.h); the libc crate lacks it.
const SO_EE_ORIGIN_ZEROCOPY: u8 = 5;

/// `TCP_CLOSE` (include/net/tcp_states.h), as TCP_INFO's `tcpi_state` says it.
pub const TCP_CLOSE: u8 = 7;
/// `TCP_FASTOPEN_CONNECT` (linux/tcp.h); the libc crate lacks it.
pub const TCP_FASTOPEN_CONNECT: libc::c_int = 30;

/// The socket's TCP state (TCP_INFO's `tcpi_state`).
pub fn tcp_state(s: &impl AsRawFd) -> io::Result<u8> {
    // SAFETY: tcp_info is plain data; the kernel writes at most `len` bytes.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` is `len` writable bytes; the fd is the caller's, open.
    let rc =
        unsafe { libc::getsockopt(s.as_raw_fd(), libc::IPPROTO_TCP, libc::TCP_INFO, (&raw mut info).cast(), &mut len) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(info.tcpi_state)
}

/// `setsockopt(s, level, opt, &v, sizeof(int))`.
pub fn set_int_opt(s: &impl AsRawFd, level: libc::c_int, opt: libc::c_int, v: libc::c_int) -> io::Result<()> {
    // SAFETY: an int option from a live int.
    let rc = unsafe { libc::setsockopt(s.as_raw_fd(), level, opt, (&v as *const libc::c_int).cast(), 4) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Turns SO_ZEROCOPY on.
pub fn set_zerocopy(s: &impl AsRawFd) -> io::Result<()> {
    set_int_opt(s, libc::SOL_SOCKET, SO_ZEROCOPY, 1)
}

/// Bytes that show where in a stream they belong.
pub fn zerocopy_pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| ((i as u64).wrapping_mul(2_654_435_761) >> 13) as u8).collect()
}

/// Zero-copy completions on `s`'s error queue so far, appended to `into` as
/// [lo, hi] ranges of send numbers.
pub fn zerocopy_completions(s: &TcpStream, into: &mut Vec<(u32, u32)>) -> Result<()> {
    loop {
        let mut cbuf = [0u64; 32];
        // SAFETY: a zeroed msghdr with only a control buffer, as recvmsg(2) takes it.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&cbuf) as _;
        // SAFETY: msg points at live buffers for the whole call.
        let rc = unsafe { libc::recvmsg(s.as_raw_fd(), &mut msg, libc::MSG_ERRQUEUE | libc::MSG_DONTWAIT) };
        if rc < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::WouldBlock {
                return Ok(());
            }
            return Err(io_err("reading the error queue")(e));
        }
        // SAFETY: the kernel filled msg_control; CMSG_* stay within msg_controllen.
        let ee = unsafe {
            let cm = libc::CMSG_FIRSTHDR(&msg);
            if cm.is_null() {
                return Err(TestbedError::Integrity("an error-queue message without its control message".into()));
            }
            std::ptr::read_unaligned(libc::CMSG_DATA(cm).cast::<libc::sock_extended_err>())
        };
        if ee.ee_origin != SO_EE_ORIGIN_ZEROCOPY || ee.ee_errno != 0 {
            return Err(TestbedError::Integrity(format!("not a zero-copy completion: {ee:?}")));
        }
        into.push((ee.ee_info, ee.ee_data));
    }
}

/// What [`zerocopy_transfer`] sent: its sends that took bytes (each is owed
/// a completion while SO_ZEROCOPY is on), and the completions it had to
/// read meanwhile.
#[derive(Debug, Default)]
pub struct ZerocopySent {
    pub calls: u32,
    pub early: Vec<(u32, u32)>,
}

/// Sends `data` from `tx` with MSG_ZEROCOPY in writes of several sizes
/// (1 B to 1 MiB), partial sends resumed, while `rx` reads it all back and
/// compares. `data` is left untouched, as a zero-copy sender must until its
/// completions arrive.
pub fn zerocopy_transfer(tx: &TcpStream, rx: &TcpStream, data: &[u8], timeout: Duration) -> Result<ZerocopySent> {
    const SIZES: [usize; 8] = [1, 100, 4096, 32768, 65536, 200_000, 1 << 20, 77];
    let mut early = Vec::new();
    thread::scope(|scope| {
        let reader = scope.spawn(|| -> Result<()> {
            let mut got = vec![0u8; data.len()];
            read_exact_ready(&mut &*rx, &mut got, Some(timeout)).map_err(io_err("reading the zero-copy stream"))?;
            match got.iter().zip(data).position(|(a, b)| a != b) {
                Some(at) => Err(TestbedError::Integrity(format!("the zero-copy stream differs at byte {at}"))),
                None => Ok(()),
            }
        });
        let (mut off, mut calls) = (0usize, 0u32);
        let deadline = Instant::now() + timeout;
        while off < data.len() {
            if Instant::now() > deadline {
                return Err(TestbedError::Integrity(format!("zero-copy sends stuck at byte {off} for {timeout:?}")));
            }
            let n = SIZES[calls as usize % SIZES.len()].min(data.len() - off);
            // SAFETY: n bytes of a live buffer, which outlives the completions.
            let rc = unsafe { libc::send(tx.as_raw_fd(), data[off..].as_ptr().cast(), n, MSG_ZEROCOPY) };
            if rc > 0 {
                off += rc as usize;
                calls += 1;
                continue;
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                // Completions take option memory until they are read.
                Some(libc::ENOBUFS) => {
                    let before = early.len();
                    zerocopy_completions(tx, &mut early)?;
                    if early.len() == before {
                        thread::sleep(Duration::from_millis(1));
                    }
                }
                Some(libc::EAGAIN) => {
                    wait_ready(tx.as_raw_fd(), libc::POLLOUT, Some(Instant::now() + timeout))
                        .map_err(io_err("waiting to send"))?;
                }
                _ => return Err(io_err("send(MSG_ZEROCOPY)")(e)),
            }
        }
        reader.join().map_err(|_| TestbedError::Integrity("the zero-copy reader panicked".into()))??;
        Ok(ZerocopySent { calls, early })
    })
}

/// Waits (up to 10 s) for completions numbered exactly 0..sent.calls, each
/// once, as TCP numbers them (those read during the transfer included).
pub fn expect_zerocopy_completions(s: &TcpStream, sent: &ZerocopySent) -> Result<()> {
    let calls = sent.calls;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut ranges = sent.early.clone();
    loop {
        zerocopy_completions(s, &mut ranges)?;
        let covered: u64 = ranges.iter().map(|&(lo, hi)| u64::from(hi.wrapping_sub(lo)) + 1).sum();
        if covered >= u64::from(calls) || Instant::now() > deadline {
            break;
        }
        thread::sleep(Duration::from_millis(5));
    }
    // Late or extra ones.
    thread::sleep(Duration::from_millis(100));
    zerocopy_completions(s, &mut ranges)?;
    ranges.sort_unstable();
    let mut next = 0u32;
    for &(lo, hi) in &ranges {
        if lo != next || hi < lo {
            break;
        }
        next = hi + 1;
    }
    let whole: u64 = ranges.iter().map(|&(lo, hi)| u64::from(hi.wrapping_sub(lo)) + 1).sum();
    if next != calls || whole != u64::from(calls) {
        return Err(TestbedError::Integrity(format!("zero-copy completions {ranges:?} for {calls} sends")));
    }
    Ok(())
}

/// No completion, during the transfer or within 100 ms after it (sends
/// with MSG_ZEROCOPY where SO_ZEROCOPY is off are copies, owed nothing).
pub fn expect_no_zerocopy_completions(s: &TcpStream, sent: &ZerocopySent) -> Result<()> {
    expect_zerocopy_completions(s, &ZerocopySent { calls: 0, early: sent.early.clone() })
}

// ---------------------------------------------------------------------------
// Real programs

/// A program started inside a namespace, in a process group of its own; the
/// whole group (workers too) is killed on drop.
#[derive(Debug)]
pub struct Program {
    child: std::process::Child,
    pub what: String,
}

impl Program {
    /// Starts `args` in `ns` (`ip netns exec`), output discarded.
    pub fn spawn(ns: &NetNs, args: &[&str]) -> Result<Self> {
        Self::spawn_with(ns, args, std::process::Stdio::null(), std::process::Stdio::null())
    }

    /// As [`Program::spawn`] with the given stdin and stdout.
    pub fn spawn_with(
        ns: &NetNs,
        args: &[&str],
        stdin: impl Into<std::process::Stdio>,
        stdout: impl Into<std::process::Stdio>,
    ) -> Result<Self> {
        use std::os::unix::process::CommandExt;
        let what = args.join(" ");
        let child = Command::new("ip")
            .args(["netns", "exec", ns.name()])
            .args(args)
            .stdin(stdin)
            .stdout(stdout)
            .stderr(std::process::Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(io_err(format!("starting {what} (scripts/install-deps.sh installs it)")))?;
        Ok(Self { child, what })
    }

    pub fn child(&mut self) -> &mut std::process::Child {
        &mut self.child
    }

    /// Waits for the program to exit within `timeout`.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.child.try_wait().map_err(io_err(format!("waiting for {}", self.what)))? {
                return Ok(st);
            }
            if Instant::now() > deadline {
                return Err(TestbedError::Integrity(format!("{} did not exit within {timeout:?}", self.what)));
            }
            thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        let pgid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
        let _ = self.child.wait();
    }
}

/// Where `tool` is on PATH.
pub fn which(tool: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?.to_str()?.split(':').map(|d| Path::new(d).join(tool)).find(|p| p.is_file())
}

/// The newest installed PostgreSQL's programs (`/usr/lib/postgresql/<v>/bin`
/// with postgres, psql and pgbench), as Debian's packages lay them out.
pub fn postgres_bin() -> Option<PathBuf> {
    let mut bins: Vec<_> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|b| ["postgres", "psql", "pgbench"].iter().all(|p| b.join(p).exists()))
        .collect();
    bins.sort();
    bins.pop()
}

/// An HTTP echo on Node.js's http module (`node -e NODE_HTTP_ECHO HOST PORT`):
/// each POST answered with its body (libuv: epoll, non-blocking reads, writev).
pub const NODE_HTTP_ECHO: &str = r#"
const http = require('http');
const [host, port] = process.argv.slice(1);
http.createServer((req, res) => {
  const parts = [];
  req.on('data', c => parts.push(c));
  req.on('end', () => {
    const body = Buffer.concat(parts);
    res.writeHead(200, {'Content-Length': body.length});
    res.end(body);
  });
}).listen(+port, host);
"#;

/// redis-server in `ns` on `bind`:`port`, persisting nothing (no RDB saves,
/// no append-only file; its working directory `dir`).
pub fn redis_server(ns: &NetNs, bind: &str, port: u16, dir: &Path) -> Result<Program> {
    let (port, dir, rdb) = (port.to_string(), dir.display().to_string(), format!("dump{port}.rdb"));
    Program::spawn(
        ns,
        &[
            "redis-server",
            "--bind",
            bind,
            "--port",
            &port,
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
            "--dir",
            &dir,
            "--dbfilename",
            &rdb,
        ],
    )
}

/// Waits until something accepts TCP connections on `addr` in `ns`.
pub fn wait_listening(ns: &NetNs, addr: SocketAddr, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let up = ns.enter(|| TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok())?;
        if up {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(TestbedError::Integrity(format!("nothing listens on {addr} in {}", ns.name())));
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until a socket listens on `port` in `ns`, without connecting: a
/// connection would be accepted and read, and the reader guard judges a
/// program by its reads.
pub fn wait_port_listening(ns: &NetNs, port: u16, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    // /proc/net/tcp{,6}: "sl local_address rem_address st ...", the port in
    // hex after the colon, state 0A a listener.
    let listens = move || {
        ["/proc/thread-self/net/tcp", "/proc/thread-self/net/tcp6"].iter().any(|table| {
            std::fs::read_to_string(table).is_ok_and(|t| {
                t.lines().skip(1).any(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    f.len() > 3
                        && f[3] == "0A"
                        && f[1].rsplit(':').next().is_some_and(|p| u16::from_str_radix(p, 16) == Ok(port))
                })
            })
        })
    };
    while !ns.enter(listens)? {
        if Instant::now() > deadline {
            return Err(TestbedError::Integrity(format!("nothing listens on port {port} in {}", ns.name())));
        }
        thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// A private scratch directory (mode 0700, unpredictable name), removed on drop.
#[derive(Debug)]
pub struct ScratchDir(pub PathBuf);

impl ScratchDir {
    pub fn new(prefix: &str) -> Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        let mut seed = [0u8; 8];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut seed))
            .map_err(io_err("reading /dev/urandom"))?;
        let dir = std::env::temp_dir().join(format!("{prefix}{:016x}", u64::from_ne_bytes(seed)));
        std::fs::DirBuilder::new().mode(0o700).create(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
        Ok(Self(dir))
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// ---------------------------------------------------------------------------
// Kernel test harness

/// One kernel test at a time per process: each moves the process into its own
/// cgroup and attaches its own data path there.
static KERNEL_LOCK: Mutex<()> = Mutex::new(());

/// A cgroup v2 directory this process is moved into, and out of again on drop.
#[derive(Debug)]
pub struct TestCgroup {
    pub path: PathBuf,
    parent_procs: PathBuf,
}

impl TestCgroup {
    pub fn new() -> Result<Self> {
        let root = meshwarp_core::sys::cgroup2_root().map_err(|e| TestbedError::Integrity(e.to_string()))?;
        let path = root.join(unique_name("meshwarp-test-"));
        std::fs::create_dir(&path).map_err(io_err(format!("creating cgroup {}", path.display())))?;
        let me = std::process::id().to_string();
        std::fs::write(path.join("cgroup.procs"), &me).map_err(io_err("joining test cgroup"))?;
        Ok(Self { path, parent_procs: root.join("cgroup.procs") })
    }
}

impl TestCgroup {
    /// Runs `f` with this process back in the parent cgroup: sockets made
    /// there are outside the data path's cgroup (sockops never sees them).
    pub fn outside<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        self.away(&self.parent_procs, f)
    }

    /// Runs `f` with this process in the cgroup whose `cgroup.procs` is
    /// `procs`, then back here.
    fn away<T>(&self, procs: &Path, f: impl FnOnce() -> T) -> Result<T> {
        let me = std::process::id().to_string();
        std::fs::write(procs, &me).map_err(io_err(format!("leaving test cgroup for {}", procs.display())))?;
        let out = f();
        std::fs::write(self.path.join("cgroup.procs"), &me).map_err(io_err("rejoining test cgroup"))?;
        Ok(out)
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let _ = std::fs::write(&self.parent_procs, std::process::id().to_string());
        if let Err(e) = std::fs::remove_dir(&self.path) {
            tracing::warn!(cgroup = %self.path.display(), "removing test cgroup: {e}");
        }
    }
}

/// A cgroup v2 directory beside the test's, with no data path attached: the
/// same depth and controllers (a socket of the root cgroup is charged to no
/// memory cgroup, one of a pod's is), for traffic meshwarp does not watch.
/// The process visits it ([`BareCgroup::visit`]); removed on drop.
#[derive(Debug)]
pub struct BareCgroup {
    pub path: PathBuf,
}

impl BareCgroup {
    pub fn new() -> Result<Self> {
        let root = meshwarp_core::sys::cgroup2_root().map_err(|e| TestbedError::Integrity(e.to_string()))?;
        let path = root.join(unique_name("meshwarp-bare-"));
        std::fs::create_dir(&path).map_err(io_err(format!("creating cgroup {}", path.display())))?;
        Ok(Self { path })
    }

    /// Runs `f` with this process here, then back in `home`.
    pub fn visit<T>(&self, home: &TestCgroup, f: impl FnOnce() -> T) -> Result<T> {
        home.away(&self.path.join("cgroup.procs"), f)
    }
}

impl Drop for BareCgroup {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir(&self.path) {
            tracing::warn!(cgroup = %self.path.display(), "removing bare cgroup: {e}");
        }
    }
}

/// Crash tests run their own test again as a child process over the
/// parent's pins (and kill it at a step): in the child,
/// [`child_dataplane_config`] says which pins, and the test does the child's
/// part instead of the parent's.
const CHILD_PIN_ROOT: &str = "MW_CHILD_PIN_ROOT";
const CHILD_CGROUP: &str = "MW_CHILD_CGROUP";

/// In a child started by [`child_test`]: the parent's data path
/// configuration (this executable trusted as a reader, as in the parent).
pub fn child_dataplane_config() -> Option<DataplaneConfig> {
    let pin_root = std::env::var_os(CHILD_PIN_ROOT)?;
    Some(DataplaneConfig {
        pin_root: pin_root.into(),
        cgroup: std::env::var_os(CHILD_CGROUP).map(PathBuf::from),
        trusted_readers: std::env::current_exe().into_iter().collect(),
        ..DataplaneConfig::default()
    })
}

/// Test `name` of executable `exe` (this test binary, or a copy of it) run
/// alone as a child over `cfg`'s pins, its output discarded; the caller adds
/// what else the child needs (`MESHWARP_FAULT`, ...).
pub fn child_test(exe: &Path, name: &str, cfg: &DataplaneConfig) -> Command {
    let mut c = Command::new(exe);
    c.args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(CHILD_PIN_ROOT, &cfg.pin_root)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    if let Some(cg) = &cfg.cgroup {
        c.env(CHILD_CGROUP, cg);
    }
    c
}

/// A data path loaded for one test: its own pin root and cgroup, removed on drop.
#[derive(Debug)]
pub struct KernelTest {
    pub dp: Option<Dataplane>,
    pub cfg: DataplaneConfig,
    // Dropped last: release the process's cgroup after the data path is gone.
    pub cgroup: TestCgroup,
    _lock: MutexGuard<'static, ()>,
}

/// Whether a bench's data path runs its guard thread real-time (the
/// default); `MESHWARP_BENCH_GUARD_NORMAL=1` runs it at normal priority, for
/// an A/B of `DataplaneConfig::guard_realtime`.
pub fn bench_guard_realtime() -> bool {
    std::env::var_os("MESHWARP_BENCH_GUARD_NORMAL").is_none_or(|v| v.is_empty() || v == "0")
}

impl KernelTest {
    /// Loads a fresh data path with `max_sockets` SOCKMAP slots.
    ///
    /// If the kernel refuses BPF: fails under `CI=true`; elsewhere returns
    /// `None` after printing which feature is missing.
    pub fn start(max_sockets: u32) -> Option<Self> {
        Self::start_sized(max_sockets, 64)
    }

    /// As [`KernelTest::start`], with room for `max_rules` rules.
    pub fn start_sized(max_sockets: u32, max_rules: u32) -> Option<Self> {
        Self::start_with(max_sockets, max_rules, |_| {})
    }

    /// As [`KernelTest::start_sized`], with the configuration adjusted by `f`
    /// (e.g. the reader guard off).
    pub fn start_with(max_sockets: u32, max_rules: u32, f: impl FnOnce(&mut DataplaneConfig)) -> Option<Self> {
        let lock = KERNEL_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        sweep_leftovers();
        let cgroup = match TestCgroup::new() {
            Ok(c) => c,
            Err(e) => return missing_feature(&format!("cgroup v2 (for sockops): {e}")),
        };
        // The tests vouch for their own traffic code (event-driven, no
        // splice): their first connections need not wait for the guard to
        // observe how this program reads. Guard tests clear this.
        let mut cfg = DataplaneConfig {
            pin_root: PathBuf::from(format!("/sys/fs/bpf/{}", unique_name("meshwarp-test-"))),
            cgroup: Some(cgroup.path.clone()),
            max_rules,
            max_sockets,
            trusted_readers: std::env::current_exe().into_iter().collect(),
            ..DataplaneConfig::default()
        };
        f(&mut cfg);
        match Dataplane::open(&cfg) {
            Ok(dp) => Some(Self { dp: Some(dp), cfg, cgroup, _lock: lock }),
            Err(e) => missing_feature(&format!("BPF sockops/sk_msg/SOCKMAP: {e}")),
        }
    }

    pub fn dp(&self) -> &Dataplane {
        self.dp.as_ref().unwrap_or_else(|| unreachable!("data path is present until drop"))
    }

    /// The data path's map `name` (`meshwarp_bpf::names`), as its pins
    /// hold it: for tests that look at what the programs wrote.
    pub fn map<K: meshwarp_bpf::shared::Pod, V: meshwarp_bpf::shared::Pod>(
        &self,
        name: &'static str,
    ) -> std::result::Result<meshwarp_core::maps::TypedMap<K, V>, meshwarp_core::maps::MapError> {
        meshwarp_core::maps::TypedMap::pinned(&self.dp().pin_dir().join("maps"), name)
    }
}

impl Drop for KernelTest {
    fn drop(&mut self) {
        if let Some(dp) = self.dp.take() {
            if let Err(e) = dp.teardown() {
                tracing::warn!("teardown: {e}");
            }
        }
        let _ = uninstall(&self.cfg.pin_root);
    }
}

/// A tc data path loaded for one test in a node's namespace, with a pin root
/// of its own; unpinned (detached) on drop.
#[derive(Debug)]
pub struct TcTest {
    pub tc: Option<meshwarp_core::tc::TcDataplane>,
    pub pin_root: PathBuf,
}

impl TcTest {
    /// Loads it for `node`; a refusal follows [`missing_feature`].
    pub fn start(node: &NetNs) -> Option<Self> {
        sweep_leftovers();
        let pin_root = PathBuf::from(format!("/sys/fs/bpf/{}", unique_name("meshwarp-tctest-")));
        let cfg = meshwarp_core::tc::TcConfig { pin_root: pin_root.clone(), netns: Some(node.path()), max_routes: 64 };
        match meshwarp_core::tc::TcDataplane::open(&cfg) {
            Ok(tc) => Some(Self { tc: Some(tc), pin_root }),
            Err(e) => missing_feature(&format!("tc BPF: {e}")),
        }
    }

    pub fn tc(&self) -> &meshwarp_core::tc::TcDataplane {
        self.tc.as_ref().unwrap_or_else(|| unreachable!("tc data path is present until drop"))
    }
}

impl Drop for TcTest {
    fn drop(&mut self) {
        if let Some(tc) = self.tc.take() {
            let _ = tc.teardown();
        }
        let _ = uninstall(&self.pin_root);
    }
}

/// The policy of every kernel-facing test: a missing kernel feature fails the
/// test when `CI=true`; elsewhere it returns `None` after saying loudly which
/// feature is missing.
pub fn missing_feature<T>(what: &str) -> Option<T> {
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("CI=true and the kernel refused a required feature: {what}");
    }
    eprintln!("\n!!! SKIPPING kernel test: missing feature: {what} (set CI=true to make this a failure)\n");
    None
}

/// Pins the calling thread to `cpu`. The policy judges a large-write
/// stream by where its reader reads (`mw_dir.rd_cpu`): a test that needs a
/// reader on the writer's CPU, or on another one, places its threads.
pub fn pin_thread(cpu: usize) -> Result<()> {
    let mut set = nix::sched::CpuSet::new();
    set.set(cpu).map_err(|e| TestbedError::Io { what: format!("CPU {cpu}"), source: e.into() })?;
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
        .map_err(|e| TestbedError::Io { what: format!("pinning a thread to CPU {cpu}"), source: e.into() })
}

/// Pins the calling thread (and the threads it starts after) to the first
/// CPU it may use: a reader then never runs on another CPU than its
/// writer, so no large write goes around it (the adaptive policy's
/// reader_concurrent), and a test may count what was redirected exactly.
pub fn pin_to_one_cpu() -> Result<usize> {
    let cpu = usable_cpus().first().copied().unwrap_or(0);
    pin_thread(cpu)?;
    Ok(cpu)
}

/// The CPUs the calling thread may run on, by number (its affinity mask:
/// a cpuset may hold CPUs 2 and 3 only). Empty if the mask cannot be read.
pub fn usable_cpus() -> Vec<usize> {
    nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0))
        .map(|set| (0..nix::sched::CpuSet::count()).filter(|&c| set.is_set(c).unwrap_or(false)).collect())
        .unwrap_or_default()
}
