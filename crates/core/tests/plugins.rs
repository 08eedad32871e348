//! Plugins on a real kernel: the example plugins change real traffic exactly
//! as configured, chains run in (phase, priority) order, hot swaps under
//! checksummed traffic lose nothing, refused objects change nothing, failure
//! policies hold, and unloading restores the previous behaviour.
//!
//! Each test fails (never skips) when CI=true and BPF is refused.

#![allow(clippy::unwrap_used)]

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use libbpf_rs::{MapCore, MapFlags, MapHandle};
use meshwarp_bpf::plugins;
use meshwarp_core::plugin::{PluginCounters, PluginInfo};
use meshwarp_core::{
    Endpoint, EndpointPair, FailurePolicy, FastPathMode, Hook, Phase, PluginChain, PluginError, PluginManifest,
};
use meshwarp_testbed::{
    accept_timeout, child_dataplane_config, child_test, echo_integrity, exchange, expect_zerocopy_completions,
    read_exact_ready, set_zerocopy, zerocopy_pattern, zerocopy_transfer, KernelTest, NodeWithPods, OverlayEgress,
    StreamEcho, TcTest, TwoNodes,
};

const T: Duration = Duration::from_secs(60);
const PORT: u16 = 8080;
const OTHER_PORT: u16 = 9090;

macro_rules! kernel_test {
    () => {
        match KernelTest::start(1024) {
            Some(k) => k,
            None => return Ok(()),
        }
    };
}

fn chain(k: &KernelTest) -> Result<PluginChain> {
    Ok(PluginChain::open(Some(k.dp()), None)?)
}

fn manifest(name: &str, hook: Hook, priority: i32) -> PluginManifest {
    PluginManifest { priority, version: "test".into(), ..PluginManifest::new(name, hook) }
}

fn counters(c: &PluginChain, name: &str) -> PluginCounters {
    c.get(name).unwrap().counters
}

/// Two pods, pod1 listening on PORT and OTHER_PORT, a pair registered for each.
struct Pods {
    net: NodeWithPods,
    listeners: [TcpListener; 2],
    pairs: [EndpointPair; 2],
}

impl Pods {
    fn new(k: &KernelTest) -> Result<Self> {
        let net = NodeWithPods::new(2)?;
        let (a, b) = (net.pods[0].addr(false), net.pods[1].addr(false));
        let listeners =
            [net.pods[1].ns.listen(SocketAddr::new(b, PORT))?, net.pods[1].ns.listen(SocketAddr::new(b, OTHER_PORT))?];
        let pairs =
            [EndpointPair::new(a, Endpoint::new(b, PORT))?, EndpointPair::new(a, Endpoint::new(b, OTHER_PORT))?]
                .map(|p| p.with_mode(FastPathMode::Always));
        for p in &pairs {
            k.dp().insert(p, "test")?;
        }
        Ok(Self { net, listeners, pairs })
    }

    /// Connects pod0 -> pod1 on listener `i`; (client, server).
    fn connect(&self, i: usize) -> Result<(TcpStream, TcpStream)> {
        let port = [PORT, OTHER_PORT][i];
        let c = self.net.pods[0].ns.connect(SocketAddr::new(self.net.pods[1].addr(false), port))?;
        let s = accept_timeout(&self.listeners[i], T)?;
        for x in [&c, &s] {
            x.set_nodelay(true)?;
            x.set_read_timeout(Some(T))?;
        }
        Ok((c, s))
    }
}

#[test]
fn port_allowlist_declines_outside_its_ports_and_unload_restores() -> Result<()> {
    let k = kernel_test!();
    let pods = Pods::new(&k)?;
    let c = chain(&k)?;
    let cfg: Vec<u8> = PORT.to_le_bytes().to_vec();
    c.load(&manifest("ports", Hook::Connection, 0), plugins::PORT_ALLOW, &cfg, false, "test")?;

    let len = 1 << 20;
    let (cl, sv) = pods.connect(0)?;
    exchange(cl, sv, 1, len, T)?;
    let before = pods.net.veth_bytes(0)?;
    let (cl, sv) = pods.connect(1)?;
    exchange(cl, sv, 3, len, T)?;
    ensure!(pods.net.veth_bytes(0)? - before >= 2 * len as u64, "declined connection must use the veth");

    let allowed = k.dp().stats(&pods.pairs[0])?;
    let declined = k.dp().stats(&pods.pairs[1])?;
    ensure!(allowed.sockets == 2 && allowed.redirected_bytes == 2 * len as u64, "port {PORT} accelerated: {allowed:?}");
    ensure!(declined.sockets == 0 && declined.redirected_bytes == 0, "port {OTHER_PORT} declined: {declined:?}");
    let pc = counters(&c, "ports");
    ensure!(pc.runs == 4 && pc.continued == 2 && pc.verdict1 == 2, "two ends allowed, two declined: {pc:?}");

    // Config update: now only OTHER_PORT.
    c.update_config("ports", &OTHER_PORT.to_le_bytes(), None)?;
    let (cl, sv) = pods.connect(1)?;
    exchange(cl, sv, 5, len, T)?;
    ensure!(k.dp().stats(&pods.pairs[1])?.sockets == 2, "config update took effect");

    // Unloading restores acceleration on every covered port.
    c.unload("ports", None)?;
    ensure!(c.list()?.is_empty());
    let (cl, sv) = pods.connect(0)?;
    exchange(cl, sv, 7, len, T)?;
    ensure!(k.dp().stats(&pods.pairs[0])?.sockets == 4, "accelerated again after unload");
    Ok(())
}

/// Entries of the sampler's pinned map: (rule id, [msgs, bytes, sampled, sampled_bytes, last]).
fn samples(info: &PluginInfo) -> Result<Vec<(u32, [u64; 5])>> {
    let m = info.maps.iter().find(|m| m.name == "mw_samples").context("mw_samples pinned")?;
    let h = MapHandle::from_pinned_path(&m.pin)?;
    let mut out = Vec::new();
    for key in h.keys() {
        let v = h.lookup(&key, MapFlags::ANY)?.context("sample entry")?;
        let words: Vec<u64> = v.chunks(8).map(|c| u64::from_ne_bytes(c.try_into().unwrap())).collect();
        out.push((u32::from_ne_bytes(key[..4].try_into()?), [words[0], words[1], words[2], words[3], words[4]]));
    }
    Ok(out)
}

