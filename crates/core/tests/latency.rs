//! The latency monitor and the connection list on a real kernel: a server
//! that waits a known 2 ms before replying shows in the right bucket of the
//! right rule (think time at the server, response time at the client), a
//! proxy that waits 2 ms between two hops shows as that hop, the fast path's
//! deliveries stay far below it, a rule the monitor is off for records
//! nothing; the connection list matches `ss` and names why a connection takes
//! TCP; switching the monitor on and off under checksummed traffic loses
//! nothing.
//!
//! (netem is not built into these kernels: the known delay is the
//! application's own, not the wire's.)
//!
//! Each test fails (never skips) when CI=true and BPF is refused.

#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::thread;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use meshwarp_core::{
    ConnFilter, EndpointPair, FastPathMode, Histogram, LatencySampling, LatencyScope, Metric, PathNow, TcpReason,
};
use meshwarp_testbed::{
    accept_timeout, echo_integrity, read_exact_ready, spawn_echo, write_all_ready, KernelTest, NodeWithPods, StreamEcho,
};

const T: Option<Duration> = Some(Duration::from_secs(60));
const TWO_MS: u64 = 2_000_000;
/// Bucket of 2^20 ns (1.05 ms): nothing that waited 2 ms lands below it.
const BUCKET_1MS: usize = 20;

macro_rules! kernel_test {
    () => {
        match KernelTest::start(1024) {
            Some(k) => k,
            None => return Ok(()),
        }
    };
}

fn hist(hs: &[Histogram], rule: u32, metric: Metric, from: Option<u32>) -> Option<&Histogram> {
    hs.iter().find(|h| h.rule_id == rule && h.metric == metric && h.from_rule == from)
}

fn below(h: &Histogram, bucket: usize) -> u64 {
    h.buckets[..bucket].iter().sum()
}

fn pair(
    k: &KernelTest,
    net: &NodeWithPods,
    from: usize,
    to: usize,
    port: u16,
    mode: FastPathMode,
) -> Result<(TcpListener, EndpointPair, u32)> {
    let addr = SocketAddr::new(net.pods[to].addr(false), port);
    let l = net.pods[to].ns.listen(addr)?;
    let p = EndpointPair::new(net.pods[from].addr(false), addr.into())?.with_mode(mode);
    k.dp().insert(&p, "test")?;
    let id = k.dp().rule_id(&p)?;
    Ok((l, p, id))
}

/// Request/response rounds of `len` bytes; the server waits `wait` before each reply.
fn rounds(c: &mut TcpStream, s: TcpStream, n: usize, len: usize, wait: Duration) -> Result<()> {
    // The first request is sent once the server thread runs: its start is
    // no delivery time (a test bounds those at 67 ms).
    let (ready, started) = std::sync::mpsc::channel();
    let server = thread::spawn(move || -> Result<()> {
        let mut s = s;
        let mut buf = vec![0u8; len];
        let _ = ready.send(());
        for _ in 0..n {
            read_exact_ready(&mut s, &mut buf, T)?;
            thread::sleep(wait);
            write_all_ready(&mut s, &buf, T)?;
        }
        Ok(())
    });
    let _ = started.recv();
    let mut buf = vec![0u8; len];
    for i in 0..n {
        let msg = vec![(i % 251) as u8; len];
        write_all_ready(c, &msg, T)?;
        read_exact_ready(c, &mut buf, T)?;
        ensure!(buf == msg, "round {i}: wrong reply");
    }
    server.join().unwrap()
}

/// Frees `p`'s rule id `id` and registers a pair to `port` in its place:
/// the new rule gets `id` again, without the histograms of the old one.
fn given_again_clean(k: &KernelTest, net: &NodeWithPods, p: &EndpointPair, port: u16, id: u32) -> Result<()> {
    k.dp().remove(p)?;
    let again = EndpointPair::new(net.pods[0].addr(false), SocketAddr::new(net.pods[1].addr(false), port).into())?;
    k.dp().insert(&again, "test")?;
    ensure!(k.dp().rule_id(&again)? == id, "the freed id is given again");
    ensure!(k.dp().latency().histograms(&BTreeSet::from([id]))?.is_empty(), "no histograms carried over");
    Ok(())
}

