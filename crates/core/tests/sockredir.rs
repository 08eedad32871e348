//! Socket redirection on a real kernel: pods in namespaces on a bridge, the
//! real sockops/sk_msg programs attached to a per-test cgroup.
//!
//! Each test fails (never skips) when CI=true and BPF is refused.

#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use meshwarp_bpf::shared::{sockmap_index, Link, END_CLIENT, END_SERVER, LINK_SLOT};
use meshwarp_core::sys::socket_cookie_of;
use meshwarp_core::{
    CaptureRule, ConnFilter, ConnSource, Dataplane, DataplaneConfig, DataplaneOrigin, Endpoint, EndpointPair,
    FastPathMode, PathNow, RuleError, TcpReason,
};
use meshwarp_testbed::{
    accept_timeout, exchange, read_ready, redirect_output, tcp_state, write_all_ready, CaptureProxy, KernelTest,
    NodeWithPods, SERVICE_V4, SERVICE_V6, TCP_CLOSE, TCP_FASTOPEN_CONNECT,
};

const T: Duration = Duration::from_secs(60);
const SERVER_PORT: u16 = 8080;

macro_rules! kernel_test {
    ($max_sockets:expr) => {
        match KernelTest::start($max_sockets) {
            Some(k) => k,
            None => return Ok(()),
        }
    };
}

/// The link a socket is accelerated under, checked against the socket: the
/// SOCKMAP holds it at 2 * slot + end of its link's slot, and the link's
/// tuple (host-order ports) is what the socket sees.
fn accelerated(dp: &Dataplane, s: &TcpStream, end: u32) -> Result<(u64, Link)> {
    let cookie = socket_cookie_of(s)?;
    let cv = dp.socket_link(cookie)?.with_context(|| format!("socket {:?} not accelerated", s.local_addr()))?;
    ensure!(cv.end == end, "end {} instead of {end}", cv.end);
    let link = dp.link(&cv)?.context("link gone")?;
    ensure!(link.flags & LINK_SLOT != 0, "link {:#x} owns no slot", cv.link);
    let index = sockmap_index(link.slot, end);
    ensure!(dp.sockmap_lookup(index)? == Some(cookie), "SOCKMAP does not hold the socket at {index}");
    Ok((cv.link, link))
}

/// Connects pod0 to `listener` until both ends of a connection are
/// accelerated (within 5 s), and returns that connection. With `read`, the
/// server end reads a byte of each (so that its reads are seen).
fn connect_until_accelerated(
    k: &KernelTest,
    net: &NodeWithPods,
    listener: &std::net::TcpListener,
    read: bool,
) -> Result<(TcpStream, TcpStream)> {
    let mut last = None;
    wait_until(Duration::from_secs(5), || {
        let (mut c, mut s) = connect_pods(net, listener, false)?;
        if read {
            let mut b = [0u8; 1];
            c.write_all(b"x")?;
            s.read_exact(&mut b)?;
        }
        let both = accelerated(k.dp(), &c, END_CLIENT).is_ok() && accelerated(k.dp(), &s, END_SERVER).is_ok();
        last = Some((c, s));
        Ok(both)
    })?;
    last.context("a connection")
}