/// `n` round trips of `size` bytes (client writes, server echoes).
fn ping_pong(cl: &mut TcpStream, sv: &mut TcpStream, n: usize, size: usize) -> Result<()> {
    let msg = vec![0x5a; size];
    let mut buf = vec![0; size];
    for _ in 0..n {
        cl.write_all(&msg)?;
        read_exact_ready(sv, &mut buf, Some(T))?;
        sv.write_all(&buf)?;
        read_exact_ready(cl, &mut buf, Some(T))?;
        ensure!(buf == msg, "echo differs");
    }
    Ok(())
}

#[test]
fn byte_sampler_counts_every_message_of_each_pair() -> Result<()> {
    let k = kernel_test!();
    let pods = Pods::new(&k)?;
    let c = chain(&k)?;
    let info =
        c.load(&manifest("sampler", Hook::Message, 0), plugins::BYTE_SAMPLER, &4u32.to_le_bytes(), false, "test")?;
    ensure!(info.maps.iter().any(|m| m.name == "mw_samples"), "own map pinned: {:?}", info.maps);

    let (mut cl, mut sv) = pods.connect(0)?;
    ping_pong(&mut cl, &mut sv, 100, 1000)?;
    let (mut cl2, mut sv2) = pods.connect(1)?;
    ping_pong(&mut cl2, &mut sv2, 10, 300)?;

    let mut s = samples(&info)?;
    s.sort_by_key(|(_, v)| std::cmp::Reverse(v[0]));
    ensure!(s.len() == 2, "one entry per pair: {s:?}");
    ensure!(s[0].1[..4] == [200, 200_000, 50, 50_000] && s[0].1[4] == 1000, "pair {PORT}: {s:?}");
    ensure!(s[1].1[..4] == [20, 6_000, 5, 1_500], "pair {OTHER_PORT}: {s:?}");
    ensure!(s[0].0 != s[1].0, "distinct rule ids");
    let pc = counters(&c, "sampler");
    ensure!(pc.runs == 220 && pc.continued == 220, "{pc:?}");
    ensure!(k.dp().stats(&pods.pairs[0])?.redirected_msgs == 200, "sampling does not change redirection");
    Ok(())
}

/// An end whose peer is never a target sends nothing that can be redirected;
/// without plugins it sits where no sk_msg runs (mw_tgtmap). With an
/// on_message plugin loaded, its sends still run the chain: the plugin sees
/// every message of both ends, whichever end the rule keeps bytes out of.
#[test]
fn a_message_plugin_sees_the_sends_of_an_end_whose_peer_is_no_target() -> Result<()> {
    let k = kernel_test!();
    let c = chain(&k)?;
    c.load(&manifest("noop", Hook::Message, 0), plugins::NOOP_MSG, &[], false, "test")?;
    let net = NodeWithPods::new(2)?;
    let (a, b) = (net.pods[0].addr(false), net.pods[1].addr(false));
    let mut runs = 0;
    for (i, (client, server)) in [(false, true), (true, false)].into_iter().enumerate() {
        let port = PORT + i as u16;
        let l = net.pods[1].ns.listen(SocketAddr::new(b, port))?;
        let pair = EndpointPair::new(a, Endpoint::new(b, port))?
            .never_redirect_into(meshwarp_core::NeverRedirectInto { client, server });
        k.dp().insert(&pair, "test")?;
        // Twice: the second client also knows its server end is no target.
        for _ in 0..2 {
            let mut cl = net.pods[0].ns.connect(SocketAddr::new(b, port))?;
            let mut sv = accept_timeout(&l, T)?;
            for x in [&cl, &sv] {
                x.set_nodelay(true)?;
                x.set_read_timeout(Some(T))?;
            }
            ping_pong(&mut cl, &mut sv, 50, 100)?;
            runs += 100;
            let st = k.dp().stats(&pair)?;
            ensure!(st.tgtmap_clients == 0, "with a plugin no end skips sk_msg: {st:?}");
        }
        let pc = counters(&c, "noop");
        ensure!(pc.runs == runs, "never into client {client}, server {server}: {pc:?}, expected {runs} runs");
    }
    Ok(())
}

/// With an on_message plugin loaded, an end with SO_ZEROCOPY on at
/// connect() is not accelerated: in mw_sockmap tcp_bpf would number its
/// zero-copy completions wrong, and in mw_tgtmap its sends would skip the
/// chain. Its completions are numbered as on TCP; the plugin sees nothing.
#[test]
fn with_a_message_plugin_a_zero_copy_end_is_not_accelerated() -> Result<()> {
    let k = kernel_test!();
    let c = chain(&k)?;
    c.load(&manifest("noop", Hook::Message, 0), plugins::NOOP_MSG, &[], false, "test")?;
    let net = NodeWithPods::new(2)?;
    let (a, b) = (net.pods[0].addr(false), net.pods[1].addr(false));
    let to = SocketAddr::new(b, PORT);
    let l = net.pods[1].ns.listen(to)?;
    let pair = EndpointPair::new(a, Endpoint::new(b, PORT))?;
    k.dp().insert(&pair, "test")?;
    let cl = net.pods[0].ns.connect_with(to, set_zerocopy)?;
    let sv = accept_timeout(&l, T)?;
    let data = zerocopy_pattern(2 << 20);
    let sent = zerocopy_transfer(&cl, &sv, &data, T)?;
    expect_zerocopy_completions(&cl, &sent)?;
    let cookie = meshwarp_core::sys::socket_cookie_of(&cl)?;
    let listed = k.dp().connections(&meshwarp_core::ConnFilter { cookie: Some(cookie), ..Default::default() })?;
    let zc = meshwarp_core::PathNow::Tcp(meshwarp_core::TcpReason::Zerocopy);
    ensure!(listed.len() == 1 && listed[0].tx_path == zc && !listed[0].accelerated, "{listed:?}");
    exchange(cl, sv, 51, 256 << 10, T)?;
    let st = k.dp().stats(&pair)?;
    ensure!(st.fallback_zerocopy == 1 && st.sockets == 0 && st.redirected_bytes == 0, "{st:?}");
    ensure!(counters(&c, "noop").runs == 0, "the plugin saw sends of an end not accelerated");
    Ok(())
}

