//! In-place upgrade on a real kernel: a pinned data path of "another build"
//! (its `mw_build` rewritten) is adopted and its programs replaced under
//! traffic; a step that fails puts every earlier step back; a process killed
//! after any step leaves a data path that forwards and that the next opener
//! finishes upgrading.
//!
//! Each test fails (never skips) when CI=true and BPF is refused.

#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use meshwarp_bpf::names;
use meshwarp_bpf::shared::{Build, Config, CFG_LAT_CLEAN};
use meshwarp_core::fault::inject as inject_fault;
use meshwarp_core::maps::TypedMap;
use meshwarp_core::sys::socket_cookie_of;
use meshwarp_core::upgrade::running_programs;
use meshwarp_core::{Dataplane, Endpoint, EndpointPair, FastPathMode, LatencySampling, LatencyScope, Upgrade};
use meshwarp_testbed::{
    child_dataplane_config, child_test, connect_nonblocking, echo_integrity, round_trip, KernelTest, NodeWithPods,
    Pattern, StreamEcho,
};
use socket2::{Domain, Socket, Type};

const T: Duration = Duration::from_secs(30);
const PORT: u16 = 8080;
const OTHER_BUILD: [u8; 16] = *b"0ther-build-0001";

macro_rules! kernel_test {
    ($max_sockets:expr) => {
        match KernelTest::start($max_sockets) {
            Some(k) => k,
            None => return Ok(()),
        }
    };
}

/// Two pods, pod1 echoing on PORT, the pair registered (mode always: every
/// message of these request/response loops is redirected).
struct Bed {
    net: NodeWithPods,
    _echo: StreamEcho,
    pair: EndpointPair,
}

impl Bed {
    fn new(dp: &Dataplane) -> Result<Self> {
        let net = NodeWithPods::new(2)?;
        let listener = net.pods[1].ns.listen(SocketAddr::new(net.pods[1].addr(false), PORT))?;
        let pair = EndpointPair::new(net.pods[0].addr(false), Endpoint::new(net.pods[1].addr(false), PORT))?
            .with_mode(FastPathMode::Always);
        dp.insert(&pair, "test")?;
        Ok(Self { _echo: StreamEcho::start(listener)?, net, pair })
    }

    fn connect(&self) -> Result<TcpStream> {
        let s = self.net.pods[0].ns.connect(SocketAddr::new(self.net.pods[1].addr(false), PORT))?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(T))?;
        s.set_write_timeout(Some(T))?;
        Ok(s)
    }
}

/// Pretends the pinned programs were loaded by another build.
fn mark_other_build(maps_dir: &Path) -> Result<()> {
    TypedMap::<u32, Build>::pinned(maps_dir, names::MAP_BUILD)?.put(&0, &Build { id: OTHER_BUILD })?;
    Ok(())
}

fn stray_pins(dir: &Path) -> Vec<PathBuf> {
    ["progs", "links"]
        .iter()
        .flat_map(|d| std::fs::read_dir(dir.join(d)).into_iter().flatten().flatten())
        .map(|e| e.path())
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("next-")))
        .collect()
}

/// Every point an injected fault can stop an upgrade at: after each step,
/// and between pinning a replacement and renaming it over the old pin.
fn fault_points(steps: &[String]) -> Vec<String> {
    let renamed = |s: &String| s.starts_with("pin ") || s == "link mw_recv_len" || s == "link mw_sys_enter";
    steps.iter().cloned().chain(steps.iter().filter(|s| renamed(s)).map(|s| format!("{s}/pinned"))).collect()
}

/// Every pinned link runs the program pinned under its name, and no program
/// id of `old` is still pinned or attached.
fn all_new(now: &BTreeMap<String, u32>, old: &BTreeMap<String, u32>) -> Result<()> {
    for (k, id) in now {
        ensure!(old.get(k) != Some(id), "{k} still runs program {id} of the old build ({now:?})");
        if let Some(name) = k.strip_prefix("links/") {
            ensure!(now.get(&format!("progs/{name}")) == Some(id), "link {name} runs {id}, not its pinned program");
        }
    }
    ensure!(now.keys().eq(old.keys()), "pins changed: {:?} against {:?}", now.keys(), old.keys());
    // The maps run the new programs too: each chain's end, the SOCKMAP's sk_msg.
    ensure!(now.contains_key("maps/mw_ch_conn[fin]") && now.contains_key("maps/mw_ch_msg[fin]"), "{now:?}");
    ensure!(
        now.get("maps/mw_sockmap sk_msg") == now.get("progs/mw_sk_msg"),
        "the SOCKMAP runs another sk_msg: {now:?}"
    );
    Ok(())
}