/// A server that waits 2 ms before replying: its think time and the
/// client's response time are at least 2 ms, every sample; the fast path's
/// deliveries are not (and no byte took TCP under mode always). A second
/// rule the monitor is not on for records nothing; a third, mode never,
/// records its deliveries as TCP.
#[test]
fn a_server_that_waits_2ms_shows_in_its_rules_buckets() -> Result<()> {
    let k = kernel_test!();
    let net = NodeWithPods::new(2)?;
    let (l, _p, id) = pair(&k, &net, 0, 1, 8301, FastPathMode::Always)?;
    let (l2, _p2, id2) = pair(&k, &net, 0, 1, 8302, FastPathMode::Always)?;
    let (l3, _p3, id3) = pair(&k, &net, 0, 1, 8303, FastPathMode::Never)?;
    // Exact counts: every message (rule 3's rounds do not wait).
    k.dp().latency().set_sampling(LatencySampling::Every)?;
    k.dp().latency().set(&LatencyScope::Rules(BTreeSet::from([id, id3])), false)?;
    ensure!(k.dp().latency().scope()? == LatencyScope::Rules(BTreeSet::from([id, id3])));

    let mut c = net.pods[0].ns.connect(SocketAddr::new(net.pods[1].addr(false), 8301))?;
    let s = accept_timeout(&l, Duration::from_secs(10))?;
    rounds(&mut c, s, 30, 64, Duration::from_millis(2))?;
    let mut c2 = net.pods[0].ns.connect(SocketAddr::new(net.pods[1].addr(false), 8302))?;
    let s2 = accept_timeout(&l2, Duration::from_secs(10))?;
    rounds(&mut c2, s2, 30, 64, Duration::from_millis(2))?;
    let mut c3 = net.pods[0].ns.connect(SocketAddr::new(net.pods[1].addr(false), 8303))?;
    let s3 = accept_timeout(&l3, Duration::from_secs(10))?;
    rounds(&mut c3, s3, 30, 64, Duration::ZERO)?;

    let hs = k.dp().latency().histograms(&BTreeSet::new())?;
    let think = hist(&hs, id, Metric::Think, None).context("think time recorded")?;
    ensure!(think.count >= 30 && below(think, BUCKET_1MS) == 0, "think: {think:?}");
    ensure!(think.mean_ns().unwrap() >= TWO_MS, "think mean {:?}", think.mean_ns());
    let resp = hist(&hs, id, Metric::Response, None).context("response time recorded")?;
    ensure!(resp.count >= 30 && below(resp, BUCKET_1MS) == 0, "response: {resp:?}");
    ensure!(resp.mean_ns().unwrap() >= TWO_MS, "response mean {:?}", resp.mean_ns());
    let fast = hist(&hs, id, Metric::Fast, None).context("fast-path deliveries recorded")?;
    ensure!(fast.count >= 50, "fast: {fast:?}");
    ensure!(fast.quantile_ns(0.5).unwrap() < 1 << BUCKET_1MS, "fast p50 {:?}", fast.quantile_ns(0.5));
    ensure!(hist(&hs, id, Metric::Tcp, None).is_none_or(|h| h.count == 0), "mode always took TCP: {hs:?}");
    ensure!(hist(&hs, id, Metric::Setup, None).is_some_and(|h| h.count >= 1), "setup: {hs:?}");
    ensure!(hs.iter().all(|h| h.rule_id != id2), "a rule the monitor is off for recorded: {hs:?}");
    // Mode never: every delivery crossed TCP (the bridge and both veths).
    let tcp = hist(&hs, id3, Metric::Tcp, None).context("TCP-path deliveries recorded")?;
    ensure!(tcp.count >= 50, "tcp: {tcp:?}");
    ensure!(hist(&hs, id3, Metric::Fast, None).is_none(), "mode never took the fast path: {hs:?}");

    k.dp().latency().set(&LatencyScope::Off, false)?;
    let links = k.cfg.pin_root.join(format!("v{}", meshwarp_core::dataplane::SCHEMA_VERSION)).join("links");
    ensure!(!links.join("mw_lat_send").exists(), "send side detached");
    Ok(())
}