fn rate_config(mode: u32, unit: u32, rate: u64, burst: u64) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend(mode.to_le_bytes());
    v.extend(unit.to_le_bytes());
    v.extend(rate.to_le_bytes());
    v.extend(burst.to_le_bytes());
    v
}

#[test]
fn rate_limiter_drops_beyond_its_burst() -> Result<()> {
    let k = kernel_test!();
    let pods = Pods::new(&k)?;
    let c = chain(&k)?;
    c.load(&manifest("limit", Hook::Message, 0), plugins::RATE_LIMIT, &rate_config(1, 1, 0, 10), false, "test")?;
    let (mut cl, mut sv) = pods.connect(0)?;
    let msg = [7u8; 100];
    for i in 0..10 {
        cl.write_all(&msg).with_context(|| format!("message {i} within the burst"))?;
    }
    let err = cl.write(&msg).expect_err("the 11th message is beyond the burst");
    ensure!(err.raw_os_error() == Some(libc::EACCES), "dropped message fails with EACCES: {err}");
    let mut got = vec![0u8; 1000];
    read_exact_ready(&mut sv, &mut got, Some(T))?;
    ensure!(got.iter().all(|b| *b == 7), "the first 10 messages arrive intact");
    sv.set_nonblocking(true)?;
    let mut extra = [0u8; 16];
    ensure!(matches!(sv.read(&mut extra), Err(e) if e.kind() == ErrorKind::WouldBlock), "nothing beyond them");
    let pc = counters(&c, "limit");
    ensure!(pc.continued == 10 && pc.dropped == 1, "{pc:?}");
    // The kernel keeps a socket's sk_msg drop verdict: later sends fail too,
    // without running the chain again.
    ensure!(cl.write(&msg).is_err() && counters(&c, "limit").runs == 11, "drop is final for the socket");

    // Refill: with a rate, a new connection gets through again.
    c.update_config("limit", &rate_config(1, 1, 1_000_000, 10), None)?;
    thread::sleep(Duration::from_millis(5));
    let (mut cl, mut sv) = pods.connect(0)?;
    cl.write_all(&msg).context("after refill")?;
    read_exact_ready(&mut sv, &mut got[..100], Some(T))?;
    Ok(())
}

#[test]
fn rate_limiter_bypass_keeps_every_byte_in_order() -> Result<()> {
    let k = kernel_test!();
    let pods = Pods::new(&k)?;
    let c = chain(&k)?;
    // 64 KiB of burst, no refill, counted in bytes: the rest of each
    // direction goes the normal path.
    c.load(&manifest("limit", Hook::Message, 0), plugins::RATE_LIMIT, &rate_config(2, 2, 0, 64 << 10), false, "test")?;
    let before = pods.net.veth_bytes(0)?;
    let (cl, sv) = pods.connect(0)?;
    let len = 4 << 20;
    exchange(cl, sv, 11, len, T)?;
    let st = k.dp().stats(&pods.pairs[0])?;
    let pc = counters(&c, "limit");
    ensure!(st.redirected_bytes > 0 && st.redirected_bytes <= 64 << 10, "only the burst redirected: {st:?}");
    ensure!(pc.verdict1 >= 2, "both directions bypassed: {pc:?}");
    ensure!(pods.net.veth_bytes(0)? - before >= 2 * (len as u64 - (64 << 10)), "the rest crossed the veth");
    Ok(())
}

#[test]
fn chain_runs_in_phase_then_priority_order() -> Result<()> {
    let k = kernel_test!();
    let pods = Pods::new(&k)?;
    let c = chain(&k)?;
    // The limiter (burst 0, drop) ahead of the sampler: the sampler never runs.
    let limiter = PluginManifest { phase: Phase::Authz, ..manifest("limit", Hook::Message, 0) };
    c.load(&limiter, plugins::RATE_LIMIT, &rate_config(1, 1, 0, 0), false, "test")?;
    let sampler = PluginManifest { phase: Phase::Stats, ..manifest("sampler", Hook::Message, 100) };
    c.load(&sampler, plugins::BYTE_SAMPLER, &[], false, "test")?;
    let order: Vec<(String, u32)> = c.list()?.into_iter().map(|p| (p.manifest.name, p.position)).collect();
    ensure!(order == [("limit".to_string(), 0), ("sampler".to_string(), 1)], "{order:?}");
    let (mut cl, _sv) = pods.connect(0)?;
    ensure!(cl.write(&[1u8; 10]).is_err(), "dropped by the limiter");
    ensure!(counters(&c, "limit").dropped == 1 && counters(&c, "sampler").runs == 0, "sampler after limiter");

    // Same phase: higher priority first. Move the limiter behind the sampler.
    let limiter = PluginManifest { phase: Phase::Stats, priority: 1, ..limiter };
    c.load(&limiter, plugins::RATE_LIMIT, &rate_config(1, 1, 0, 0), true, "test")?;
    ensure!(c.get("limit")?.position == 1 && c.get("sampler")?.position == 0);
    // A new connection: the kernel keeps the old socket's drop verdict.
    drop(cl);
    let (mut cl, _sv) = pods.connect(0)?;
    ensure!(cl.write(&[1u8; 10]).is_err(), "still dropped");
    ensure!(counters(&c, "sampler").runs == 1, "the sampler saw the message first");
    ensure!(counters(&c, "limit").dropped == 1, "the replacement has its own counters");
    Ok(())
}