/// A connection that is redirected now: checked by its cookie, then a
/// checksummed exchange through the echo.
fn fresh_connection_is_redirected(dp: &Dataplane, bed: &Bed, seed: u64) -> Result<()> {
    let before = dp.stats(&bed.pair)?.redirected_bytes;
    let s = bed.connect()?;
    let cookie = socket_cookie_of(&s)?;
    ensure!(dp.socket_link(cookie)?.is_some(), "a new connection is not accelerated");
    echo_integrity(s, seed, 256 * 1024, T)?;
    let after = dp.stats(&bed.pair)?.redirected_bytes;
    ensure!(after >= before + 2 * 256 * 1024, "new connection's bytes not redirected: {before} -> {after}");
    Ok(())
}

/// Request/response on `s` with messages of varying size, each checked.
fn ping(s: &mut TcpStream, pattern: &mut Pattern, n: usize) -> Result<()> {
    let mut msg = vec![0u8; n];
    pattern.fill(&mut msg);
    let mut back = vec![0u8; n];
    round_trip(s, &msg, &mut back)?;
    ensure!(back == msg, "echo of {n} bytes differs");
    Ok(())
}

#[test]
fn an_upgrade_under_traffic_fails_no_request_and_keeps_every_connection() -> Result<()> {
    let mut k = kernel_test!(1024);
    let bed = Bed::new(k.dp())?;
    let dir = k.dp().pin_dir().to_path_buf();
    let old = running_programs(&dir)?;

    let stop = Arc::new(AtomicBool::new(false));
    let (requests, connections) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut workers = Vec::new();
    // Long-lived connections, open across the upgrade.
    let mut cookies = Vec::new();
    for w in 0..4u64 {
        let (stop, requests) = (Arc::clone(&stop), Arc::clone(&requests));
        let mut s = bed.connect()?;
        cookies.push(socket_cookie_of(&s)?);
        workers.push(thread::spawn(move || -> Result<()> {
            let mut pattern = Pattern::new(w);
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) {
                ping(&mut s, &mut pattern, [1, 64, 1024, 16 * 1024, 100_000][i % 5])
                    .with_context(|| format!("worker {w}, request {i}"))?;
                requests.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
            Ok(())
        }));
    }
    // New connections opened all through the upgrade.
    {
        let (stop, connections) = (Arc::clone(&stop), Arc::clone(&connections));
        let addr = SocketAddr::new(bed.net.pods[1].addr(false), PORT);
        let ns = bed.net.pods[0].ns.path();
        workers.push(thread::spawn(move || -> Result<()> {
            let mut seed = 100;
            while !stop.load(Ordering::Relaxed) {
                let s = meshwarp_core::sys::run_in_netns(Some(&ns), || {
                    connect_nonblocking(Socket::new(Domain::IPV4, Type::STREAM, None)?, addr, T)
                })??;
                echo_integrity(s, seed, 32 * 1024, T).with_context(|| format!("connection {seed}"))?;
                connections.fetch_add(1, Ordering::Relaxed);
                seed += 1;
            }
            Ok(())
        }));
    }
    thread::sleep(Duration::from_millis(500));

    // The daemon goes (the data path keeps forwarding), and a daemon of
    // "this" build adopts programs of another one.
    let at_stop = requests.load(Ordering::Relaxed);
    drop(k.dp.take());
    mark_other_build(&dir.join("maps"))?;
    thread::sleep(Duration::from_millis(200));
    let started = Instant::now();
    k.dp = Some(Dataplane::open(&k.cfg)?);
    let took = started.elapsed();
    let dp = k.dp();
    match dp.upgrade() {
        Upgrade::Done { from, steps } => {
            ensure!(from.as_bytes() == OTHER_BUILD, "{from}");
            ensure!(steps.len() >= 14, "{steps:?}");
        }
        u => bail!("not upgraded: {u:?}"),
    }
    ensure!(dp.programs_build() == meshwarp_bpf::BUILD_ID);
    all_new(&running_programs(&dir)?, &old)?;
    ensure!(stray_pins(&dir).is_empty(), "{:?}", stray_pins(&dir));
    ensure!(dp.pairs() == vec![bed.pair], "rules kept");
    for c in &cookies {
        ensure!(dp.socket_link(*c)?.is_some(), "a connection open across the upgrade left the fast path");
    }

    thread::sleep(Duration::from_millis(500));
    let (r0, c0) = (requests.load(Ordering::Relaxed), connections.load(Ordering::Relaxed));
    thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().map_err(|_| anyhow::anyhow!("worker panicked"))??;
    }
    let (r1, c1) = (requests.load(Ordering::Relaxed), connections.load(Ordering::Relaxed));
    ensure!(r1 > r0 && c1 > c0, "traffic kept flowing after the upgrade: {r0}->{r1} requests, {c0}->{c1} connections");
    ensure!(at_stop > 0, "traffic flowed before the upgrade");
    fresh_connection_is_redirected(dp, &bed, 7)?;
    eprintln!("upgrade took {took:?}; {r1} requests on 4 connections and {c1} new connections, 0 failed");
    Ok(())
}