/// Polls `f` every 20 ms until it holds; an error after `t`.
fn wait_until(t: Duration, mut f: impl FnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + t;
    while !f()? {
        ensure!(Instant::now() < deadline, "condition not met within {t:?}");
        thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

fn endpoint_of(l: &Link, client: bool) -> SocketAddr {
    let (ip, port) = if client { (l.client_ip, l.client_port) } else { (l.server_ip, l.server_port) };
    SocketAddr::new(meshwarp_bpf::shared::ip_from_raw(ip, l.family).unwrap(), port as u16)
}

/// Mode `always`: these tests check the redirect itself (the adaptive policy
/// would move their small-write streams to TCP; tests/policy.rs covers it).
fn pair_for(net: &NodeWithPods, v6: bool) -> EndpointPair {
    EndpointPair::new(net.pods[0].addr(v6), Endpoint::new(net.pods[1].addr(v6), SERVER_PORT))
        .unwrap()
        .with_mode(FastPathMode::Always)
}

/// Two pods on a node, pod1 listening on SERVER_PORT.
fn two_pods(v6: bool) -> Result<(NodeWithPods, std::net::TcpListener)> {
    let net = NodeWithPods::new(2)?;
    let listener = net.pods[1].ns.listen(SocketAddr::new(net.pods[1].addr(v6), SERVER_PORT))?;
    Ok((net, listener))
}

/// Connects pod0 -> pod1:SERVER_PORT; returns (client, accepted server side).
fn connect_pods(net: &NodeWithPods, listener: &std::net::TcpListener, v6: bool) -> Result<(TcpStream, TcpStream)> {
    let addr = SocketAddr::new(net.pods[1].addr(v6), SERVER_PORT);
    let c = net.pods[0].ns.connect(addr)?;
    let s = accept_timeout(listener, T)?;
    Ok((c, s))
}

fn mirror_pairing(v6: bool) -> Result<()> {
    let k = kernel_test!(1024);
    let (net, listener) = two_pods(v6)?;
    let pair = pair_for(&net, v6);
    k.dp().insert(&pair, "test")?;

    let (c, s) = connect_pods(&net, &listener, v6)?;
    // Both ends under one link whose tuple (port byte order) is what each socket sees.
    let (cl, link) = accelerated(k.dp(), &c, END_CLIENT)?;
    let (sl, _) = accelerated(k.dp(), &s, END_SERVER)?;
    ensure!(cl == sl, "two links for one connection");
    ensure!(endpoint_of(&link, true) == c.local_addr()? && endpoint_of(&link, false) == s.local_addr()?, "{link:?}");

    let before = net.veth_bytes(0)? + net.veth_bytes(1)?;
    let len = 4 << 20;
    exchange(c, s, 1, len, T)?;
    let crossed = net.veth_bytes(0)? + net.veth_bytes(1)? - before;
    let st = k.dp().stats(&pair)?;
    ensure!(st.sockets == 2, "both ends inserted: {st:?}");
    ensure!(st.redirected_bytes == 2 * len as u64, "every byte redirected: {st:?}");
    // Only FINs/ACKs cross the veths, not the 8 MiB of payload.
    ensure!(crossed < 64 * 1024, "{crossed} bytes crossed the veths with the pair registered");
    Ok(())
}

#[test]
fn mirror_pairing_redirects_pod_to_pod_v4() -> Result<()> {
    mirror_pairing(false)
}

#[test]
fn mirror_pairing_redirects_pod_to_pod_v6() -> Result<()> {
    mirror_pairing(true)
}

#[test]
fn unregistered_connection_takes_the_normal_path() -> Result<()> {
    let k = kernel_test!(1024);
    let (net, listener) = two_pods(false)?;
    // A pair for another port covers nothing here.
    let other = EndpointPair::new(net.pods[0].addr(false), Endpoint::new(net.pods[1].addr(false), 9999))?;
    k.dp().insert(&other, "test")?;
    let g0 = k.dp().global_stats()?;
    let before = net.veth_bytes(0)?;
    let (c, s) = connect_pods(&net, &listener, false)?;
    let len = 1 << 20;
    exchange(c, s, 2, len, T)?;
    ensure!(net.veth_bytes(0)? - before >= 2 * len as u64, "payload must cross the veth");
    let g1 = k.dp().global_stats()?;
    ensure!(g1.not_covered >= g0.not_covered + 2, "both ends seen and left alone: {g0:?} -> {g1:?}");
    ensure!(k.dp().stats(&other)? == Default::default(), "nothing counted on an unrelated pair");
    Ok(())
}

fn capture_pairing(v6: bool) -> Result<()> {
    let k = kernel_test!(1024);
    let net = NodeWithPods::new(2)?;
    let app = &net.pods[0];
    let (service, loopback): (IpAddr, IpAddr) =
        if v6 { (SERVICE_V6.into(), "::1".parse()?) } else { (SERVICE_V4.into(), "127.0.0.1".parse()?) };
    let upstream = SocketAddr::new(net.pods[1].addr(v6), SERVER_PORT);
    let server = net.pods[1].ns.listen(upstream)?;
    // The sidecar: iptables captures app -> service:80 to the proxy on 15001.
    redirect_output(&app.ns, service, 80, 15001)?;
    let proxy = CaptureProxy::start(&app.ns, SocketAddr::new(loopback, 15001), upstream)?;
    let rule = CaptureRule::new(Some(app.addr(v6)), Endpoint::new(service, 80), Endpoint::new(loopback, 15001))?
        .with_mode(FastPathMode::Always);
    k.dp().insert(&rule, "test")?;

    let c = app.ns.connect(SocketAddr::new(service, 80))?;
    let s = accept_timeout(&server, T)?;
    // The origin's link names the listener the proxy accepted on as its server end.
    let (_, link) = accelerated(k.dp(), &c, END_CLIENT)?;
    ensure!(endpoint_of(&link, true) == c.local_addr()?, "{link:?}");
    ensure!(endpoint_of(&link, false) == SocketAddr::new(loopback, 15001), "{link:?}");
    let len = 2 << 20;
    exchange(c, s, 3, len, T)?;
    ensure!(
        proxy.original_dsts.lock().unwrap().contains(&SocketAddr::new(service, 80)),
        "iptables did not capture the connection"
    );
    let st = k.dp().stats(&rule)?;
    ensure!(st.sockets == 2, "app socket and the socket the proxy accepted: {st:?}");
    // app -> proxy and proxy -> app are both redirected.
    ensure!(st.redirected_bytes == 2 * len as u64, "{st:?}");
    Ok(())
}

#[test]
fn capture_pairing_app_to_sidecar_v4() -> Result<()> {
    capture_pairing(false)
}

#[test]
fn capture_pairing_app_to_sidecar_v6() -> Result<()> {
    capture_pairing(true)
}

#[test]
fn integrity_across_sizes_both_directions() -> Result<()> {
    let k = kernel_test!(1024);
    let (net, listener) = two_pods(false)?;
    let pair = pair_for(&net, false);
    k.dp().insert(&pair, "test")?;
    let sizes = [1usize, 2, 7, 100, 1448, 4096, 65_535, 65_536 + 7, 1 << 20, 3_000_001, 8 << 20];
    let mut total = 0u64;
    for (i, len) in sizes.into_iter().enumerate() {
        let (c, s) = connect_pods(&net, &listener, false)?;
        exchange(c, s, 100 + i as u64 * 2, len, T).with_context(|| format!("size {len}"))?;
        total += 2 * len as u64;
    }
    let st = k.dp().stats(&pair)?;
    // Every byte went one way or the other, and nearly all were redirected.
    ensure!(st.redirected_bytes <= total, "{st:?}");
    ensure!(st.redirected_bytes >= total * 9 / 10, "redirected {} of {total}: {st:?}", st.redirected_bytes);
    Ok(())
}

#[test]
fn slow_reader_with_large_writes() -> Result<()> {
    let k = kernel_test!(1024);
    let (net, listener) = two_pods(false)?;
    k.dp().insert(&pair_for(&net, false), "test")?;
    let (mut c, mut s) = connect_pods(&net, &listener, false)?;
    s.set_read_timeout(Some(T))?;
    c.set_write_timeout(Some(T))?;
    let len = 6 << 20;
    let writer = thread::spawn(move || -> std::io::Result<()> {
        let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        write_all_ready(&mut c, &data, Some(T))?;
        c.shutdown(std::net::Shutdown::Write)
    });
    let mut got = Vec::with_capacity(len);
    let mut buf = [0u8; 4096];
    loop {
        let n = read_ready(&mut s, &mut buf, Some(T))?;
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
        if got.len() < 256 * 1024 {
            thread::sleep(Duration::from_millis(2)); // the slow phase
        }
    }
    writer.join().unwrap()?;
    ensure!(got.len() == len, "{} of {len} bytes", got.len());
    ensure!(got.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8), "bytes corrupted");
    Ok(())
}

#[test]
fn two_hundred_concurrent_connections() -> Result<()> {
    let k = kernel_test!(4096);
    let (net, listener) = two_pods(false)?;
    let pair = pair_for(&net, false);
    k.dp().insert(&pair, "test")?;
    let mut conns = Vec::new();
    for _ in 0..200 {
        conns.push(connect_pods(&net, &listener, false)?);
    }
    let len = 64 * 1024;
    thread::scope(|scope| {
        let handles: Vec<_> = conns
            .into_iter()
            .enumerate()
            .map(|(i, (c, s))| scope.spawn(move || exchange(c, s, 1000 + 2 * i as u64, len, T)))
            .collect();
        for h in handles {
            h.join().unwrap()?;
        }
        Ok::<_, anyhow::Error>(())
    })
    .with_context(|| format!("pair counters: {:?}", k.dp().stats(&pair)))?;
    let st = k.dp().stats(&pair)?;
    ensure!(st.sockets == 400, "{st:?}");
    ensure!(st.redirected_bytes >= 200 * 2 * len as u64 * 9 / 10, "{st:?}");
    Ok(())
}

#[test]
fn removing_a_pair_returns_new_connections_to_tcp() -> Result<()> {
    let k = kernel_test!(1024);
    let (net, listener) = two_pods(false)?;
    let pair = pair_for(&net, false);
    k.dp().insert(&pair, "test")?;
    let (c1, s1) = connect_pods(&net, &listener, false)?;
    k.dp().remove(&pair)?;
    ensure!(matches!(k.dp().stats(&pair), Err(RuleError::NotFound(_))));
    // A connection accelerated before the removal keeps working.
    exchange(c1, s1, 7, 1 << 20, T)?;
    // New connections take the normal path.
    let before = net.veth_bytes(0)?;
    let (c2, s2) = connect_pods(&net, &listener, false)?;
    exchange(c2, s2, 9, 1 << 20, T)?;
    ensure!(net.veth_bytes(0)? - before >= 2 << 20, "new connection must cross the veth");
    // Registering again accelerates new connections again, with fresh counters.
    k.dp().insert(&pair, "test")?;
    let (c3, s3) = connect_pods(&net, &listener, false)?;
    exchange(c3, s3, 11, 1 << 20, T)?;
    let st = k.dp().stats(&pair)?;
    ensure!(st.sockets == 2 && st.redirected_bytes == 2 << 20, "{st:?}");
    Ok(())
}

#[test]
fn no_free_slot_falls_back_and_is_reported() -> Result<()> {
    let k = kernel_test!(2);
    let (net, listener) = two_pods(false)?;
    let pair = pair_for(&net, false);
    k.dp().insert(&pair, "test")?;
    let (c1, s1) = connect_pods(&net, &listener, false)?; // takes the one slot
    let (c2, s2) = connect_pods(&net, &listener, false)?; // finds none free
    let st = k.dp().stats(&pair)?;
    ensure!(st.sockets == 2, "{st:?}");
    ensure!(st.fallback_map_full == 1, "the second connection's client end reported: {st:?}");
    ensure!(k.dp().global_stats()?.no_slot == 1, "counted node-wide");
    ensure!(k.dp().global_stats()?.no_link >= 1, "its server end found no link");
    ensure!(k.dp().socket_link(socket_cookie_of(&c2)?)?.is_none(), "second connection not accelerated");
    exchange(c2, s2, 21, 1 << 20, T)?;
    exchange(c1, s1, 23, 1 << 20, T)?;
    Ok(())
}

#[test]
fn connections_before_registration_keep_working_unaccelerated() -> Result<()> {
    let k = kernel_test!(1024);
    let (net, listener) = two_pods(false)?;
    let (c, s) = connect_pods(&net, &listener, false)?;
    let pair = pair_for(&net, false);
    k.dp().insert(&pair, "test")?;
    exchange(c, s, 31, 1 << 20, T)?;
    let st = k.dp().stats(&pair)?;
    ensure!(st.sockets == 0 && st.redirected_msgs == 0, "{st:?}");
    Ok(())
}

#[test]
fn loopback_tuples_in_two_namespaces_do_not_collide() -> Result<()> {
    let k = kernel_test!(1024);
    let net = NodeWithPods::new(2)?;
    let lo: SocketAddr = "127.0.0.1:9000".parse()?;
    let pair = EndpointPair::new(lo.ip(), Endpoint::new(lo.ip(), lo.port()))?;
    k.dp().insert(&pair, "test")?;
    // Same port numbers on both sides in both pods: only the netns tells them apart.
    let mut conns = Vec::new();
    for pod in &net.pods {
        let l = pod.ns.listen(lo)?;
        let c = pod.ns.connect_from(Some("127.0.0.1:40123".parse()?), lo, false)?;
        let s = accept_timeout(&l, T)?;
        conns.push((c, s));
    }
    thread::scope(|scope| {
        let hs: Vec<_> = conns
            .into_iter()
            .enumerate()
            .map(|(i, (c, s))| scope.spawn(move || exchange(c, s, 41 + 10 * i as u64, 2 << 20, T)))
            .collect();
        for h in hs {
            h.join().unwrap()?;
        }
        Ok::<_, anyhow::Error>(())
    })?;
    let st = k.dp().stats(&pair)?;
    ensure!(st.sockets == 4 && st.redirected_bytes == 4 * (2 << 20), "{st:?}");
    Ok(())
}

#[test]
fn adopting_a_pinned_instance_loads_nothing_twice() -> Result<()> {
    let mut k = kernel_test!(1024);
    let pair = EndpointPair::new("198.18.0.2".parse()?, Endpoint::new("198.18.0.3".parse()?, 80))?;
    k.dp().insert(&pair, "test")?;
    let id = k.dp().sockops_prog_id()?;
    ensure!(k.dp().origin() == DataplaneOrigin::Loaded);
    let count = || libbpf_rs::query::ProgInfoIter::default().filter(|p| p.name == "mw_sockops").count();
    let before = count();
    let cfg = DataplaneConfig { ..k.cfg.clone() };
    // While this process holds the pins, nobody else allocates their slots.
    let e = meshwarp_core::Dataplane::open(&cfg).err().context("a second opener of held pins is refused")?;
    ensure!(e.to_string().contains("held by another meshwarp process"), "{e}");
    ensure!(k.dp().programs_build() == meshwarp_bpf::BUILD_ID, "this build loaded them");
    // The next process of the same build (as after a restart) adopts them
    // as they are (tests/upgrade.rs: another build replaces them).
    drop(k.dp.take());
    let again = meshwarp_core::Dataplane::open(&cfg)?;
    ensure!(again.programs_build() == meshwarp_bpf::BUILD_ID, "{}", again.programs_build());
    ensure!(again.upgrade() == &meshwarp_core::Upgrade::None);
    ensure!(again.origin() == DataplaneOrigin::Adopted);
    ensure!(again.sockops_prog_id()? == id, "same program");
    ensure!(count() == before, "no second copy loaded");
    ensure!(again.pairs() == vec![pair], "registry reconciled from the maps");
    // A successor that starts while its predecessor still holds the pins
    // (draining) waits for them, up to its pin_lock_wait.
    let predecessor = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(300));
        drop(again);
    });
    let node = meshwarp_core::node::Node::open(&meshwarp_core::node::NodeConfig {
        dataplane: cfg.clone(),
        netns: None,
        pin_lock_wait: std::time::Duration::from_secs(20),
    })?;
    predecessor.join().map_err(|_| anyhow::anyhow!("predecessor thread"))?;
    ensure!(node.dataplane.origin() == DataplaneOrigin::Adopted && node.dataplane.pairs().len() == 1);
    drop(node);
    Ok(())
}