#[test]
fn hot_swap_under_traffic_loses_nothing() -> Result<()> {
    let k = kernel_test!();
    let pods = Pods::new(&k)?;
    let c = chain(&k)?;
    c.load(&manifest("noop", Hook::Message, 0), plugins::NOOP_MSG, &[], false, "test")?;
    c.load(&manifest("sampler", Hook::Message, -1), plugins::BYTE_SAMPLER, &[], false, "test")?;
    let listener = pods.net.pods[1].ns.listen(SocketAddr::new(pods.net.pods[1].addr(false), 7070))?;
    let pair = EndpointPair::new(pods.net.pods[0].addr(false), Endpoint::new(pods.net.pods[1].addr(false), 7070))?
        .with_mode(FastPathMode::Always);
    k.dp().insert(&pair, "test")?;
    let _echo = StreamEcho::start(listener)?;

    // Streams keep running, each a fresh connection with its own checksummed
    // pattern, until 20 rounds of replace + config update + load or unload.
    let conns = 4u64;
    let len = 4 << 20;
    let done = std::sync::atomic::AtomicBool::new(false);
    let streams = thread::scope(|scope| -> Result<u64> {
        let mut traffic = Vec::new();
        for i in 0..conns {
            let (net, done) = (&pods.net, &done);
            traffic.push(scope.spawn(move || -> Result<u64> {
                let mut n = 0;
                while n == 0 || !done.load(std::sync::atomic::Ordering::Relaxed) {
                    let s = net.pods[0].ns.connect(SocketAddr::new(net.pods[1].addr(false), 7070))?;
                    echo_integrity(s, 1000 * i + n, len, T)?;
                    n += 1;
                }
                Ok(n)
            }));
        }
        let swapped = (|| -> Result<()> {
            for swap in 0..20u32 {
                c.load(&manifest("noop", Hook::Message, swap as i32 % 3), plugins::NOOP_MSG, &[], true, "test")?;
                c.update_config("sampler", &(swap + 1).to_le_bytes(), None)?;
                // A third plugin comes and goes at the head of the chain.
                if swap % 2 == 0 {
                    c.load(&manifest("extra", Hook::Message, 10), plugins::VERDICT_MSG, &[], false, "test")?;
                } else {
                    c.unload("extra", None)?;
                }
            }
            Ok(())
        })();
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut streams = 0;
        for t in traffic {
            streams += t.join().unwrap()?;
        }
        swapped.map(|()| streams)
    })?;
    eprintln!("20 hot swaps, config updates and loads/unloads under {streams} checksummed streams");
    let st = k.dp().stats(&pair)?;
    ensure!(st.redirected_bytes == 2 * streams * len as u64, "every byte stayed accelerated: {st:?}");
    ensure!(st.fallback_tcp_path == 0 && st.fallback_no_peer == 0, "{st:?}");
    ensure!(counters(&c, "sampler").runs >= st.redirected_msgs, "the chain ran on every message");
    ensure!(c.list()?.len() == 2, "old programs gone, new ones listed");
    Ok(())
}

#[test]
fn refused_objects_change_nothing() -> Result<()> {
    let k = kernel_test!();
    let pods = Pods::new(&k)?;
    let c = chain(&k)?;
    c.load(&manifest("noop", Hook::Message, 0), plugins::NOOP_MSG, &[], false, "test")?;
    let before: Vec<(String, u32, u32)> = c.list()?.into_iter().map(|p| (p.manifest.name, p.id, p.prog_id)).collect();

    let e = c.load(&manifest("future", Hook::Message, 0), plugins::ABI_MAJOR, &[], false, "test").unwrap_err();
    ensure!(matches!(e, PluginError::AbiMismatch { plugin: (3, 0) }), "{e}");
    let e = c.load(&manifest("bad", Hook::Message, 0), plugins::REJECTED, &[], false, "test").unwrap_err();
    let PluginError::Rejected { log, .. } = &e else { anyhow::bail!("expected a verifier rejection, got {e}") };
    ensure!(log.contains("unbounded memory access"), "the verifier's reason is carried: {log}");
    ensure!(e.to_string().contains("verifier"), "{e}");
    let e = c.load(&manifest("noop", Hook::Message, 0), plugins::NOOP_MSG, &[], false, "test").unwrap_err();
    ensure!(matches!(e, PluginError::AlreadyExists { .. }), "{e}");
    let e = c.load(&manifest("wrong-hook", Hook::Connection, 0), plugins::NOOP_MSG, &[], false, "test").unwrap_err();
    ensure!(matches!(e, PluginError::HookMismatch { .. }), "{e}");
    let e = c.load(&manifest("pkt", Hook::Packet, 0), plugins::PKT_PORT, &[], false, "test").unwrap_err();
    ensure!(matches!(e, PluginError::HookUnavailable { .. }), "{e}");
    let bad_sha = PluginManifest { sha256: Some([0; 32]), ..manifest("sha", Hook::Message, 0) };
    let e = c.load(&bad_sha, plugins::NOOP_MSG, &[], false, "test").unwrap_err();
    ensure!(matches!(e, PluginError::Sha256Mismatch { .. }), "{e}");
    let e = c.load(&manifest("big", Hook::Message, 0), plugins::NOOP_MSG, &[0; 513], false, "test").unwrap_err();
    ensure!(matches!(e, PluginError::ConfigTooLarge { .. }), "{e}");
    // Another owner's plugin is neither replaced, nor configured, nor unloaded.
    let e = c.load(&manifest("noop", Hook::Message, 0), plugins::NOOP_MSG, &[], true, "intruder").unwrap_err();
    ensure!(matches!(e, PluginError::OwnerMismatch { .. }), "{e}");
    let e = c.update_config("noop", &[1], Some("intruder")).unwrap_err();
    ensure!(matches!(e, PluginError::OwnerMismatch { .. }), "{e}");
    let e = c.unload("noop", Some("intruder")).unwrap_err();
    ensure!(matches!(e, PluginError::OwnerMismatch { .. }), "{e}");
    let e = c.load(&manifest("ownerless", Hook::Message, 0), plugins::NOOP_MSG, &[], false, "").unwrap_err();
    ensure!(matches!(e, PluginError::Invalid { field: "owner", .. }), "{e}");

    let after: Vec<(String, u32, u32)> = c.list()?.into_iter().map(|p| (p.manifest.name, p.id, p.prog_id)).collect();
    ensure!(before == after, "chain unchanged: {before:?} -> {after:?}");
    let (cl, sv) = pods.connect(0)?;
    exchange(cl, sv, 21, 1 << 20, T)?;
    ensure!(counters(&c, "noop").runs > 0, "the running chain still runs");
    ensure!(k.dp().stats(&pods.pairs[0])?.redirected_bytes == 2 << 20);
    Ok(())
}

/// The kernel's cookie of a socket (SO_COOKIE).
fn socket_cookie(s: &TcpStream) -> Result<u64> {
    use std::os::fd::AsRawFd;
    let mut cookie = 0u64;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: a valid socket and an 8-byte buffer.
    let rc = unsafe {
        libc::getsockopt(s.as_raw_fd(), libc::SOL_SOCKET, libc::SO_COOKIE, (&raw mut cookie).cast(), &mut len)
    };
    ensure!(rc == 0, "SO_COOKIE: {}", std::io::Error::last_os_error());
    Ok(cookie)
}