/// Two pods and their pair, and the steps an upgrade of this data path takes
/// (learnt by doing one).
/// Opens the data path with upgrade step `step` failing: the upgrade is
/// reported failed, and why.
fn open_failing_at(k: &mut KernelTest, step: &str) -> Result<String> {
    inject_fault(Some(&format!("fail:{step}")));
    let opened = Dataplane::open(&k.cfg);
    inject_fault(None);
    k.dp = Some(opened?);
    match k.dp().upgrade() {
        Upgrade::Failed { reason } => Ok(reason.clone()),
        u => bail!("failing at {step}: {u:?}"),
    }
}

fn learn_steps(k: &mut KernelTest) -> Result<(Bed, PathBuf, Vec<String>)> {
    let bed = Bed::new(k.dp())?;
    let dir = k.dp().pin_dir().to_path_buf();
    drop(k.dp.take());
    mark_other_build(&dir.join("maps"))?;
    k.dp = Some(Dataplane::open(&k.cfg)?);
    let Upgrade::Done { steps, .. } = k.dp().upgrade().clone() else { bail!("{:?}", k.dp().upgrade()) };
    Ok((bed, dir, steps))
}

/// Learns the steps of an upgrade, then makes each fail in turn: the
/// programs that run afterwards are exactly the ones before, nothing stray
/// is pinned, and connections are still redirected.
#[test]
fn a_failed_upgrade_step_puts_every_earlier_step_back() -> Result<()> {
    let mut k = kernel_test!(1024);
    let (bed, dir, steps) = learn_steps(&mut k)?;
    let mut live = bed.connect()?;
    let mut pattern = Pattern::new(1);
    for want in
        ["mw_build (upgrading)", "mw_ch_conn[", "mw_ch_msg[", "mw_sockmap sk_msg", "link mw_sockops", "pin mw_park"]
    {
        ensure!(steps.iter().any(|s| s.starts_with(want)), "no step {want}: {steps:?}");
    }
    for step in &fault_points(&steps) {
        drop(k.dp.take());
        mark_other_build(&dir.join("maps"))?;
        let before = running_programs(&dir)?;
        let reason = open_failing_at(&mut k, step)?;
        let named = step.split('/').next().unwrap_or_default();
        ensure!(reason.contains(named), "{step}: {reason}");
        ensure!(running_programs(&dir)? == before, "step {step} left programs changed");
        ensure!(k.dp().programs_build().as_bytes() == OTHER_BUILD, "step {step}: build id changed");
        ensure!(stray_pins(&dir).is_empty(), "step {step}: {:?}", stray_pins(&dir));
        ping(&mut live, &mut pattern, 4096).with_context(|| format!("after failing {step}"))?;
        fresh_connection_is_redirected(k.dp(), &bed, 10)?;
    }
    Ok(())
}