#[test]
fn teardown_removes_every_pin() -> Result<()> {
    let mut k = kernel_test!(16);
    let dir = k.dp().pin_dir().to_path_buf();
    ensure!(dir.join("links/mw_sockops").exists());
    k.dp.take().unwrap().teardown()?;
    ensure!(!dir.exists(), "{} still exists", dir.display());
    ensure!(!k.cfg.pin_root.exists(), "pin root removed when empty");
    Ok(())
}

/// Room for one link: each connection in turn gets the slot the previous
/// one gave back when it closed (at once, or through the guard thread when
/// an end closed with its psock not yet empty).
#[test]
fn a_closed_links_slot_is_used_again() -> Result<()> {
    let k = kernel_test!(2);
    let (net, listener) = two_pods(false)?;
    let pair = pair_for(&net, false);
    k.dp().insert(&pair, "test")?;
    let mut redirected = 0;
    for round in 0..4u64 {
        // A connection that finds the slot still held stays on TCP, whole.
        let mut conn = None;
        wait_until(T, || {
            let (c, s) = connect_pods(&net, &listener, false)?;
            if k.dp().socket_link(socket_cookie_of(&c)?)?.is_some() {
                conn = Some((c, s));
                return Ok(true);
            }
            exchange(c, s, 41 + round, 4096, T)?;
            Ok(false)
        })
        .with_context(|| format!("round {round}: the slot never came back"))?;
        let (c, s) = conn.context("connection")?;
        let cookie = socket_cookie_of(&c)?;
        let (id, _) = accelerated(k.dp(), &c, END_CLIENT).with_context(|| format!("round {round}"))?;
        let cv = k.dp().socket_link(cookie)?.context("accelerated")?;
        exchange(c, s, 51 + round, 256 * 1024, T)?;
        redirected += 2 * 256 * 1024;
        wait_until(T, || Ok(k.dp().link(&cv)?.is_none() && k.dp().socket_link(cookie)?.is_none()))
            .with_context(|| format!("round {round}: link {id:#x} not removed"))?;
    }
    let st = k.dp().stats(&pair)?;
    ensure!(st.redirected_bytes == redirected, "every accelerated round redirected: {st:?}");
    Ok(())
}