/// Plugins cannot rewrite the host's state: one that writes the chain is
/// refused by the verifier; one that asks for its own pinning, one that
/// declares the host's socket state (to point its socket at another
/// connection's link) and one that declares the host's counters are refused
/// at load; both connections stay intact.
#[test]
fn hostile_plugins_are_refused_or_cannot_reach_another_connection() -> Result<()> {
    let k = kernel_test!();
    let pods = Pods::new(&k)?;
    let c = chain(&k)?;
    let e =
        c.load(&manifest("hostile-chain", Hook::Message, 0), plugins::HOSTILE_CHAIN, &[], false, "test").unwrap_err();
    let PluginError::Rejected { log, .. } = &e else { anyhow::bail!("expected a verifier rejection, got {e}") };
    ensure!(log.contains("write into map forbidden"), "the verifier's reason is carried: {log}");
    let e = c.load(&manifest("pinned", Hook::Message, 0), plugins::PINNED_MAP, &[], false, "test").unwrap_err();
    ensure!(matches!(e, PluginError::NotAPlugin { .. }) && e.to_string().contains("pinned"), "{e}");
    ensure!(c.list()?.is_empty(), "nothing was loaded");

    // Connection 1's client end, as the host knows it: what the hostile
    // plugin would steer connection 0's bytes into.
    let (c0, s0) = pods.connect(0)?;
    let (mut c1, mut s1) = pods.connect(1)?;
    let target = k.dp().socket_link(socket_cookie(&c1)?)?.context("connection 1 is accelerated")?;
    let mut cfg = target.link.to_le_bytes().to_vec();
    cfg.extend(target.end.to_le_bytes());
    cfg.extend(target.slot.to_le_bytes());
    let e = c.load(&manifest("steer", Hook::Message, 0), plugins::HOSTILE_STEER, &cfg, false, "test").unwrap_err();
    ensure!(
        matches!(e, PluginError::NotAPlugin { .. }) && e.to_string().contains("mw_sk_state"),
        "an object that declares the host's socket state is refused: {e}"
    );
    ensure!(c.list()?.is_empty(), "nothing was loaded");
    // Nor can a plugin reach another plugin's counters: each counts only
    // itself, in a map of its own.
    c.load(&manifest("noop", Hook::Message, 1), plugins::NOOP_MSG, &[], false, "test")?;
    let e = c.load(&manifest("stats", Hook::Message, 0), plugins::HOSTILE_STATS, &[], false, "test").unwrap_err();
    ensure!(
        matches!(e, PluginError::NotAPlugin { .. }) && e.to_string().contains("mw_plug_stats"),
        "an object that declares the host's counters is refused: {e}"
    );
    ensure!(c.get("noop")?.maps.is_empty(), "a plugin's own counters are not listed as its maps");
    c.unload("noop", None)?;
    // Connection 0's bytes stay on connection 0, checksummed both ways...
    exchange(c0, s0, 41, 1 << 20, T)?;
    // ... and none reached connection 1, which still works.
    s1.set_nonblocking(true)?;
    let mut buf = [0u8; 64];
    match s1.read(&mut buf) {
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        other => anyhow::bail!("connection 1's server got something: {other:?}"),
    }
    s1.set_nonblocking(false)?;
    c1.write_all(b"still-mine")?;
    let mut got = [0u8; 10];
    s1.read_exact(&mut got)?;
    ensure!(&got == b"still-mine");
    s1.write_all(b"and-back!!")?;
    c1.read_exact(&mut got)?;
    ensure!(&got == b"and-back!!");
    Ok(())
}

/// Empties the active on_message chain slot 0 behind the library's back.
fn remove_first_msg_program(k: &KernelTest) -> Result<()> {
    let maps = k.dp().pin_dir().join("maps");
    let gen = MapHandle::from_pinned_path(maps.join("mw_chain_gen"))?;
    let g = gen.lookup(&2u32.to_ne_bytes(), MapFlags::ANY)?.context("gen")?;
    let g = u32::from_ne_bytes(g[..4].try_into()?) & 1;
    let progs = MapHandle::from_pinned_path(maps.join("mw_ch_msg"))?;
    progs.delete(&(g * 8).to_ne_bytes())?;
    Ok(())
}

#[test]
fn failure_policy_open_continues_closed_drops() -> Result<()> {
    let k = kernel_test!();
    let pods = Pods::new(&k)?;
    let c = chain(&k)?;

    // An unknown verdict: fail-open continues, fail-closed drops.
    c.load(&manifest("odd", Hook::Message, 0), plugins::VERDICT_MSG, &7u32.to_le_bytes(), false, "test")?;
    let (mut cl, mut sv) = pods.connect(0)?;
    ping_pong(&mut cl, &mut sv, 5, 64)?;
    let pc = counters(&c, "odd");
    ensure!(pc.invalid == 10, "{pc:?}");
    let closed = PluginManifest { failure: FailurePolicy::Closed, ..manifest("odd", Hook::Message, 0) };
    c.load(&closed, plugins::VERDICT_MSG, &7u32.to_le_bytes(), true, "test")?;
    let e = cl.write(&[1; 64]).unwrap_err();
    ensure!(e.raw_os_error() == Some(libc::EACCES), "{e}");

    // A plugin missing from its slot: fail-closed drops...
    c.load(&closed, plugins::VERDICT_MSG, &[], true, "test")?;
    let (mut cl, mut sv) = pods.connect(0)?;
    ping_pong(&mut cl, &mut sv, 1, 64)?;
    remove_first_msg_program(&k)?;
    ensure!(cl.write(&[1; 64]).is_err(), "fail-closed plugin missing: dropped");
    ensure!(counters(&c, "odd").missing == 1);

    // ...fail-open continues.
    c.load(&manifest("odd", Hook::Message, 0), plugins::VERDICT_MSG, &[], true, "test")?;
    let (mut cl, mut sv) = pods.connect(0)?;
    remove_first_msg_program(&k)?;
    ping_pong(&mut cl, &mut sv, 3, 64)?;
    ensure!(counters(&c, "odd").missing == 6, "{:?}", counters(&c, "odd"));
    Ok(())
}