/// app -> proxy -> server across three pods and two rules; the proxy waits
/// 2 ms before forwarding each request and none before each response: the
/// hop from the first rule into the second is at least 2 ms, the way back
/// is not, and the client's response time includes it.
#[test]
fn a_proxy_that_waits_2ms_shows_as_that_hop() -> Result<()> {
    let k = kernel_test!();
    let net = NodeWithPods::new(3)?;
    let (l_in, _a, a) = pair(&k, &net, 0, 1, 8311, FastPathMode::Always)?;
    let (l_up, _b, b) = pair(&k, &net, 1, 2, 8312, FastPathMode::Always)?;
    k.dp().latency().set(&LatencyScope::All, false)?;

    let mut c = net.pods[0].ns.connect(SocketAddr::new(net.pods[1].addr(false), 8311))?;
    let down = accept_timeout(&l_in, Duration::from_secs(10))?;
    let mut up = net.pods[1].ns.connect(SocketAddr::new(net.pods[2].addr(false), 8312))?;
    let srv = accept_timeout(&l_up, Duration::from_secs(10))?;
    let echo = spawn_echo(srv, 64);
    let proxy = thread::spawn(move || -> Result<()> {
        let mut down = down;
        let mut buf = [0u8; 64];
        for _ in 0..30 {
            read_exact_ready(&mut down, &mut buf, T)?;
            thread::sleep(Duration::from_millis(2));
            write_all_ready(&mut up, &buf, T)?;
            read_exact_ready(&mut up, &mut buf, T)?;
            write_all_ready(&mut down, &buf, T)?;
        }
        Ok(())
    });
    let mut buf = [0u8; 64];
    for i in 0..30u8 {
        write_all_ready(&mut c, &[i; 64], T)?;
        read_exact_ready(&mut c, &mut buf, T)?;
        ensure!(buf == [i; 64], "round {i}");
    }
    proxy.join().unwrap()?;
    drop(c);
    echo.join().unwrap()?;

    let hs = k.dp().latency().histograms(&BTreeSet::new())?;
    let forward = hist(&hs, b, Metric::Hop, Some(a)).context("hop a -> b recorded")?;
    ensure!(forward.count >= 30 && below(forward, BUCKET_1MS) == 0, "hop a->b: {forward:?}");
    let back = hist(&hs, a, Metric::Hop, Some(b)).context("hop b -> a recorded")?;
    ensure!(back.count >= 30 && back.quantile_ns(0.5).unwrap() < 1 << BUCKET_1MS, "hop b->a: {back:?}");
    let resp = hist(&hs, a, Metric::Response, None).context("client response")?;
    ensure!(resp.count >= 30 && below(resp, BUCKET_1MS) == 0, "response: {resp:?}");
    for rule in [a, b] {
        let f = hist(&hs, rule, Metric::Fast, None).context("fast deliveries")?;
        ensure!(f.quantile_ns(0.5).unwrap() < 1 << BUCKET_1MS, "rule {rule} fast: {f:?}");
    }
    k.dp().latency().reset(&BTreeSet::from([a]))?;
    let hs = k.dp().latency().histograms(&BTreeSet::new())?;
    ensure!(hs.iter().all(|h| h.rule_id != a) && hs.iter().any(|h| h.rule_id == b), "reset one rule: {hs:?}");
    Ok(())
}

/// `ss -tnHe` of a namespace: the cookies (sk:) of its established sockets
/// with `port` as either port.
fn ss_cookies(net: &NodeWithPods, pod: usize, ports: &[u16]) -> Result<BTreeSet<u64>> {
    let out = net.pods[pod].ns.exec(&["ss", "-tnHe", "state", "established"])?;
    let mut set = BTreeSet::new();
    for line in out.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let port_of = |s: &str| s.rsplit(':').next().and_then(|p| p.parse::<u16>().ok());
        let (Some(lp), Some(rp)) = (f.get(2).and_then(|s| port_of(s)), f.get(3).and_then(|s| port_of(s))) else {
            continue;
        };
        if !ports.contains(&lp) && !ports.contains(&rp) {
            continue;
        }
        let ck = f.iter().find_map(|w| w.strip_prefix("sk:")).context("ss -e prints sk:")?;
        set.insert(u64::from_str_radix(ck, 16)?);
    }
    Ok(set)
}