/// A server end reset with redirected bytes unread keeps its SOCKMAP entry
/// (and the bytes) until its file is closed; its slot is only free after
/// that, and the next connection gets it.
#[test]
fn a_slot_left_with_unread_bytes_is_freed_once_the_socket_closes() -> Result<()> {
    let k = kernel_test!(2);
    let (net, listener) = two_pods(false)?;
    let pair = pair_for(&net, false);
    k.dp().insert(&pair, "test")?;
    let (c, mut s) = connect_pods(&net, &listener, false)?;
    accelerated(k.dp(), &c, END_CLIENT)?;
    let mut c = c;
    c.write_all(&[7u8; 1000])?;
    wait_until(T, || Ok(k.dp().stats(&pair)?.redirected_bytes == 1000))?;
    // Reset: the server end reaches CLOSE with 1000 redirected bytes unread.
    socket2::SockRef::from(&c).set_linger(Some(Duration::ZERO))?;
    drop(c);
    wait_until(T, || Ok(k.dp().global_stats()?.slots_stale == 1))?;
    let (c2, s2) = connect_pods(&net, &listener, false)?;
    ensure!(k.dp().socket_link(socket_cookie_of(&c2)?)?.is_none(), "no slot while the old one is held");
    exchange(c2, s2, 57, 64 * 1024, T)?;
    // The bytes are still there to read.
    let mut buf = [0u8; 1000];
    s.set_read_timeout(Some(T))?;
    let n = s.read(&mut buf)?;
    ensure!(n > 0 && buf[..n].iter().all(|&b| b == 7), "the unread bytes survived the reset ({n} read)");
    drop(s);
    // The guard thread frees the slot (every 500 ms).
    wait_until(T, || {
        let (c3, s3) = connect_pods(&net, &listener, false)?;
        Ok(k.dp().socket_link(socket_cookie_of(&c3)?)?.is_some() && exchange(c3, s3, 59, 4096, T).is_ok())
    })?;
    Ok(())
}

#[test]
fn four_tuple_reuse_after_close() -> Result<()> {
    let k = kernel_test!(1024);
    let (net, listener) = two_pods(false)?;
    let pair = pair_for(&net, false);
    k.dp().insert(&pair, "test")?;
    let server = SocketAddr::new(net.pods[1].addr(false), SERVER_PORT);
    let client: SocketAddr = SocketAddr::new(net.pods[0].addr(false), 40555);
    for round in 0..3u64 {
        let c = net.pods[0].ns.connect_from(Some(client), server, true)?;
        let s = accept_timeout(&listener, T)?;
        ensure!(c.local_addr()? == client, "same 4-tuple every round");
        // exchange() half-closes both ways; the server end closes first so
        // the TIME_WAIT is on its side and the client can reuse its port.
        exchange(c, s, 61 + 2 * round, 256 * 1024, T).with_context(|| format!("round {round}"))?;
    }
    let st = k.dp().stats(&pair)?;
    ensure!(st.sockets == 6, "{st:?}");
    ensure!(st.redirected_bytes == 3 * 2 * 256 * 1024, "every round redirected: {st:?}");
    Ok(())
}

#[test]
fn a_refused_load_leaves_nothing_pinned() -> Result<()> {
    let Some(k) = KernelTest::start(16) else { return Ok(()) };
    let pin_root = std::path::PathBuf::from(format!("/sys/fs/bpf/{}", meshwarp_testbed::unique_name("mw-refused-")));
    let cfg = DataplaneConfig {
        pin_root: pin_root.clone(),
        cgroup: Some(k.cgroup.path.clone()),
        max_rules: 16,
        // The kernel refuses a SOCKMAP this large when the object loads,
        // after the pin directories were made.
        max_sockets: u32::MAX,
        ..DataplaneConfig::default()
    };
    let e = meshwarp_core::Dataplane::open(&cfg).err().context("an impossible SOCKMAP is refused")?;
    ensure!(e.to_string().contains("loading the BPF programs"), "refused at load: {e}");
    ensure!(!pin_root.exists(), "{} left behind", pin_root.display());
    Ok(())
}

// ---------------------------------------------------------------------------
// TCP Fast Open