/// An older build pinned no connection-list program (mw_conns_tcp, and
/// mw_conns where the kernel loads it, came later): the upgrade pins this
/// build's, and the list works. Failed at that step, the upgrade unpins it
/// again, the data path still opens and forwards, and the list says why it
/// cannot answer.
#[test]
fn an_upgrade_adds_the_programs_an_older_build_lacked() -> Result<()> {
    let mut k = kernel_test!(1024);
    let bed = Bed::new(k.dp())?;
    let dir = k.dp().pin_dir().to_path_buf();
    let list_progs = [names::PROG_CONNS, names::PROG_CONNS_TCP];
    let source = k.dp().connection_source();
    ensure!(source.is_some(), "a fresh load pins a connection-list program");
    let mut live = bed.connect()?;
    let mut pattern = Pattern::new(3);
    ping(&mut live, &mut pattern, 1000)?;
    let listed = |dp: &Dataplane| -> Result<usize> {
        let filter = meshwarp_core::ConnFilter { port: Some(PORT), ..Default::default() };
        Ok(dp.connections(&filter)?.len())
    };
    ensure!(listed(k.dp())? == 2, "both ends of the live connection");

    let as_older_build = |k: &mut KernelTest| -> Result<()> {
        drop(k.dp.take());
        for p in list_progs {
            let _ = std::fs::remove_file(dir.join("progs").join(p));
        }
        mark_other_build(&dir.join("maps"))
    };
    // Failed where the pin is added: put back to the older build's pins.
    as_older_build(&mut k)?;
    open_failing_at(&mut k, &format!("pin {}", names::PROG_CONNS_TCP))?;
    ensure!(list_progs.iter().all(|p| !dir.join("progs").join(p).exists()), "a failed upgrade left a new pin");
    ensure!(k.dp().connection_source().is_none());
    let err = k.dp().connections(&meshwarp_core::ConnFilter::default()).unwrap_err().to_string();
    ensure!(err.contains("no connection-list program"), "{err}");
    ping(&mut live, &mut pattern, 1000)?;
    fresh_connection_is_redirected(k.dp(), &bed, 40)?;

    // Upgraded: the pins are there and the list reads them.
    as_older_build(&mut k)?;
    k.dp = Some(Dataplane::open(&k.cfg)?);
    let Upgrade::Done { steps, .. } = k.dp().upgrade().clone() else { bail!("{:?}", k.dp().upgrade()) };
    ensure!(steps.contains(&format!("pin {}", names::PROG_CONNS_TCP)), "{steps:?}");
    ensure!(k.dp().connection_source() == source, "{:?} against {source:?}", k.dp().connection_source());
    ensure!(stray_pins(&dir).is_empty(), "{:?}", stray_pins(&dir));
    ping(&mut live, &mut pattern, 1000)?;
    ensure!(listed(k.dp())? == 2, "both ends of the live connection, after the upgrade");
    Ok(())
}