/// Three accelerated and two mode-never connections: the list has exactly
/// the sockets `ss` shows in each pod, both ends of each, with their rule,
/// path, reason and bytes; filters narrow it.
#[test]
fn the_connection_list_matches_ss_and_names_fallbacks() -> Result<()> {
    let k = kernel_test!();
    let net = NodeWithPods::new(2)?;
    let (l_fast, _a, a) = pair(&k, &net, 0, 1, 8321, FastPathMode::Always)?;
    let (l_tcp, _b, b) = pair(&k, &net, 0, 1, 8322, FastPathMode::Never)?;
    let mut conns = Vec::new();
    for (port, l, n) in [(8321u16, &l_fast, 3), (8322, &l_tcp, 2)] {
        for _ in 0..n {
            let c = net.pods[0].ns.connect(SocketAddr::new(net.pods[1].addr(false), port))?;
            let s = accept_timeout(l, Duration::from_secs(10))?;
            conns.push((port, c, s));
        }
    }
    for (_, c, s) in conns.iter_mut() {
        rounds(c, s.try_clone()?, 10, 1000, Duration::ZERO)?;
    }

    let all = k.dp().connections(&ConnFilter::default())?;
    let mine: Vec<_> = all
        .iter()
        .filter(|c| [8321, 8322].contains(&c.local.port()) || [8321, 8322].contains(&c.remote.port()))
        .collect();
    ensure!(mine.len() == 10, "both ends of 5 connections: {mine:#?}");
    let ours: BTreeSet<u64> = mine.iter().map(|c| c.cookie).collect();
    let ss: BTreeSet<u64> =
        ss_cookies(&net, 0, &[8321, 8322])?.union(&ss_cookies(&net, 1, &[8321, 8322])?).copied().collect();
    ensure!(ours == ss, "cookies: ours {ours:?}, ss {ss:?}");

    let by_netns: BTreeMap<u64, usize> = mine.iter().fold(BTreeMap::new(), |mut m, c| {
        *m.entry(c.netns).or_default() += 1;
        m
    });
    ensure!(by_netns.len() == 2 && by_netns.values().all(|&n| n == 5), "two pods: {by_netns:?}");
    let me = std::process::id();
    for c in &mine {
        ensure!(c.state_name() == "ESTAB", "{c:?}");
        if c.rule_id == a {
            ensure!(c.accelerated && c.tx_path == PathNow::Fast && c.rx_path == PathNow::Fast, "{c:?}");
            ensure!(c.tx.fast_bytes >= 10_000 && c.tx.fast_msgs >= 1 && c.tx.tcp_bytes == 0, "{c:?}");
        } else {
            ensure!(c.rule_id == b, "{c:?}");
            ensure!(!c.accelerated && c.tx_path == PathNow::Tcp(TcpReason::ModeNever), "{c:?}");
            ensure!(c.tx.fast_bytes == 0 && c.tx.tcp_bytes >= 10_000 && c.rx.tcp_bytes >= 10_000, "{c:?}");
        }
        if k.dp().guard_enabled() {
            ensure!(c.owner_pid == Some(me) || c.reader_pid == Some(me), "process: {c:?}");
            ensure!(c.comm.is_some(), "comm: {c:?}");
        } else {
            eprintln!("reader guard off on this kernel: process of a socket not checked");
        }
    }
    // Both ends share the connection id; one command finds a socket.
    let one = mine[0];
    let found = k.dp().connections(&ConnFilter { cookie: Some(one.cookie), ..ConnFilter::default() })?;
    ensure!(found.len() == 1 && found[0].cookie == one.cookie);
    ensure!(mine.iter().filter(|c| c.conn_id == one.conn_id).count() == 2, "both ends of {one:?}");
    let tcp_only = k.dp().connections(&ConnFilter { fast: Some(false), rule_id: Some(b), ..ConnFilter::default() })?;
    ensure!(tcp_only.len() == 4, "mode never sockets: {tcp_only:#?}");
    let by_port = k.dp().connections(&ConnFilter { port: Some(8321), ..ConnFilter::default() })?;
    ensure!(by_port.len() == 6, "{by_port:#?}");
    drop(conns);
    Ok(())
}