/// Whether the SYN of `s`'s connection carried data that the server
/// accepted (TCP_INFO's TCPI_OPT_SYN_DATA).
fn syn_data_accepted(s: &TcpStream) -> Result<bool> {
    use std::os::fd::AsRawFd;
    const TCPI_OPT_SYN_DATA: u8 = 32;
    let mut info = [0u8; 256];
    let mut len = info.len() as libc::socklen_t;
    // SAFETY: a valid fd and buffer of `len` bytes.
    let rc = unsafe {
        libc::getsockopt(s.as_raw_fd(), libc::IPPROTO_TCP, libc::TCP_INFO, info.as_mut_ptr().cast(), &mut len)
    };
    ensure!(rc == 0, "TCP_INFO: {}", std::io::Error::last_os_error());
    // struct tcp_info: state, ca_state, retransmits, probes, backoff, options.
    Ok(info[5] & TCPI_OPT_SYN_DATA != 0)
}

/// A Fast Open connect from pod0 (TCP_FASTOPEN_CONNECT): blocking, its
/// first write `first` (in the SYN once the kernel holds a cookie).
fn fast_open(net: &NodeWithPods, to: SocketAddr, first: &[u8]) -> Result<TcpStream> {
    let mut c = net.pods[0].ns.enter(|| -> std::io::Result<TcpStream> {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
        meshwarp_testbed::set_int_opt(&s, libc::IPPROTO_TCP, TCP_FASTOPEN_CONNECT, 1)?;
        s.set_write_timeout(Some(T))?;
        s.set_read_timeout(Some(T))?;
        s.connect(&to.into())?;
        Ok(TcpStream::from(s))
    })??;
    c.write_all(first)?;
    c.set_nodelay(true)?;
    Ok(c)
}

/// Two pods with TCP Fast Open on (`net.ipv4.tcp_fastopen=3`, the listener's
/// queue), the pair registered: the pods, the listener, the pair, the
/// server's address.
fn fast_open_pods(k: &KernelTest) -> Result<(NodeWithPods, std::net::TcpListener, EndpointPair, SocketAddr)> {
    fast_open_pods_in(k, FastPathMode::Always)
}

/// As [`fast_open_pods`], the pair in `mode`.
fn fast_open_pods_in(
    k: &KernelTest,
    mode: FastPathMode,
) -> Result<(NodeWithPods, std::net::TcpListener, EndpointPair, SocketAddr)> {
    let (net, listener) = two_pods(false)?;
    for p in &net.pods {
        p.ns.fast_open_on()?;
    }
    meshwarp_testbed::set_int_opt(&listener, libc::IPPROTO_TCP, libc::TCP_FASTOPEN, 16)?;
    let pair = pair_for(&net, false).with_mode(mode);
    k.dp().insert(&pair, "test")?;
    let to = SocketAddr::new(net.pods[1].addr(false), SERVER_PORT);
    Ok((net, listener, pair, to))
}

/// TCP Fast Open: the server end is made at the client's SYN, its data
/// queued, before the client end links at the SYN-ACK; it claims the link at
/// the last ACK of the handshake and joins the SOCKMAP by a relink. Bytes
/// the client writes while the server has not read the SYN's data come after
/// them, and then both directions are redirected, every byte checked.
#[test]
fn a_fast_open_connection_is_accelerated_in_order() -> Result<()> {
    let k = kernel_test!(1024);
    let (net, listener, pair, to) = fast_open_pods(&k)?;
    let mut first = vec![0u8; 1000];
    let mut later = vec![0u8; 64 << 10];
    meshwarp_testbed::Pattern::new(31).fill(&mut first);
    meshwarp_testbed::Pattern::new(32).fill(&mut later);
    // The first connection fetches the cookie (its SYN carries none).
    let c = fast_open(&net, to, &first)?;
    let mut s = accept_timeout(&listener, T)?;
    let mut got = vec![0u8; first.len()];
    meshwarp_testbed::read_exact_ready(&mut s, &mut got, Some(T))?;
    ensure!(got == first && !syn_data_accepted(&c)?, "the cookie's connection");
    drop((c, s));

    let mut c = fast_open(&net, to, &first)?;
    let mut s = accept_timeout(&listener, T)?;
    ensure!(syn_data_accepted(&c)?, "the SYN carried data: Fast Open");
    // Claimed at the last ACK, then in the SOCKMAP by a relink.
    wait_until(Duration::from_secs(5), || Ok(accelerated(k.dp(), &s, END_SERVER).is_ok()))
        .context("the server end joined the SOCKMAP")?;
    // More from the client while the SYN's data is unread: on TCP, behind it
    // (redirected, it would be read first).
    c.write_all(&later)?;
    thread::sleep(Duration::from_millis(100));
    let mut got = vec![0u8; first.len() + later.len()];
    meshwarp_testbed::read_exact_ready(&mut s, &mut got, Some(T))?;
    ensure!(got[..first.len()] == first[..], "the SYN's data first");
    ensure!(got[first.len()..] == later[..], "then what came after it, in order");
    let before = k.dp().stats(&pair)?;
    exchange(c, s, 33, 1 << 20, T)?;
    let after = k.dp().stats(&pair)?;
    ensure!(
        after.redirected_bytes >= before.redirected_bytes + 2 * (1 << 20),
        "both directions redirected after the relink: {before:?} -> {after:?}"
    );
    ensure!(after.relinks >= 1, "the server end joined by a relink: {after:?}");
    Ok(())
}

/// A Fast Open connection of a pair in mode never: both ends are listed as
/// kept on TCP by the mode under one connection id (the server end takes its
/// id at the handshake's last ACK, once the SYN's data counts), and every
/// byte arrives.
#[test]
fn a_fast_open_connection_in_mode_never_is_listed_whole() -> Result<()> {
    let k = kernel_test!(1024);
    let (net, listener, pair, to) = fast_open_pods(&k)?;
    k.dp().upsert(&pair.with_mode(FastPathMode::Never), "test")?;
    drop((fast_open(&net, to, b"cookie")?, accept_timeout(&listener, T)?));
    let first = vec![7u8; 1000];
    let c = fast_open(&net, to, &first)?;
    let mut s = accept_timeout(&listener, T)?;
    ensure!(syn_data_accepted(&c)?, "the SYN carried data");
    let mut got = vec![0u8; first.len()];
    meshwarp_testbed::read_exact_ready(&mut s, &mut got, Some(T))?;
    ensure!(got == first, "the SYN's data");
    let mut ids = Vec::new();
    for end in [&c, &s] {
        let listed =
            k.dp().connections(&ConnFilter { cookie: Some(socket_cookie_of(end)?), ..ConnFilter::default() })?;
        ensure!(listed.len() == 1, "{listed:#?}");
        let e = &listed[0];
        ensure!(!e.accelerated && e.tx_path == PathNow::Tcp(TcpReason::ModeNever), "{e:?}");
        ids.push(e.conn_id);
    }
    ensure!(ids[0] == ids[1] && ids[0] != 0, "one connection id for both ends: {ids:?}");
    exchange(c, s, 41, 256 << 10, T)?;
    Ok(())
}