/// An older build pinned none of the maps this build adds
/// (`names::SOCKREDIR_ADDED_MAPS`: `mw_readers`, `mw_joins`): its instance is
/// not partial, and the upgrade creates and pins them before changing any
/// program. Failed at the last of those steps, the upgrade unpins them again
/// and the older programs run on as they were; upgraded, the maps are there
/// and connections are redirected.
#[test]
fn an_upgrade_adds_the_maps_an_older_build_lacked() -> Result<()> {
    let mut k = kernel_test!(1024);
    let bed = Bed::new(k.dp())?;
    let dir = k.dp().pin_dir().to_path_buf();
    let added: Vec<_> = names::SOCKREDIR_ADDED_MAPS.iter().map(|m| dir.join("maps").join(m)).collect();
    for m in &added {
        ensure!(m.exists(), "a fresh load pins {}", m.display());
    }
    let mut live = bed.connect()?;
    let mut pattern = Pattern::new(5);
    ping(&mut live, &mut pattern, 1000)?;
    let as_older_build = |k: &mut KernelTest| -> Result<()> {
        drop(k.dp.take());
        for m in &added {
            std::fs::remove_file(m)?;
        }
        mark_other_build(&dir.join("maps"))
    };
    let steps_wanted: Vec<String> = names::SOCKREDIR_ADDED_MAPS.iter().map(|m| format!("pin map {m}")).collect();
    let last = steps_wanted.last().context("added maps")?.clone();

    // Failed right after the last one was pinned: all unpinned again.
    as_older_build(&mut k)?;
    let before = running_programs(&dir)?;
    let reason = open_failing_at(&mut k, &last)?;
    ensure!(reason.contains(&last), "{reason}");
    ensure!(added.iter().all(|m| !m.exists()), "a failed upgrade left a new map pinned");
    ensure!(running_programs(&dir)? == before, "a failed upgrade left programs changed");
    ping(&mut live, &mut pattern, 1000)?;
    fresh_connection_is_redirected(k.dp(), &bed, 50)?;

    // Upgraded: the maps are pinned first, then the programs are this build's.
    drop(k.dp.take());
    k.dp = Some(Dataplane::open(&k.cfg)?);
    let Upgrade::Done { steps, .. } = k.dp().upgrade().clone() else { bail!("{:?}", k.dp().upgrade()) };
    ensure!(
        steps.get(1..=steps_wanted.len()) == Some(&steps_wanted[..]),
        "pinned right after marking the instance: {steps:?}"
    );
    for m in &added {
        ensure!(m.exists(), "{} pinned", m.display());
    }
    ensure!(stray_pins(&dir).is_empty(), "{:?}", stray_pins(&dir));
    ping(&mut live, &mut pattern, 1000)?;
    fresh_connection_is_redirected(k.dp(), &bed, 60)?;
    Ok(())
}

/// Programs of another build may have run the latency monitor on maps this
/// build created and marked clean (an older build keeps config flags it does
/// not know): once upgraded, a reused rule id forgets that monitor's
/// histograms again.
#[test]
fn after_another_builds_programs_a_reused_rule_id_forgets_their_histograms() -> Result<()> {
    let mut k = kernel_test!(1024);
    let bed = Bed::new(k.dp())?;
    let dir = k.dp().pin_dir().to_path_buf();
    let config = TypedMap::<u32, Config>::pinned(&dir.join("maps"), names::MAP_CONFIG)?;
    let flags = || -> Result<u32> { Ok(config.get(&0)?.unwrap_or_default().flags) };
    ensure!(flags()? & CFG_LAT_CLEAN != 0, "a data path just loaded is marked clean");
    let id = k.dp().rule_id(&bed.pair)?;

    // The other build: its monitor records, and the mark stays.
    k.dp().latency().set_sampling(LatencySampling::Every)?;
    k.dp().latency().set(&LatencyScope::All, false)?;
    let mut c = bed.connect()?;
    ping(&mut c, &mut Pattern::new(5), 100)?;
    k.dp().latency().set(&LatencyScope::Off, false)?;
    drop(c);
    ensure!(!k.dp().latency().histograms(&BTreeSet::from([id]))?.is_empty(), "recorded");
    let mut cfg = config.get(&0)?.unwrap_or_default();
    cfg.flags |= CFG_LAT_CLEAN;
    config.put(&0, &cfg)?;
    drop(k.dp.take());
    mark_other_build(&dir.join("maps"))?;

    k.dp = Some(Dataplane::open(&k.cfg)?);
    ensure!(matches!(k.dp().upgrade(), Upgrade::Done { .. }), "{:?}", k.dp().upgrade());
    ensure!(flags()? & CFG_LAT_CLEAN == 0, "the mark is taken off after another build's programs");
    k.dp().remove(&bed.pair)?;
    let again = EndpointPair::new(bed.net.pods[0].addr(false), Endpoint::new(bed.net.pods[1].addr(false), PORT + 1))?;
    k.dp().insert(&again, "test")?;
    ensure!(k.dp().rule_id(&again)? == id, "the freed id is given again");
    ensure!(k.dp().latency().histograms(&BTreeSet::from([id]))?.is_empty(), "no histograms carried over");
    Ok(())
}