/// Adaptive sampling, the default: a connection that waits 2 ms per round
/// is measured on every message; a busy one starts a measured request only
/// every few (at most 64) sends, and each such request is measured whole
/// (as many think times as responses); switched to every message, the same
/// connection counts exactly. Every reply arrives intact throughout.
#[test]
fn sampling_measures_slow_sockets_fully_and_busy_ones_in_whole_requests() -> Result<()> {
    let k = kernel_test!();
    let net = NodeWithPods::new(2)?;
    let (l, _p, id) = pair(&k, &net, 0, 1, 8361, FastPathMode::Always)?;
    ensure!(k.dp().latency().sampling()? == LatencySampling::Adaptive, "adaptive by default");
    k.dp().latency().set(&LatencyScope::Rules(BTreeSet::from([id])), false)?;
    let count = |metric: Metric| -> Result<u64> {
        let hs = k.dp().latency().histograms(&BTreeSet::from([id]))?;
        Ok(hist(&hs, id, metric, None).map_or(0, |h| h.count))
    };
    let to = SocketAddr::new(net.pods[1].addr(false), 8361);

    let mut c = net.pods[0].ns.connect(to)?;
    let s = accept_timeout(&l, Duration::from_secs(10))?;
    rounds(&mut c, s, 20, 64, Duration::from_millis(2))?;
    ensure!(count(Metric::Think)? == 20 && count(Metric::Response)? == 20, "slow: every message");

    const BUSY: u64 = 3000;
    k.dp().latency().reset(&BTreeSet::from([id]))?;
    let mut c = net.pods[0].ns.connect(to)?;
    let s = accept_timeout(&l, Duration::from_secs(10))?;
    let started = std::time::Instant::now();
    rounds(&mut c, s.try_clone()?, BUSY as usize, 64, Duration::ZERO)?;
    let per_round = started.elapsed() / BUSY as u32;
    let (think, resp) = (count(Metric::Think)?, count(Metric::Response)?);
    eprintln!("busy connection: {resp} of {BUSY} requests sampled (think times: {think}; {per_round:?} per round)");
    ensure!(resp >= BUSY / 65, "busy: {resp} of {BUSY} requests sampled");
    // Sampling thins out only while samples come under MW_LAT_GAP (1.024 ms)
    // apart: rounds slower than about a quarter of that are "slow" sockets.
    if per_round < Duration::from_micros(250) {
        ensure!(resp <= BUSY / 2, "busy: {resp} of {BUSY} requests sampled at {per_round:?} per round");
    } else {
        eprintln!(
            "!!! rounds of {per_round:?} are not busy on this machine: the upper bound on samples is not checked"
        );
    }
    ensure!(think.abs_diff(resp) <= 2, "a sampled request is measured whole: think {think}, response {resp}");

    // Quiet again: after a pause, within 8 sends every message counts (the
    // busy socket had skipped up to 63; halving alone would take 120).
    thread::sleep(Duration::from_millis(50));
    rounds(&mut c, s.try_clone()?, 8, 64, Duration::from_millis(2))?;
    k.dp().latency().reset(&BTreeSet::from([id]))?;
    rounds(&mut c, s.try_clone()?, 10, 64, Duration::from_millis(2))?;
    let (think, resp) = (count(Metric::Think)?, count(Metric::Response)?);
    ensure!(think == 10 && resp == 10, "quiet after busy: every message, not {think} think and {resp} responses");

    // The TCP path, with messages of many segments read in pieces: one
    // send is one send (the send tracepoint fires per segment), and a
    // request read in pieces keeps its chain (think time).
    let (l2, _p2, id2) = pair(&k, &net, 0, 1, 8362, FastPathMode::Never)?;
    k.dp().latency().set(&LatencyScope::Rules(BTreeSet::from([id, id2])), false)?;
    let mut c2 = net.pods[0].ns.connect(SocketAddr::new(net.pods[1].addr(false), 8362))?;
    let s2 = accept_timeout(&l2, Duration::from_secs(10))?;
    rounds(&mut c2, s2, 10, 256 << 10, Duration::from_millis(2))?;
    let hs = k.dp().latency().histograms(&BTreeSet::from([id2]))?;
    let n = |m: Metric| hist(&hs, id2, m, None).map_or(0, |h| h.count);
    ensure!(
        n(Metric::Tcp) == 20 && n(Metric::Response) == 10 && n(Metric::Think) == 10,
        "TCP path, 256 KiB messages: {hs:?}"
    );

    k.dp().latency().set_sampling(LatencySampling::Every)?;
    k.dp().latency().reset(&BTreeSet::from([id]))?;
    rounds(&mut c, s, 500, 64, Duration::ZERO)?;
    ensure!(count(Metric::Response)? == 500 && count(Metric::Think)? == 500, "every message: exact counts");
    ensure!(k.dp().latency().sampling()? == LatencySampling::Every);
    Ok(())
}