/// The server ports the rules name (`mw_ports`): a handshake, connect() or
/// setsockopt to any other port is judged not covered by one lookup. A port
/// two rules name stays set until the last of them goes; a capture rule sets
/// its destination and its listener, and an update moves the listener's
/// bit; a reopened data path (a daemon's restart) writes the set again from
/// the rule maps.
#[test]
fn the_port_filter_follows_the_rules() -> Result<()> {
    use meshwarp_bpf::shared::Ports;
    let mut k = kernel_test!(1024);
    let (net, listener) = two_pods(false)?;
    let maps = k.dp().pin_dir().join("maps");
    let ports: meshwarp_core::maps::TypedMap<u32, Ports> =
        meshwarp_core::maps::TypedMap::pinned(&maps, meshwarp_bpf::names::MAP_PORTS)?;
    let set = || -> Result<Ports> { ports.get(&0)?.context("mw_ports holds its one element") };
    ensure!(set()? == Ports::of([]), "kept (bit 0) and empty: {:?}", set()?.bits[0]);

    let server = Endpoint::new(net.pods[1].addr(false), SERVER_PORT);
    let a = pair_for(&net, false);
    let b = EndpointPair::new("10.250.0.9".parse()?, server)?;
    k.dp().insert(&a, "test")?;
    k.dp().insert(&b, "test")?;
    ensure!(set()? == Ports::of([SERVER_PORT]), "one port, two rules");
    k.dp().remove(&b)?;
    ensure!(set()?.has(SERVER_PORT), "the other rule still names it");
    let (c, s) = connect_pods(&net, &listener, false)?;
    accelerated(k.dp(), &c, END_CLIENT)?;
    accelerated(k.dp(), &s, END_SERVER)?;
    exchange(c, s, 7, 64 << 10, T)?;
    k.dp().remove(&a)?;
    ensure!(set()? == Ports::of([]), "no rule names it any more");
    let (c, s) = connect_pods(&net, &listener, false)?;
    for (end, what) in [(&c, "client"), (&s, "server")] {
        ensure!(k.dp().socket_link(socket_cookie_of(end)?)?.is_none(), "the {what} end is not covered");
    }
    exchange(c, s, 9, 64 << 10, T)?;

    // The programs go by the set: a rule whose port is not in it covers
    // nothing; a set not kept (bit 0 clear) filters nothing.
    k.dp().insert(&a, "test")?;
    ports.put(&0, &Ports::of([]))?;
    let (c, _s) = connect_pods(&net, &listener, false)?;
    ensure!(k.dp().socket_link(socket_cookie_of(&c)?)?.is_none(), "its port filtered out: not covered");
    ports.put(&0, &Ports::default())?;
    let (c, s) = connect_pods(&net, &listener, false)?;
    accelerated(k.dp(), &c, END_CLIENT)?;
    accelerated(k.dp(), &s, END_SERVER)?;
    ports.put(&0, &Ports::of([SERVER_PORT]))?;
    k.dp().remove(&a)?;

    let (service, lo): (IpAddr, IpAddr) = (SERVICE_V4.into(), "127.0.0.1".parse()?);
    let capture = CaptureRule::new(None, Endpoint::new(service, 80), Endpoint::new(lo, 15001))?;
    k.dp().insert(&capture, "test")?;
    ensure!(set()? == Ports::of([80, 15001]), "the destination and the listener");
    let moved = CaptureRule::new(None, Endpoint::new(service, 80), Endpoint::new(lo, 15002))?;
    k.dp().upsert(&moved, "test")?;
    ensure!(set()? == Ports::of([80, 15002]), "the update moved the listener's bit");

    // Cleared behind the data path's back, then reopened: written again.
    ports.put(&0, &Ports::default())?;
    drop(k.dp.take());
    k.dp = Some(Dataplane::open(&k.cfg)?);
    ensure!(set()? == Ports::of([80, 15002]), "rewritten from the rule maps at open");
    k.dp().remove(&moved)?;
    ensure!(set()? == Ports::of([]), "nothing left");
    Ok(())
}

/// A Fast Open server end asks to join quietly (`mw_joins`), and the data
/// path's thread serves the request only once it waited there
/// (`park::JOIN_AFTER`): a connection that closes first (most Fast Open
/// connections are that short) takes its request back at its close, so it
/// costs no walk of the host's TCP sockets and no system call.
#[test]
fn a_fast_open_connection_closed_before_its_join_takes_the_request_back() -> Result<()> {
    let k = kernel_test!(1024);
    let (net, listener, _pair, to) = fast_open_pods(&k)?;
    let joins: meshwarp_core::maps::TypedMap<u64, meshwarp_bpf::shared::Join> =
        k.map(meshwarp_bpf::names::MAP_JOINS)?;
    // The first connection fetches the cookie (its SYN carries none).
    drop((fast_open(&net, to, b"cookie")?, accept_timeout(&listener, T)?));
    let (conns, mut asked) = (20, 0);
    for i in 0..conns {
        let mut c = fast_open(&net, to, b"request")?;
        let mut s = accept_timeout(&listener, T)?;
        ensure!(syn_data_accepted(&c)?, "connection {i}: the SYN carried data");
        let cookie = socket_cookie_of(&s)?;
        // Asked at the handshake's last ACK, before accept() returned; the
        // thread may have taken it since, if this test was slow.
        if joins.get(&cookie)?.is_some() {
            asked += 1;
        }
        // The client's FIN first, then the server's: the server end reaches
        // CLOSE at the client's last ACK, its file still open.
        let mut b = [0u8; 16];
        c.shutdown(std::net::Shutdown::Write)?;
        while s.read(&mut b)? > 0 {}
        s.shutdown(std::net::Shutdown::Write)?;
        while c.read(&mut b)? > 0 {}
        wait_until(T, || Ok(meshwarp_testbed::tcp_state(&s)? == meshwarp_testbed::TCP_CLOSE))
            .context("the server end closed")?;
        ensure!(joins.get(&cookie)?.is_none(), "connection {i}: its close did not take its join request back");
    }
    ensure!(asked * 4 >= conns * 3, "the server ends asked to join: {asked} of {conns}");
    Ok(())
}