#[test]
fn a_process_killed_at_any_upgrade_step_leaves_a_working_data_path() -> Result<()> {
    // The child: adopts the parent's pins and is killed by the injected
    // fault during the upgrade.
    if let Some(cfg) = child_dataplane_config() {
        let dp = Dataplane::open(&cfg)?;
        bail!("the child was not killed during its upgrade: {:?}", dp.upgrade());
    }
    let mut k = kernel_test!(1024);
    let (bed, dir, steps) = learn_steps(&mut k)?;
    let mut live = bed.connect()?;
    let mut pattern = Pattern::new(2);
    let exe = std::env::current_exe()?;
    for step in &fault_points(&steps) {
        drop(k.dp.take());
        mark_other_build(&dir.join("maps"))?;
        let old = running_programs(&dir)?;
        let status = child_test(&exe, "a_process_killed_at_any_upgrade_step_leaves_a_working_data_path", &k.cfg)
            .env("MESHWARP_FAULT", format!("kill:{step}"))
            .status()?;
        ensure!(status.signal() == Some(libc::SIGKILL), "child at {step}: {status:?}");
        // Cut short, the instance says no build: whichever opens it next (an
        // older one rolling back too) finishes the job.
        let marked = meshwarp_core::upgrade::programs_build(&dir.join("maps"))?;
        ensure!(marked.is_empty() == (step != names::MAP_BUILD), "killed after {step}, build id {marked:?}");
        if step.ends_with("/pinned") {
            ensure!(!stray_pins(&dir).is_empty(), "killed between pinning and renaming, {step} left no next- pin");
        }
        // Killed half-way: the data path still forwards, old connections and new.
        ping(&mut live, &mut pattern, 4096).with_context(|| format!("killed after {step}"))?;
        let s = bed.connect()?;
        echo_integrity(s, 20, 64 * 1024, T).with_context(|| format!("new connection, killed after {step}"))?;
        // The next opener finishes the upgrade (killed after the last
        // step, the build id: it was complete).
        k.dp = Some(Dataplane::open(&k.cfg)?);
        let done = matches!(k.dp().upgrade(), Upgrade::Done { .. });
        ensure!(done == (step != names::MAP_BUILD), "after {step}: {:?}", k.dp().upgrade());
        ensure!(k.dp().programs_build() == meshwarp_bpf::BUILD_ID);
        all_new(&running_programs(&dir)?, &old).with_context(|| format!("killed after {step}"))?;
        ensure!(stray_pins(&dir).is_empty(), "after {step}: {:?}", stray_pins(&dir));
        fresh_connection_is_redirected(k.dp(), &bed, 30)?;
    }
    Ok(())
}