/// Four clients stream checksummed bytes through an echo server, each over
/// at least 8 new connections in turn and until the monitor was switched 12
/// times (a fast machine streams 8 in under 50 ms), while a thread switches
/// it between off, every rule and one rule every 5 ms: every byte arrives;
/// once off, no histogram grows.
#[test]
fn switching_the_monitor_under_traffic_loses_nothing() -> Result<()> {
    let k = kernel_test!();
    let net = NodeWithPods::new(2)?;
    let (l, _p, id) = pair(&k, &net, 0, 1, 8331, FastPathMode::Adaptive)?;
    let to = SocketAddr::new(net.pods[1].addr(false), 8331);
    let echo = StreamEcho::start(l)?;
    let stop = AtomicBool::new(false);
    let switched = AtomicU32::new(0);
    let switches = thread::scope(|scope| -> Result<u32> {
        let toggler = scope.spawn(|| -> Result<u32> {
            let scopes = [LatencyScope::All, LatencyScope::Off, LatencyScope::Rules(BTreeSet::from([id]))];
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                k.dp().latency().set(&scopes[n as usize % 3], false)?;
                n += 1;
                switched.store(n, Ordering::Relaxed);
                thread::sleep(Duration::from_millis(5));
            }
            Ok(n)
        });
        let workers: Vec<_> = (0..4u64)
            .map(|i| {
                let (net, switched) = (&net, &switched);
                scope.spawn(move || -> Result<()> {
                    // Bounded, so a stuck toggler fails the check below instead of hanging.
                    let mut round = 0;
                    while round < 8 || (switched.load(Ordering::Relaxed) < 12 && round < 400) {
                        let c = net.pods[0].ns.connect(to)?;
                        echo_integrity(c, i * 1000 + round, 256 * 1024, Duration::from_secs(60))?;
                        round += 1;
                    }
                    Ok(())
                })
            })
            .collect();
        let done: Result<()> = workers.into_iter().try_for_each(|w| w.join().unwrap());
        stop.store(true, Ordering::Relaxed);
        let n = toggler.join().unwrap()?;
        done.map(|()| n)
    })?;
    ensure!(switches >= 12, "switched {switches} times");
    ensure!(!k.dp().latency().histograms(&BTreeSet::new())?.is_empty(), "recorded while on");

    k.dp().latency().set(&LatencyScope::Off, false)?;
    let before = k.dp().latency().histograms(&BTreeSet::new())?;
    let c = net.pods[0].ns.connect(to)?;
    echo_integrity(c, 99, 256 * 1024, Duration::from_secs(60))?;
    ensure!(k.dp().latency().histograms(&BTreeSet::new())? == before, "grew while off");
    drop(echo);
    Ok(())
}

/// A send stamped before the monitor went off and on again is not measured
/// across the gap (it would report the whole off period), and a rule id
/// freed and given to a new rule starts with the monitor off and no
/// histograms.
#[test]
fn stamps_from_before_a_switch_and_a_reused_rule_id_are_not_carried_over() -> Result<()> {
    let k = kernel_test!();
    let net = NodeWithPods::new(2)?;
    let (l, p, id) = pair(&k, &net, 0, 1, 8341, FastPathMode::Always)?;
    k.dp().latency().set_sampling(LatencySampling::Every)?;
    k.dp().latency().set(&LatencyScope::Rules(BTreeSet::from([id])), false)?;
    let mut c = net.pods[0].ns.connect(SocketAddr::new(net.pods[1].addr(false), 8341))?;
    let mut s = accept_timeout(&l, Duration::from_secs(10))?;
    rounds(&mut c, s.try_clone()?, 5, 64, Duration::ZERO)?;
    // Sent while on, read after off -> 200 ms -> on.
    write_all_ready(&mut c, &[7; 64], T)?;
    k.dp().latency().set(&LatencyScope::Off, false)?;
    thread::sleep(Duration::from_millis(200));
    k.dp().latency().set(&LatencyScope::Rules(BTreeSet::from([id])), false)?;
    let mut buf = [0u8; 64];
    read_exact_ready(&mut s, &mut buf, T)?;
    write_all_ready(&mut s, &buf, T)?;
    read_exact_ready(&mut c, &mut buf, T)?;
    let hs = k.dp().latency().histograms(&BTreeSet::from([id]))?;
    let fast = hist(&hs, id, Metric::Fast, None).context("fast deliveries")?;
    ensure!(fast.count >= 10, "{fast:?}");
    ensure!(fast.buckets[26..].iter().sum::<u64>() == 0, "a 200 ms gap was measured: {fast:?}");

    drop((c, s));
    given_again_clean(&k, &net, &p, 8342, id)?;
    ensure!(k.dp().latency().scope()? == LatencyScope::Rules(BTreeSet::new()), "monitor off for the new rule");
    Ok(())
}