/// Fast Open connections of an adaptive pair, each a request and its
/// answer: once the rule leaves new ones out as short, neither end of one
/// left out has a socket storage element (its server end's state, made at
/// the SYN before its client's handshake, is not made while the rule's
/// connections are short). A run whose last short connection closed
/// `MW_SHORT_FOR` (1 s) ago is over: the next connection is covered.
#[test]
fn a_fast_open_connection_left_out_as_short_has_no_element() -> Result<()> {
    use std::os::fd::AsRawFd;
    let k = kernel_test!(1024);
    let (net, listener, pair, to) = fast_open_pods_in(&k, FastPathMode::Adaptive)?;
    let state: meshwarp_core::maps::TypedMap<i32, meshwarp_bpf::shared::SockState> =
        k.map(meshwarp_bpf::names::MAP_SK_STATE)?;
    drop((fast_open(&net, to, b"cookie")?, accept_timeout(&listener, T)?));
    let one = || -> Result<(bool, Option<meshwarp_bpf::shared::SockState>)> {
        let mut c = fast_open(&net, to, b"request")?;
        let mut s = accept_timeout(&listener, T)?;
        ensure!(syn_data_accepted(&c)?, "the SYN carried data");
        let covered = k.dp().socket_link(socket_cookie_of(&c)?)?.is_some();
        let server_state = state.get(&s.as_raw_fd())?;
        ensure!(covered || state.get(&c.as_raw_fd())?.is_none(), "a client end left out has no element");
        let mut b = [0u8; 7];
        s.read_exact(&mut b)?;
        ensure!(&b == b"request", "the request: {b:?}");
        s.write_all(b"answer!")?;
        c.read_exact(&mut b)?;
        ensure!(&b == b"answer!", "the answer: {b:?}");
        Ok((covered, server_state))
    };
    let mut left_out = None;
    for _ in 0..60 {
        let (covered, server_state) = one()?;
        if !covered {
            left_out = Some(server_state);
            break;
        }
        thread::sleep(Duration::from_millis(5));
    }
    let server_state = left_out.with_context(|| format!("no connection left out: {:?}", k.dp().stats(&pair)))?;
    ensure!(server_state.is_none(), "its server end has no element: {server_state:?}");
    ensure!(k.dp().stats(&pair)?.fallback_short >= 1, "{:?}", k.dp().stats(&pair)?);
    thread::sleep(Duration::from_millis(1200));
    ensure!(one()?.0, "the run is over a second after its last short connection closed");
    Ok(())
}

/// A socket's owner (stamped at connect(); a covered server end's copied
/// from its listener's service at its handshake) and its end's state are
/// one socket storage element (mw_sk_state), the owner kept when the
/// handshake fills in the state of a covered end: both ends of a covered
/// connection are listed with their owner. The listener has no element.
#[test]
fn owner_and_state_are_one_element_per_socket() -> Result<()> {
    let k = kernel_test!(1024);
    let net = NodeWithPods::new(2)?;
    k.dp().insert(&pair_for(&net, false), "test")?;
    let listener = net.pods[1].ns.listen(SocketAddr::new(net.pods[1].addr(false), SERVER_PORT))?;
    let listed = |s: &dyn std::os::fd::AsRawFd| -> Result<Vec<meshwarp_core::Connection>> {
        let by_cookie = ConnFilter { cookie: Some(socket_cookie_of(&s.as_raw_fd())?), ..ConnFilter::default() };
        Ok(k.dp().connections(&by_cookie)?)
    };
    let (c, s) = connect_pods(&net, &listener, false)?;
    accelerated(k.dp(), &c, END_CLIENT)?;
    accelerated(k.dp(), &s, END_SERVER)?;
    for (sock, what) in [(&c, "client"), (&s, "server")] {
        let l = listed(sock)?;
        let [end] = &l[..] else { anyhow::bail!("the {what} end listed once: {l:?}") };
        ensure!(end.owner_pid == Some(std::process::id()), "the {what} end's owner kept: {end:?}");
    }
    exchange(c, s, 52, 1 << 20, T)?;
    let l = listed(&listener)?;
    ensure!(l.is_empty(), "the listener is not listed: {l:?}");
    // Nor has it an element, even of a port a rule names: every socket it
    // accepts would clone it (its program is kept by its service).
    use std::os::fd::AsRawFd;
    let state: meshwarp_core::maps::TypedMap<i32, meshwarp_bpf::shared::SockState> =
        k.map(meshwarp_bpf::names::MAP_SK_STATE)?;
    ensure!(state.get(&listener.as_raw_fd())?.is_none(), "the listener of a covered port has no element");
    Ok(())
}

/// A listener has no socket storage element: its program is kept in
/// `mw_services`, so neither it nor the sockets it accepts carry one until
/// a covered handshake, and once a rule names the port its accepted ends
/// are judged by that program (the reader guard knows them) and
/// accelerated.
#[test]
fn a_listener_of_an_uncovered_port_gives_its_sockets_no_element() -> Result<()> {
    use std::os::fd::AsRawFd;
    let k = kernel_test!(1024);
    ensure!(k.dp().guard_enabled(), "the reader guard is on: it records listeners");
    let state: meshwarp_core::maps::TypedMap<i32, meshwarp_bpf::shared::SockState> =
        k.map(meshwarp_bpf::names::MAP_SK_STATE)?;
    let (net, listener) = two_pods(false)?;
    let (c0, s0) = connect_pods(&net, &listener, false)?;
    exchange(c0.try_clone()?, s0.try_clone()?, 61, 4096, T)?;
    ensure!(state.get(&listener.as_raw_fd())?.is_none(), "the listener of an uncovered port has no element");
    ensure!(state.get(&s0.as_raw_fd())?.is_none(), "nor its accepted socket");
    drop((c0, s0));
    k.dp().insert(&pair_for(&net, false), "test")?;
    let (c, s) = connect_until_accelerated(&k, &net, &listener, false)
        .context("a connection of the listener accelerated once a rule names its port")?;
    exchange(c, s, 62, 1 << 20, T)?;
    Ok(())
}