#[test]
fn a_restarted_agent_adopts_loaded_plugins() -> Result<()> {
    let k = kernel_test!();
    let _pods = Pods::new(&k)?;
    let c = chain(&k)?;
    let m = PluginManifest {
        phase: Phase::Authz,
        failure: FailurePolicy::Closed,
        ..manifest("ports", Hook::Connection, 42)
    };
    c.load(&m, plugins::PORT_ALLOW, &PORT.to_le_bytes(), false, "istio")?;
    c.load(&manifest("sampler", Hook::Message, 0), plugins::BYTE_SAMPLER, &[1, 0, 0, 0], false, "test")?;
    let before = c.list()?;
    drop(c);
    let again = chain(&k)?;
    let after = again.list()?;
    ensure!(before.len() == after.len());
    for (b, a) in before.iter().zip(&after) {
        ensure!(b.manifest == a.manifest && b.id == a.id && b.prog_id == a.prog_id && b.config == a.config);
        ensure!(b.maps == a.maps && b.position == a.position && b.sha256 == a.sha256);
        ensure!(b.owner == a.owner, "owners survive adoption");
    }
    ensure!(again.get("ports")?.owner == "istio");
    let e = again.unload("ports", Some("test")).unwrap_err();
    ensure!(matches!(e, PluginError::OwnerMismatch { .. }), "another owner's plugin: {e}");
    again.unload("ports", Some("istio"))?;
    again.unload("sampler", None)?;
    ensure!(!k.dp().pin_dir().join("plugins").join("1").exists(), "pins removed on unload");
    Ok(())
}

/// A restarted agent believes the chains, not the metadata: a plugin whose
/// metadata was written but which never reached its chain (a load cut short
/// by a crash) is dropped, and a config update cut short between the chain
/// switch and the metadata keeps the config the chain reads.
#[test]
fn adoption_follows_the_chain_after_a_change_cut_short() -> Result<()> {
    use meshwarp_bpf::shared::{chain_index, ChainPos, PluginConfig, PluginMeta, CHAIN_MAX, HOOK_MESSAGE};
    use meshwarp_core::maps::TypedMap;

    let k = kernel_test!();
    let _pods = Pods::new(&k)?;
    let c = chain(&k)?;
    c.load(&manifest("noop", Hook::Message, 1), plugins::NOOP_MSG, &[], false, "test")?;
    let sampler =
        c.load(&manifest("sampler", Hook::Message, 0), plugins::BYTE_SAMPLER, &[1, 0, 0, 0], false, "test")?;
    let maps = k.dp().pin_dir().join("maps");
    let meta: TypedMap<u32, PluginMeta> = TypedMap::pinned(&maps, meshwarp_bpf::names::MAP_PLUG_META)?;
    let chain_map: TypedMap<u32, ChainPos> = TypedMap::pinned(&maps, meshwarp_bpf::names::MAP_CHAIN)?;
    let gen_map: TypedMap<u32, u32> = TypedMap::pinned(&maps, meshwarp_bpf::names::MAP_CHAIN_GEN)?;
    let cfg_map: TypedMap<u32, PluginConfig> = TypedMap::pinned(&maps, meshwarp_bpf::names::MAP_PLUG_CFG)?;

    // A load cut short: metadata of id 30, no chain position.
    let mut ghost = meta.get(&sampler.id)?.context("sampler metadata")?;
    ghost.name = [0; meshwarp_bpf::shared::PLUGIN_NAME_LEN];
    ghost.name[..5].copy_from_slice(b"ghost");
    meta.put(&30, &ghost)?;
    // A config update cut short: the chain reads the other slot, holding
    // the new config; the metadata still names the old one.
    let gen = gen_map.get(&HOOK_MESSAGE)?.unwrap_or(0) & 1;
    let at = (0..CHAIN_MAX)
        .map(|pos| chain_index(gen, HOOK_MESSAGE, pos))
        .find(|i| chain_map.get(i).ok().flatten().is_some_and(|p| p.plugin_id == sampler.id))
        .context("sampler in the active chain")?;
    let mut pos = chain_map.get(&at)?.context("position")?;
    let new_slot = pos.cfg_slot ^ 1;
    let new_cfg = PluginConfig::new(&[9, 0, 0, 0]).context("config")?;
    cfg_map.put(&new_slot, &new_cfg)?;
    pos.cfg_slot = new_slot;
    chain_map.put(&at, &pos)?;

    drop(c);
    let again = chain(&k)?;
    let names: Vec<String> = again.list()?.into_iter().map(|p| p.manifest.name).collect();
    ensure!(names == ["noop", "sampler"], "the ghost is not adopted: {names:?}");
    ensure!(meta.get(&30)?.is_none(), "and its metadata is gone");
    ensure!(again.get("sampler")?.config == [9, 0, 0, 0], "the chain's config stands");
    ensure!(meta.get(&sampler.id)?.context("meta")?.cfg_slot == new_slot, "the metadata follows the chain");
    // And the adopted chain works as before.
    again.update_config("sampler", &[2, 0, 0, 0], None)?;
    ensure!(again.get("sampler")?.config == [2, 0, 0, 0]);
    Ok(())
}