/// A rule id freed and given again after the daemon restarted (the pins
/// adopted) starts without the histograms recorded before the restart:
/// maps the monitor ran on stay marked used, so a new rule id is searched.
#[test]
fn a_rule_id_reused_after_a_restart_has_no_histograms_from_before() -> Result<()> {
    let mut k = kernel_test!();
    let net = NodeWithPods::new(2)?;
    let (l, p, id) = pair(&k, &net, 0, 1, 8345, FastPathMode::Always)?;
    k.dp().latency().set_sampling(LatencySampling::Every)?;
    k.dp().latency().set(&LatencyScope::All, false)?;
    let mut c = net.pods[0].ns.connect(SocketAddr::new(net.pods[1].addr(false), 8345))?;
    let s = accept_timeout(&l, Duration::from_secs(10))?;
    rounds(&mut c, s, 5, 64, Duration::ZERO)?;
    k.dp().latency().set(&LatencyScope::Off, false)?;
    ensure!(!k.dp().latency().histograms(&BTreeSet::from([id]))?.is_empty(), "recorded before the restart");
    drop(c);

    // A restart: the pins (and histograms) stay, the process is new.
    drop(k.dp.take());
    k.dp = Some(meshwarp_core::Dataplane::open(&k.cfg)?);
    ensure!(k.dp().origin() == meshwarp_core::DataplaneOrigin::Adopted, "the pins were adopted");
    given_again_clean(&k, &net, &p, 8346, id)
}

/// The first rule ids record by index (`mw_lat_rows`), the ones past them in
/// the hash: both show, side by side, in the same histograms, and a reset
/// or a reused id clears either.
#[test]
fn rules_past_the_indexed_rows_record_in_the_hash_alike() -> Result<()> {
    let Some(k) = KernelTest::start_sized(1024, 400) else {
        return Ok(());
    };
    let net = NodeWithPods::new(2)?;
    let (l_low, _, low) = pair(&k, &net, 0, 1, 8351, FastPathMode::Always)?;
    // Fill every indexed row; the next rule takes an id past them.
    let rows = meshwarp_bpf::shared::LAT_ROWS;
    for port in 0..rows - 1 {
        let p = EndpointPair::new(
            net.pods[0].addr(false),
            SocketAddr::new(net.pods[1].addr(false), 20000 + port as u16).into(),
        )?;
        k.dp().insert(&p, "filler")?;
    }
    let (l_high, p_high, high) = pair(&k, &net, 0, 1, 8352, FastPathMode::Always)?;
    ensure!(low < rows && high >= rows, "ids {low} and {high} straddle the {rows} rows");
    k.dp().latency().set(&LatencyScope::All, false)?;
    for (l, port) in [(&l_low, 8351), (&l_high, 8352)] {
        let mut c = net.pods[0].ns.connect(SocketAddr::new(net.pods[1].addr(false), port))?;
        let s = accept_timeout(l, Duration::from_secs(10))?;
        rounds(&mut c, s, 8, 64, Duration::from_millis(2))?;
    }
    let hs = k.dp().latency().histograms(&BTreeSet::new())?;
    for id in [low, high] {
        let think = hist(&hs, id, Metric::Think, None).with_context(|| format!("rule {id}: think time in {hs:?}"))?;
        ensure!(think.count == 8 && below(think, BUCKET_1MS) == 0, "rule {id}: {think:?}");
        let fast = hist(&hs, id, Metric::Fast, None).with_context(|| format!("rule {id}: deliveries"))?;
        ensure!(fast.count >= 16, "rule {id}: {fast:?}");
    }
    // Histograms of one rule only; a reset of one leaves the other.
    let only_high = k.dp().latency().histograms(&BTreeSet::from([high]))?;
    ensure!(!only_high.is_empty() && only_high.iter().all(|h| h.rule_id == high), "{only_high:?}");
    k.dp().latency().reset(&BTreeSet::from([low]))?;
    let hs = k.dp().latency().histograms(&BTreeSet::new())?;
    ensure!(hs.iter().all(|h| h.rule_id != low) && hs.iter().any(|h| h.rule_id == high), "{hs:?}");
    // A freed id past the rows is given again clean.
    k.dp().latency().set(&LatencyScope::Off, false)?;
    given_again_clean(&k, &net, &p_high, 8353, high)
}