/// A listener leaves its program and process in `mw_services`, keyed by
/// namespace, port and family, not by address. Another program listening
/// on that port (socat on 127.0.0.1, this test's listener on the pod's
/// address) marks the service mixed, for good: no program is known for its
/// ends, which stay on TCP (`fallback_reader`) rather than be judged by the
/// wrong one; their bytes arrive whole. Their reads do not name a program
/// for the service either.
#[test]
fn another_program_on_the_port_marks_the_service_mixed() -> Result<()> {
    use meshwarp_bpf::shared::SVC_MIXED;
    use std::os::fd::AsRawFd;
    let k = kernel_test!(1024);
    ensure!(k.dp().guard_enabled(), "the reader guard is on: it records listeners");
    if meshwarp_testbed::which("socat").is_none() {
        meshwarp_testbed::missing_feature::<()>("socat (scripts/install-deps.sh installs it)");
        return Ok(());
    }
    let services: meshwarp_core::maps::TypedMap<meshwarp_bpf::shared::ServiceKey, meshwarp_bpf::shared::Service> =
        k.map(meshwarp_bpf::names::MAP_SERVICES)?;
    let (net, listener) = two_pods(false)?;
    let key = meshwarp_bpf::shared::ServiceKey {
        netns: meshwarp_core::sys::netns_cookie_of(&listener.as_raw_fd())?,
        port: u32::from(SERVER_PORT),
        family: libc::AF_INET as u32,
    };
    let me = meshwarp_core::execlass::exe_key(&std::env::current_exe()?)?;
    let kept = services.get(&key)?.context("the listener's program is kept by its service")?;
    ensure!(kept.exe == me && kept.tgid == std::process::id() && kept.flags == 0, "the listener's program: {kept:?}");
    let socat = meshwarp_testbed::Program::spawn(
        &net.pods[1].ns,
        &["socat", &format!("TCP4-LISTEN:{SERVER_PORT},bind=127.0.0.1,reuseaddr,fork"), "SYSTEM:cat"],
    )?;
    meshwarp_testbed::wait_port_listening(&net.pods[1].ns, SERVER_PORT, T)?;
    wait_until(T, || Ok(services.get(&key)?.is_some_and(|v| v.flags & SVC_MIXED != 0)))
        .context("socat's listen() marked the service mixed")?;
    drop(socat);
    let pair = pair_for(&net, false);
    k.dp().insert(&pair, "test")?;
    for i in 0..4 {
        let (c, s) = connect_pods(&net, &listener, false)?;
        ensure!(k.dp().socket_link(socket_cookie_of(&c)?)?.is_none(), "connection {i}: not accelerated");
        exchange(c, s, 63 + i, 256 << 10, T)?;
    }
    let st = k.dp().stats(&pair)?;
    ensure!(st.sockets == 0 && st.fallback_reader >= 4, "{st:?}");
    let v = services.get(&key)?.context("the entry")?;
    ensure!(v.flags & SVC_MIXED != 0 && v.exe == me, "still mixed after the reads: {v:?}");
    Ok(())
}

/// An end closed on both sides whose program still holds it (TCP_CLOSE, the
/// kernel's own port number 0): read from the socket storage, it is listed
/// with its local port and found by it; read by iter/tcp in each namespace,
/// it is out of TCP's hash tables and not listed (as documented).
#[test]
fn a_closed_end_is_listed_with_its_port() -> Result<()> {
    let k = kernel_test!(1024);
    let (net, listener) = two_pods(false)?;
    let pair = pair_for(&net, false);
    k.dp().insert(&pair, "test")?;
    let (mut c, mut s) = connect_pods(&net, &listener, false)?;
    c.write_all(b"ping")?;
    let mut got = [0u8; 4];
    meshwarp_testbed::read_exact_ready(&mut s, &mut got, Some(T))?;
    let cookie = socket_cookie_of(&s)?;
    let by_cookie = ConnFilter { cookie: Some(cookie), ..ConnFilter::default() };
    ensure!(k.dp().connections(&by_cookie)?.len() == 1, "the server end listed while open");
    // Client FIN first, then the server's: the server end goes LAST_ACK ->
    // CLOSE at the client's last ACK while its fd stays open.
    c.shutdown(std::net::Shutdown::Write)?;
    ensure!(s.read(&mut got)? == 0, "the client's FIN");
    s.shutdown(std::net::Shutdown::Write)?;
    ensure!(c.read(&mut got)? == 0, "the server's FIN");
    wait_until(Duration::from_secs(5), || Ok(tcp_state(&s)? == TCP_CLOSE))
        .context("the server end reached TCP_CLOSE")?;
    let listed = k.dp().connections(&by_cookie)?;
    match k.dp().connection_source() {
        Some(ConnSource::SocketStorage) => {
            let [end] = &listed[..] else { anyhow::bail!("the closed end listed once: {listed:?}") };
            ensure!(
                end.state == u32::from(TCP_CLOSE) && end.local.port() == SERVER_PORT,
                "its state and local port: {end:?}"
            );
            let by_port = ConnFilter { port: Some(SERVER_PORT), ..by_cookie };
            ensure!(k.dp().connections(&by_port)?.len() == 1, "found by its port");
        }
        source => ensure!(listed.is_empty(), "{source:?}: a closed end is out of TCP's tables: {listed:?}"),
    }
    eprintln!("[sockredir] connection list read by {:?}", k.dp().connection_source());
    drop(c);
    Ok(())
}

/// A Fast Open connection whose client end never links (no free slot: the
/// cookie's connection holds the only one): its server end, made at the SYN,
/// is listed as any covered end whose client is not accelerated, and its
/// bytes take TCP both ways, intact.
#[test]
fn a_fast_open_end_whose_client_never_links_is_listed_as_such() -> Result<()> {
    let k = kernel_test!(2);
    let (net, listener, _pair, to) = fast_open_pods(&k)?;
    let first = [7u8; 100];
    // The cookie's connection, accelerated, holds the one slot.
    let c1 = fast_open(&net, to, &first)?;
    let mut s1 = accept_timeout(&listener, T)?;
    let mut got = [0u8; 100];
    meshwarp_testbed::read_exact_ready(&mut s1, &mut got, Some(T))?;
    let c = fast_open(&net, to, &first)?;
    let mut s = accept_timeout(&listener, T)?;
    ensure!(syn_data_accepted(&c)?, "the SYN carried data: Fast Open");
    meshwarp_testbed::read_exact_ready(&mut s, &mut got, Some(T))?;
    ensure!(got == first, "the SYN's data");
    let cookie = socket_cookie_of(&s)?;
    let listed = k.dp().connections(&ConnFilter { cookie: Some(cookie), ..ConnFilter::default() })?;
    let [end] = &listed[..] else { anyhow::bail!("the server end listed once: {listed:?}") };
    let peer = PathNow::Tcp(TcpReason::Peer);
    ensure!(
        !end.accelerated && end.rx_path == peer && end.tx_path == peer,
        "no link, so its client is not accelerated (not `syn_data`): {end:?}"
    );
    ensure!(k.dp().global_stats()?.no_link >= 1, "counted as an end without a link");
    exchange(c, s, 41, 1 << 20, T)?;
    exchange(c1, s1, 43, 1 << 20, T)?;
    Ok(())
}