#[test]
fn packet_plugin_passes_or_drops_and_unload_restores_the_fast_path() -> Result<()> {
    let nodes = TwoNodes::new(1)?;
    let (Some(a), Some(b)) = (TcTest::start(&nodes.a.node), TcTest::start(&nodes.b.node)) else { return Ok(()) };
    let (tc_a, tc_b) = (a.tc(), b.tc());
    nodes.install_fast_path(tc_a, tc_b, false, OverlayEgress::Redirect)?;
    let server = SocketAddr::new(nodes.b.pods[0].addr(false), PORT);
    let listener = nodes.b.pods[0].ns.listen(server)?;
    let c = PluginChain::open(None, Some(tc_a))?;
    let routed = || -> Result<u64> { Ok(tc_a.routes().iter().map(|r| tc_a.route_stats(r).unwrap().packets).sum()) };
    let transfer = |seed| -> Result<()> {
        let cl = nodes.a.pods[0].ns.connect(server)?;
        let sv = accept_timeout(&listener, T)?;
        Ok(exchange(cl, sv, seed, 1 << 20, T)?)
    };

    // PASS for this port: node A's routes are skipped, its bridge carries it.
    let cfg = |verdict: u16| [PORT.to_le_bytes(), verdict.to_le_bytes()].concat();
    c.load(&manifest("port", Hook::Packet, 0), plugins::PKT_PORT, &cfg(1), false, "test")?;
    let (r0, br0) = (routed()?, nodes.a.bridge_bytes()?);
    transfer(31)?;
    ensure!(routed()? == r0, "no packet took node A's routes");
    ensure!(nodes.a.bridge_bytes()? - br0 >= 1 << 20, "node A's bridge carried the traffic");
    let pc = c.get("port")?.counters;
    // Packets of the port passed; the rest (ARP, ...) continued.
    ensure!(pc.verdict1 > 20 && pc.runs == pc.verdict1 + pc.continued, "{pc:?}");

    // DROP for this port: no connection.
    c.update_config("port", &cfg(2), None)?;
    let blocked = nodes.a.pods[0]
        .ns
        .enter(|| TcpStream::connect_timeout(&server, Duration::from_millis(1500)).map(|_| ()).map_err(|e| e.kind()))?;
    ensure!(blocked.is_err(), "SYNs dropped: {blocked:?}");
    ensure!(c.get("port")?.counters.dropped >= 1);

    // Unloaded: the fast path again.
    c.unload("port", None)?;
    let r1 = routed()?;
    transfer(33)?;
    ensure!(routed()? - r1 > 20, "node A's routes carry the traffic again");
    Ok(())
}

#[test]
fn a_chain_holds_eight_plugins_and_refuses_a_ninth() -> Result<()> {
    let k = kernel_test!();
    let pods = Pods::new(&k)?;
    let c = chain(&k)?;
    for i in 0..8 {
        c.load(&manifest(&format!("noop-{i}"), Hook::Message, i), plugins::NOOP_MSG, &[], false, "test")?;
    }
    let e = c.load(&manifest("ninth", Hook::Message, 0), plugins::NOOP_MSG, &[], false, "test").unwrap_err();
    ensure!(matches!(e, PluginError::ChainFull { hook: Hook::Message }), "{e}");
    // Another hook has its own chain.
    c.load(&manifest("ports", Hook::Connection, 0), plugins::PORT_ALLOW, &PORT.to_le_bytes(), false, "test")?;
    let (cl, sv) = pods.connect(0)?;
    exchange(cl, sv, 41, 1 << 20, T)?;
    let st = k.dp().stats(&pods.pairs[0])?;
    ensure!(st.redirected_bytes == 2 << 20, "eight tail calls deep, still redirected: {st:?}");
    for i in 0..8 {
        let pc = counters(&c, &format!("noop-{i}"));
        ensure!(pc.runs == st.redirected_msgs && pc.continued == pc.runs, "noop-{i}: {pc:?} vs {st:?}");
    }
    Ok(())
}

/// The child's part of the plugin crash test: opens the parent's pins and
/// starts the change `MW_PLUGIN_OP` names; the injected fault kills it.
fn plugin_change_child(cfg: &meshwarp_core::DataplaneConfig) -> Result<()> {
    let dp = meshwarp_core::Dataplane::open(cfg)?;
    let c = PluginChain::open(Some(&dp), None)?;
    match std::env::var("MW_PLUGIN_OP")?.as_str() {
        "load" => drop(c.load(&manifest("extra", Hook::Message, 5), plugins::NOOP_MSG, &[], false, "test")?),
        "replace" => {
            drop(c.load(&manifest("sampler", Hook::Message, 0), plugins::BYTE_SAMPLER, &[3, 0, 0, 0], true, "test")?)
        }
        "config" => drop(c.update_config("sampler", &[7, 0, 0, 0], None)?),
        "unload" => c.unload("noop", None)?,
        op => anyhow::bail!("unknown op {op}"),
    }
    anyhow::bail!("the child was not killed")
}

/// A process killed at any step of a plugin load, replacement, config update
/// or unload leaves pins that the next process adopts as either the state
/// before the change or the state after it — never a mix, no plugin pins
/// left without a plugin — and traffic through the chain keeps flowing.
#[test]
fn a_process_killed_at_any_step_of_a_plugin_change_adopts_a_consistent_state() -> Result<()> {
    if let Some(cfg) = child_dataplane_config() {
        return plugin_change_child(&cfg);
    }
    let mut k = kernel_test!();
    let pods = Pods::new(&k)?;
    let exe = std::env::current_exe()?;
    let chain_steps = ["chain filled", "chain flipped", "chain cleared"];
    let load_steps = ["plugin config", "plugin pinned", "plugin meta"];
    let cases: [(&str, Vec<&str>); 4] = [
        ("load", load_steps.iter().chain(&chain_steps).copied().collect()),
        ("replace", load_steps.iter().chain(&chain_steps).chain(&["plugin forgetting"]).copied().collect()),
        ("config", ["plugin config"].iter().chain(&chain_steps).copied().collect()),
        ("unload", chain_steps.iter().chain(&["plugin forgetting"]).copied().collect()),
    ];
    let plugins_dir = k.dp().pin_dir().join("plugins");
    for (op, points) in &cases {
        for point in points {
            // A known state: noop and sampler (config 1).
            let c = chain(&k)?;
            for p in c.list()? {
                c.unload(&p.manifest.name, None)?;
            }
            c.load(&manifest("noop", Hook::Message, 1), plugins::NOOP_MSG, &[], false, "test")?;
            let sampler =
                c.load(&manifest("sampler", Hook::Message, 0), plugins::BYTE_SAMPLER, &[1, 0, 0, 0], false, "test")?;
            drop(c);
            drop(k.dp.take());

            let name = "a_process_killed_at_any_step_of_a_plugin_change_adopts_a_consistent_state";
            let status = child_test(&exe, name, &k.cfg)
                .env("MESHWARP_FAULT", format!("kill:{point}"))
                .env("MW_PLUGIN_OP", op)
                .status()?;
            ensure!(
                std::os::unix::process::ExitStatusExt::signal(&status) == Some(libc::SIGKILL),
                "{op} at {point}: {status:?}"
            );

            k.dp = Some(meshwarp_core::Dataplane::open(&k.cfg)?);
            let c = chain(&k)?;
            let list = c.list()?;
            let mut names: Vec<&str> = list.iter().map(|p| p.manifest.name.as_str()).collect();
            names.sort();
            let config = |name: &str| list.iter().find(|p| p.manifest.name == name).map(|p| p.config.clone());
            let what = format!("{op} killed at {point}: {list:?}");
            match *op {
                "load" => ensure!(names == ["noop", "sampler"] || names == ["extra", "noop", "sampler"], "{what}"),
                "unload" => ensure!(names == ["noop", "sampler"] || names == ["sampler"], "{what}"),
                _ => ensure!(names == ["noop", "sampler"], "{what}"),
            }
            let cfg = config("sampler").context("sampler adopted")?;
            match *op {
                "config" => ensure!(cfg == [1, 0, 0, 0] || cfg == [7, 0, 0, 0], "{what}"),
                "replace" => {
                    let id = c.get("sampler")?.id;
                    ensure!(
                        (cfg == [1, 0, 0, 0]) == (id == sampler.id),
                        "old object with old config or new with new: {what}"
                    );
                    ensure!(cfg == [1, 0, 0, 0] || cfg == [3, 0, 0, 0], "{what}");
                }
                _ => ensure!(cfg == [1, 0, 0, 0], "{what}"),
            }
            // Every pinned plugin directory belongs to an adopted plugin.
            let mut dirs: Vec<u32> = std::fs::read_dir(&plugins_dir)
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|e| e.file_name().to_string_lossy().parse().ok())
                .collect();
            dirs.sort();
            let mut ids: Vec<u32> = list.iter().map(|p| p.id).collect();
            ids.sort();
            ensure!(dirs == ids, "pins {dirs:?} against plugins {ids:?}: {what}");
            // Traffic runs through the adopted chain, and it can change again.
            let before = counters(&c, "sampler").runs;
            let (mut cl, mut sv) = pods.connect(0)?;
            ping_pong(&mut cl, &mut sv, 20, 1000).with_context(|| what.clone())?;
            ensure!(counters(&c, "sampler").runs > before, "the adopted chain runs: {what}");
            c.update_config("sampler", &[2, 0, 0, 0], None)?;
        }
    }
    Ok(())
}