/// The path a new pin schema needs, `meshwarp uninstall`, while redirected
/// bytes wait unread in a receiver's queue: the connection carries on over
/// TCP and its reader still gets every byte, in order, both ways.
#[test]
fn uninstall_under_traffic_loses_no_byte() -> Result<()> {
    let mut k = kernel_test!(1024);
    let net = NodeWithPods::new(2)?;
    let listener = net.pods[1].ns.listen(SocketAddr::new(net.pods[1].addr(false), PORT))?;
    let pair = EndpointPair::new(net.pods[0].addr(false), Endpoint::new(net.pods[1].addr(false), PORT))?
        .with_mode(FastPathMode::Always);
    k.dp().insert(&pair, "test")?;
    let mut conns = Vec::new();
    for _ in 0..8 {
        let c = net.pods[0].ns.connect(SocketAddr::new(net.pods[1].addr(false), PORT))?;
        let s = meshwarp_testbed::accept_timeout(&listener, T)?;
        for x in [&c, &s] {
            x.set_read_timeout(Some(T))?;
            x.set_write_timeout(Some(T))?;
        }
        ensure!(k.dp().socket_link(socket_cookie_of(&c)?)?.is_some(), "accelerated before the uninstall");
        conns.push((c, s));
    }
    let len = 8 << 20;
    let mut threads = Vec::new();
    // Readers start once the data path is gone (not after a fixed time, which
    // a slow uninstall outlasts): redirected bytes wait unread through it.
    let uninstalled = Arc::new(AtomicBool::new(false));
    let after_uninstall = |go: Arc<AtomicBool>| meshwarp_core::sys::wait_for(T, || go.load(Ordering::Acquire));
    for (i, (c, s)) in conns.into_iter().enumerate() {
        let seed = i as u64 * 2;
        let (c2, s2) = (c.try_clone()?, s.try_clone()?);
        threads.push(thread::spawn(move || meshwarp_testbed::send_pattern(&c, seed, len).map(|_| ())));
        threads.push(thread::spawn(move || meshwarp_testbed::send_pattern(&s, seed + 1, len).map(|_| ())));
        let go = Arc::clone(&uninstalled);
        threads.push(thread::spawn(move || {
            after_uninstall(go);
            meshwarp_testbed::recv_pattern(&s2, seed, len).map(|_| ()).map_err(std::io::Error::other)
        }));
        let go = Arc::clone(&uninstalled);
        threads.push(thread::spawn(move || {
            after_uninstall(go);
            meshwarp_testbed::recv_pattern(&c2, seed + 1, len).map(|_| ()).map_err(std::io::Error::other)
        }));
    }
    let redirected = || k.dp().stats(&pair).map_or(0, |st| st.redirected_bytes);
    ensure!(
        meshwarp_core::sys::wait_for(T, || redirected() > 0),
        "bytes were redirected (and wait unread) before the uninstall"
    );
    let queued = redirected();
    let pin_root = k.cfg.pin_root.clone();
    drop(k.dp.take());
    let veths = net.veth_bytes(0)? + net.veth_bytes(1)?;
    let gone = meshwarp_core::node::uninstall(&pin_root);
    uninstalled.store(true, Ordering::Release);
    gone?;
    for t in threads {
        t.join().map_err(|_| anyhow::anyhow!("stream thread panicked"))??;
    }
    let crossed = net.veth_bytes(0)? + net.veth_bytes(1)? - veths;
    eprintln!(
        "{queued} bytes redirected before the uninstall; {crossed} bytes crossed the veths after it (of {} sent)",
        16 * len
    );
    Ok(())
}

/// Pins another schema left (here: this build's, renamed to the schema
/// before it, links attached) make the data path refuse to start, as the
/// error says, until `meshwarp uninstall` — which removes them, detaching
/// their programs, so the next start loads afresh and redirects.
#[test]
fn uninstall_removes_the_pins_of_another_schema() -> Result<()> {
    let mut k = kernel_test!(1024);
    let bed = Bed::new(k.dp())?;
    fresh_connection_is_redirected(k.dp(), &bed, 40).context("before")?;
    let dir = k.dp().pin_dir().to_path_buf();
    let old: Vec<u32> = running_programs(&dir)?.into_values().collect();
    drop(k.dp.take());
    let ours = meshwarp_bpf::shared::SCHEMA_VERSION;
    let other = k.cfg.pin_root.join(format!("v{}", ours - 1));
    std::fs::rename(&dir, &other)?;
    match Dataplane::open(&k.cfg) {
        Err(meshwarp_core::dataplane::DataplaneError::Schema { found, .. }) => {
            ensure!(found == format!("v{}", ours - 1), "found {found}")
        }
        other => bail!("opened next to another schema's pins: {other:?}"),
    }
    meshwarp_core::node::uninstall(&k.cfg.pin_root)?;
    ensure!(!other.exists(), "{} is still there", other.display());
    // Its programs go once nothing holds them (freed after an RCU grace period).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let loaded: Vec<u32> =
            libbpf_rs::query::ProgInfoIter::default().map(|p| p.id).filter(|id| old.contains(id)).collect();
        if loaded.is_empty() {
            break;
        }
        ensure!(Instant::now() < deadline, "programs {loaded:?} of the removed schema are still loaded");
        thread::sleep(Duration::from_millis(50));
    }
    k.dp = Some(Dataplane::open(&k.cfg)?);
    k.dp().insert(&bed.pair, "test")?;
    // The echo server listened before this data path was loaded: its first
    // connection teaches the reader guard who reads it (TCP, reason
    // "reader"); the next one is redirected.
    let first = bed.connect()?;
    echo_integrity(first, 42, 4096, T)?;
    fresh_connection_is_redirected(k.dp(), &bed, 41).context("after the uninstall, loaded afresh")
}