/// Opening a data path runs the kernel probe, which splices its own sockets;
/// with the system call watch attached that would mark the opening
/// executable as a splicer and keep its own connections (an embedding
/// controller's) off the fast path. The mark is taken back.
#[test]
fn opening_a_data_path_does_not_mark_the_opener_a_splicer() -> Result<()> {
    use meshwarp_bpf::shared::{Exe, ExeKey, EXE_SEEN_SPLICE};
    use meshwarp_core::maps::TypedMap;

    // The child (another executable): opens the parent's pins, probing the kernel.
    if let Some(cfg) = child_dataplane_config() {
        meshwarp_core::Dataplane::open(&cfg)?;
        return Ok(());
    }
    let mut k = kernel_test!();
    let dir = k.dp().pin_dir().to_path_buf();
    // Only the system call watch marks splicers; kernels whose splice sees
    // redirected bytes run without it (and then nothing can mark the opener).
    let watched = dir.join("links").join(meshwarp_bpf::names::PROG_SYS_ENTER).exists();
    ensure!(watched == k.dp().syscall_watch(), "the system call watch is attached exactly when it is on");
    let scratch = meshwarp_testbed::ScratchDir::new("opener")?;
    let exe = scratch.0.join("opener");
    std::fs::copy(std::env::current_exe()?, &exe)?;
    drop(k.dp.take());
    let status = child_test(&exe, "opening_a_data_path_does_not_mark_the_opener_a_splicer", &k.cfg).status()?;
    ensure!(status.success(), "the opener: {status:?}");
    let exes: TypedMap<ExeKey, Exe> = TypedMap::pinned(&dir.join("maps"), meshwarp_bpf::names::MAP_EXES)?;
    let key = meshwarp_core::execlass::exe_key(&exe)?;
    let flags = exes.get(&key)?.map_or(0, |e| e.flags);
    ensure!(flags & EXE_SEEN_SPLICE == 0, "the opener is marked a splicer: flags {flags:#x}");
    k.dp = Some(meshwarp_core::Dataplane::open(&k.cfg)?);
    Ok(())
}

/// A packet plugin that rewrites the chain state in `skb->cb` (here: the
/// direction, then straight to the finisher) cannot make the host apply a
/// route of the other direction: the finisher checks the state against what
/// the host saw, and the packet takes the normal path.
#[test]
fn a_packet_plugin_cannot_make_the_host_apply_another_directions_route() -> Result<()> {
    use meshwarp_core::tc::{Direction, IfaceRef, InterfaceRoute, Prefix, RouteAction};

    let nodes = TwoNodes::new(1)?;
    let (Some(a), Some(b)) = (TcTest::start(&nodes.a.node), TcTest::start(&nodes.b.node)) else { return Ok(()) };
    let (tc_a, tc_b) = (a.tc(), b.tc());
    nodes.install_fast_path(tc_a, tc_b, false, OverlayEgress::Redirect)?;
    // A route of the other direction on the same interface, for the same
    // destination: only a rewritten direction could make pod A's packets take it.
    let b_ip = nodes.b.pods[0].addr(false);
    let decoy = InterfaceRoute {
        attach: IfaceRef::Name("vpod0".into()),
        direction: Direction::Egress,
        dst: Prefix::new("dst", b_ip, 32)?,
        src: None,
        action: RouteAction::Redirect(IfaceRef::Name("vxlan0".into())),
        rewrite: None,
    };
    let decoy = tc_a.insert_route(&decoy, "test")?;
    let server = SocketAddr::new(b_ip, PORT);
    let listener = nodes.b.pods[0].ns.listen(server)?;
    let c = PluginChain::open(None, Some(tc_a))?;
    c.load(&manifest("flip", Hook::Packet, 0), plugins::HOSTILE_DIR, &[], false, "test")?;
    let cl = nodes.a.pods[0].ns.connect(server)?;
    let sv = accept_timeout(&listener, T)?;
    exchange(cl, sv, 61, 1 << 20, T)?;
    let st = tc_a.route_stats(&decoy)?;
    ensure!(st.packets == 0, "the other direction's route took {} packets", st.packets);
    c.unload("flip", None)?;
    Ok(())
}
