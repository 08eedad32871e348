//! The adaptive fast path on a real kernel: a direction that streams small
//! writes with Nagle on (or up to 32 KiB into a reader that keeps up, or
//! nodelay, with a reader that falls behind, or
//! large writes further ahead of their reader than TCP's buffers would let
//! them) moves to TCP and comes back when a new exchange
//! starts and every TCP byte was read; the modes `always` and `never`; and
//! checksummed streams in both directions while directions move back and
//! forth (nothing lost, duplicated or reordered); a Nagle stream whose
//! reader is busy copying out, and a nodelay run's first message or
//! pipelined request (4 KiB or more, the peer's answer unread) into a peer
//! holding its lock, send on TCP rather than wait for that lock.
//!
//! Each test fails (never skips) when CI=true and BPF is refused.

#![allow(clippy::unwrap_used)]

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use meshwarp_bpf::shared::{Short, DIR_UNLINKED, DIR_UNLINK_REQ, EF_PARKED, END_SERVER};
use meshwarp_core::{Dataplane, EndpointPair, FastPathMode, PathNow, RuleCounters, TcpReason};
use meshwarp_testbed::{
    accept_timeout, expect_zerocopy_completions, fionread_reader, read_exact_ready, set_zerocopy, write_all_ready,
    zerocopy_pattern, zerocopy_transfer, HeldThread, KernelTest, NodeWithPods,
};

const T: Option<Duration> = Some(Duration::from_secs(60));

macro_rules! kernel_test {
    () => {
        match KernelTest::start(1024) {
            Some(k) => k,
            None => return Ok(()),
        }
    };
}

/// Byte `i` of stream `seed`: any loss, duplicate or reorder changes what
/// the reader sees at some offset.
fn pattern_byte(seed: u64, i: u64) -> u8 {
    let x = (i ^ seed.rotate_left(17)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (x >> 56) as u8
}

/// One direction of a connection: what was written or read so far.
struct Stream {
    seed: u64,
    at: u64,
}

impl Stream {
    fn new(seed: u64) -> Self {
        Self { seed, at: 0 }
    }

    /// Writes `len` bytes in writes of `chunk` (one sk_msg message each).
    fn write(&mut self, mut s: &TcpStream, len: usize, chunk: usize) -> Result<()> {
        let mut left = len;
        while left > 0 {
            let n = left.min(chunk);
            let buf: Vec<u8> = (0..n as u64).map(|i| pattern_byte(self.seed, self.at + i)).collect();
            write_all_ready(&mut s, &buf, T).with_context(|| format!("writing stream {} at {}", self.seed, self.at))?;
            self.at += n as u64;
            left -= n;
        }
        Ok(())
    }

    /// Reads exactly `len` bytes and checks each.
    fn read(&mut self, mut s: &TcpStream, len: usize) -> Result<()> {
        let mut buf = vec![0u8; len];
        read_exact_ready(&mut s, &mut buf, T)
            .with_context(|| format!("reading stream {} at {}", self.seed, self.at))?;
        for (i, b) in buf.iter().enumerate() {
            let want = pattern_byte(self.seed, self.at + i as u64);
            ensure!(*b == want, "stream {}: wrong byte at offset {}", self.seed, self.at + i as u64);
        }
        self.at += len as u64;
        Ok(())
    }
}

fn pods_pair(k: &KernelTest, port: u16, mode: FastPathMode) -> Result<(NodeWithPods, TcpListener, EndpointPair)> {
    pods_pair_with(k, port, |p| p.with_mode(mode))
}

/// pod 0 -> pod 1's listener on `port`, the pair (as `rule` makes it) registered.
fn pods_pair_with(
    k: &KernelTest,
    port: u16,
    rule: impl FnOnce(EndpointPair) -> EndpointPair,
) -> Result<(NodeWithPods, TcpListener, EndpointPair)> {
    let net = NodeWithPods::new(2)?;
    let addr = SocketAddr::new(net.pods[1].addr(false), port);
    let l = net.pods[1].ns.listen(addr)?;
    let pair = rule(EndpointPair::new(net.pods[0].addr(false), addr.into())?);
    k.dp().insert(&pair, "test")?;
    Ok((net, l, pair))
}

/// An adaptive pair whose server end is never a target (a splicing proxy).
fn pods_pair_server_no_target(k: &KernelTest, port: u16) -> Result<(NodeWithPods, TcpListener, EndpointPair)> {
    pods_pair_with(k, port, |p| {
        p.with_mode(FastPathMode::Adaptive)
            .never_redirect_into(meshwarp_core::NeverRedirectInto { client: false, server: true })
    })
}

/// `n` connections from pod 0 to pod 1's listener `l` on `port`, Nagle on
/// (client end, server end).
fn connections(net: &NodeWithPods, l: &TcpListener, port: u16, n: usize) -> Result<Vec<(TcpStream, TcpStream)>> {
    connections_from(&net.pods[0].ns, l, SocketAddr::new(net.pods[1].addr(false), port), n)
}

/// `n` connections from `ns` to `to`, accepted by `l`, Nagle on.
fn connections_from(
    ns: &meshwarp_testbed::NetNs,
    l: &TcpListener,
    to: SocketAddr,
    n: usize,
) -> Result<Vec<(TcpStream, TcpStream)>> {
    (0..n)
        .map(|_| {
            let c = ns.connect(to)?;
            c.set_nodelay(false)?;
            Ok((c, accept_timeout(l, Duration::from_secs(60))?))
        })
        .collect()
}

/// A one-way stream of `len` bytes in `chunk`-byte writes (Nagle on), read
/// concurrently by the other end.
fn stream_one_way(
    c: &TcpStream,
    s: &TcpStream,
    up: &mut Stream,
    down: &mut Stream,
    len: usize,
    chunk: usize,
) -> Result<()> {
    thread::scope(|scope| {
        let reader = scope.spawn(|| down.read(s, len));
        up.write(c, len, chunk)?;
        reader.join().unwrap()
    })
}

/// Nagle on, 3 KiB writes, no reply: the client's direction moves to
/// TCP. After the server answers, the next request goes on the fast path
/// again, since the server had read every TCP byte; that request starts a
/// new run, judged on its own writes (not the last run's), so the same
/// stream, even unread, moves to TCP again. Every byte checked. (Short
/// enough that the client stays in the SOCKMAP: see the unlink tests.)
#[test]
fn a_small_write_stream_is_demoted_then_promoted() -> Result<()> {
    const W: usize = 3 << 10;
    let k = kernel_test!();
    let (net, l, pair) = pods_pair(&k, 8201, FastPathMode::Adaptive)?;
    let (c, s) = connections(&net, &l, 8201, 1)?.remove(0);
    ensure!(k.dp().socket_link(meshwarp_core::sys::socket_cookie_of(&c)?)?.is_some(), "accelerated");
    let (mut up_w, mut up_r) = (Stream::new(1), Stream::new(1));
    let (mut down_w, mut down_r) = (Stream::new(2), Stream::new(2));

    // Demoted at message 64 (MW_POLICY_COALESCE), one check after it at 80.
    stream_one_way(&c, &s, &mut up_w, &mut up_r, 80 * W, W)?;
    let st = k.dp().stats(&pair)?;
    ensure!(st.demotions_coalesce == 1 && st.unlinks == 0, "the stream was demoted once: {st:?}");
    ensure!(st.policy_tcp_msgs > 0 && st.redirected_msgs >= 63, "{st:?}");
    // Bytes sent on TCP after the demotion: the rest of the stream.
    ensure!(st.redirected_bytes <= 64 * W as u64, "{st:?}");

    // The server answers; the client's next request starts a new exchange.
    down_w.write(&s, 64, 64)?;
    down_r.read(&c, 64)?;
    let before = k.dp().stats(&pair)?;
    up_w.write(&c, 100, 100)?;
    up_r.read(&s, 100)?;
    let after = k.dp().stats(&pair)?;
    ensure!(after.promotions == 1, "promoted once the server read every TCP byte: {after:?}");
    ensure!(after.redirected_bytes == before.redirected_bytes + 100, "the request was redirected: {after:?}");

    // 79 more writes, corked, unread until the end: small writes (100 B + 7
    // x 3 KiB in the new run's first 8) move to TCP whether their reader
    // keeps up or not. Counted with the last run's 8 x 3 KiB, they would pass
    // for larger writes into a reader behind, and stay. (Corked: Nagle alone,
    // now that the server has redirected to the client, would stay up to
    // MW_POLICY_DELACK messages; an uncork pushes a corked tail at once.)
    write_corked(&mut up_w, &c, 79 * W, W)?;
    let st = k.dp().stats(&pair)?;
    ensure!(st.demotions_coalesce == 2, "the new run was demoted too: {st:?}");
    // The request was the run's message 1: its writes 1..=62 redirected.
    ensure!(st.redirected_msgs == after.redirected_msgs + 62, "demoted at the run's message 64: {st:?}");
    up_r.read(&s, 79 * W)?;
    Ok(())
}

/// `w.write` with TCP_CORK on, then off (which pushes what TCP held).
fn write_corked(w: &mut Stream, to: &TcpStream, len: usize, chunk: usize) -> Result<()> {
    let sock = socket2::SockRef::from(to);
    sock.set_tcp_cork(true).context("TCP_CORK on")?;
    w.write(to, len, chunk)?;
    sock.set_tcp_cork(false).context("TCP_CORK off")
}

/// Pipelined bursts (a redis client's): 48 small Nagle requests written back
/// to back, each answered as the server (one thread throughout) reads it, the
/// answers read after the burst. A burst is no stream: it stays on the fast
/// path both ways (split between the paths, its TCP tail would wait on
/// delayed acknowledgments), every burst. Runs of 100 each way (the server
/// reads once all are written) stay too: on TCP, Nagle would hold their
/// tails for delayed acknowledgments. Runs of 2 100 each way move to TCP at
/// message 2 048 (`MW_POLICY_DELACK`), and the bursts after them still
/// arrive whole. Every byte checked.
#[test]
fn pipelined_bursts_stay_on_the_fast_path() -> Result<()> {
    const K: usize = 48;
    let k = kernel_test!();
    let (net, l, pair) = pods_pair(&k, 8214, FastPathMode::Adaptive)?;
    let (c, s) = connections(&net, &l, 8214, 1)?.remove(0);
    let (mut up_w, mut down_r) = (Stream::new(51), Stream::new(52));
    let (todo, bursts) = std::sync::mpsc::channel::<usize>();
    thread::scope(|scope| -> Result<()> {
        // One reading thread, as a server's event loop (a reader of several
        // threads would be another case of the policy).
        let server = scope.spawn(|| -> Result<()> {
            let (mut up_r, mut down_w) = (Stream::new(51), Stream::new(52));
            for n in bursts {
                for _ in 0..n {
                    up_r.read(&s, 64)?;
                    down_w.write(&s, 64, 64)?;
                }
            }
            Ok(())
        });
        // `written`: the server is told of the burst once it is all written.
        let mut burst = |n: usize, written: bool| -> Result<()> {
            if !written {
                todo.send(n)?;
            }
            for _ in 0..n {
                up_w.write(&c, 64, 64)?;
            }
            if written {
                todo.send(n)?;
            }
            down_r.read(&c, 64 * n)
        };
        let mut run = || -> Result<()> {
            for _ in 0..20 {
                burst(K, false)?;
            }
            let st = k.dp().stats(&pair)?;
            ensure!(st.demotions_coalesce == 0 && st.policy_tcp_msgs == 0 && st.fallback_reader_busy == 0, "{st:?}");
            ensure!(st.redirected_msgs == 2 * 20 * K as u64, "every request and answer redirected: {st:?}");
            burst(100, true)?;
            let st = k.dp().stats(&pair)?;
            ensure!(st.demotions_coalesce == 0, "runs of 100 (requests, then answers) stayed: {st:?}");
            ensure!(st.redirected_msgs == 2 * (20 * K as u64 + 100), "every request and answer redirected: {st:?}");
            let before = k.dp().stats(&pair)?;
            burst(2100, true)?;
            let st = k.dp().stats(&pair)?;
            ensure!(st.demotions_coalesce == 2, "both runs of 2 100 (requests, then answers) moved to TCP: {st:?}");
            ensure!(st.redirected_msgs == before.redirected_msgs + 2 * 2047, "each moved at its message 2 048: {st:?}");
            for _ in 0..3 {
                burst(K, false)?;
            }
            Ok(())
        };
        let result = run();
        drop(todo);
        server.join().unwrap()?;
        result
    })
}

/// A server that is never a target (the rule's here; a splicing proxy in
/// life) answers small requests with small Nagle writes on one keep-alive
/// connection. Its client's requests come on TCP without passing the policy
/// (the client sits in mw_tgtmap, no sk_msg), so only the server's reads of
/// them can end its runs: 200 exchanges, every answer redirected, none of
/// them taken for a stream.
#[test]
fn answers_to_a_client_that_sends_on_tcp_stay_on_the_fast_path() -> Result<()> {
    const N: u64 = 200;
    let k = kernel_test!();
    let (net, l, pair) = pods_pair_server_no_target(&k, 8230)?;
    let (c, s) = connections(&net, &l, 8230, 1)?.remove(0);
    let (mut up_w, mut up_r) = (Stream::new(71), Stream::new(71));
    let (mut down_w, mut down_r) = (Stream::new(72), Stream::new(72));
    for _ in 0..N {
        up_w.write(&c, 64, 64)?;
        up_r.read(&s, 64)?;
        down_w.write(&s, 64, 64)?;
        down_r.read(&c, 64)?;
    }
    let st = k.dp().stats(&pair)?;
    ensure!(st.tgtmap_clients == 1, "the client runs no sk_msg: {st:?}");
    ensure!(st.demotions_coalesce == 0 && st.demotions_behind == 0 && st.policy_tcp_msgs == 0, "{st:?}");
    ensure!(st.redirected_msgs == N, "every answer redirected: {st:?}");
    Ok(())
}

/// The same server streams small Nagle writes to that client: it moves to
/// TCP and leaves the SOCKMAP. The client's next request comes on TCP (it
/// runs no sk_msg to ask for the server's relink), so the server's read of it
/// asks: the server goes back, and its answers are redirected again once the
/// client has read every TCP byte. Every byte checked.
#[test]
fn a_server_unlinked_by_its_stream_comes_back_when_a_tcp_client_asks_again() -> Result<()> {
    let k = kernel_test!();
    let (net, l, pair) = pods_pair_server_no_target(&k, 8231)?;
    let (c, s) = connections(&net, &l, 8231, 1)?.remove(0);
    let (mut up_w, mut up_r) = (Stream::new(73), Stream::new(73));
    let (mut down_w, mut down_r) = (Stream::new(74), Stream::new(74));

    stream_one_way(&s, &c, &mut down_w, &mut down_r, 1 << 20, 512)?;
    let st = wait_counters(&k, &pair, "the streaming server end was unlinked", |c| c.unlinks == 1)?;
    ensure!(st.demotions_coalesce == 1 && st.relinks == 0 && st.tgtmap_clients == 1, "{st:?}");

    up_w.write(&c, 64, 64)?;
    up_r.read(&s, 64)?;
    let st = wait_counters(&k, &pair, "the server end was relinked", |c| c.relinks == 1)?;
    for _ in 0..3 {
        down_w.write(&s, 100, 100)?;
        down_r.read(&c, 100)?;
        up_w.write(&c, 100, 100)?;
        up_r.read(&s, 100)?;
    }
    let after = k.dp().stats(&pair)?;
    ensure!(after.promotions >= 1, "promoted after the relink: {after:?}");
    ensure!(after.redirected_bytes >= st.redirected_bytes + 200, "answers redirected again: {after:?}");
    Ok(())
}

/// A server end unlinked by its stream that then sets SO_ZEROCOPY (taken:
/// out of the SOCKMAP no sk_msg runs on its sends) stays out: the client's
/// next request does not put it back (in mw_sockmap tcp_bpf would number its
/// zero-copy completions wrong), and its completions are numbered as on
/// TCP. Every byte checked.
#[test]
fn an_unlinked_end_with_zero_copy_on_stays_out() -> Result<()> {
    let k = kernel_test!();
    let (net, l, pair) = pods_pair_server_no_target(&k, 8232)?;
    let (c, s) = connections(&net, &l, 8232, 1)?.remove(0);
    let (mut up_w, mut up_r) = (Stream::new(75), Stream::new(75));
    let (mut down_w, mut down_r) = (Stream::new(76), Stream::new(76));

    stream_one_way(&s, &c, &mut down_w, &mut down_r, 1 << 20, 512)?;
    wait_counters(&k, &pair, "the streaming server end was unlinked", |c| c.unlinks == 1)?;
    set_zerocopy(&s).context("SO_ZEROCOPY on an unlinked end")?;
    for _ in 0..3 {
        up_w.write(&c, 64, 64)?;
        up_r.read(&s, 64)?;
    }
    // The relink, asked by the server's read, would come within milliseconds.
    thread::sleep(Duration::from_millis(300));
    let data = zerocopy_pattern(2 << 20);
    let sent = zerocopy_transfer(&s, &c, &data, Duration::from_secs(60))?;
    expect_zerocopy_completions(&s, &sent)?;
    let st = k.dp().stats(&pair)?;
    ensure!(st.relinks == 0 && st.fallback_zerocopy == 1 && st.zerocopy_refused == 0, "{st:?}");
    Ok(())
}

/// Nagle on, 16 KiB writes (under MW_POLICY_BATCH, 32 KiB, so TCP would
/// gather them into larger segments): a stream whose reader keeps up (here
/// in lockstep) would wake it once per write on the fast path where TCP
/// wakes it once per segment, so it moves to TCP at message 64. The same
/// stream into a reader that has fallen behind (80 writes before it reads)
/// stays on the fast path: that reader takes many writes per read anyway.
/// Once such a reader catches up, the next check (every 16 messages) moves
/// the stream to TCP. Every byte checked.
#[test]
fn a_batched_stream_moves_to_tcp_only_while_its_reader_keeps_up() -> Result<()> {
    let k = kernel_test!();
    let (net, l, pair) = pods_pair(&k, 8215, FastPathMode::Adaptive)?;
    let mut conns = connections(&net, &l, 8215, 3)?;
    const W: usize = 16 << 10;

    let (c, s) = conns.remove(0);
    let (mut w, mut r) = (Stream::new(61), Stream::new(61));
    for _ in 0..80 {
        w.write(&c, W, W)?;
        r.read(&s, W)?;
    }
    let st = k.dp().stats(&pair)?;
    ensure!(st.demotions_coalesce == 1 && st.demotions_behind == 0, "a reader in lockstep: demoted: {st:?}");
    ensure!(st.redirected_msgs == 63, "demoted at message 64: {st:?}");

    let (c, s) = conns.remove(0);
    let (mut w, mut r) = (Stream::new(62), Stream::new(62));
    w.write(&c, 80 * W, W)?;
    r.read(&s, 80 * W)?;
    let after = k.dp().stats(&pair)?;
    ensure!(after.demotions_coalesce == 1 && after.demotions_behind == 0, "a reader behind: not demoted: {after:?}");
    ensure!(after.redirected_msgs == 63 + 80 && after.policy_tcp_msgs == st.policy_tcp_msgs, "{after:?}");

    // Behind at message 64, then caught up: the check at message 96 (the
    // 16th in lockstep) finds nothing unread and moves it to TCP.
    let (c, s) = conns.remove(0);
    let (mut w, mut r) = (Stream::new(63), Stream::new(63));
    w.write(&c, 80 * W, W)?;
    r.read(&s, 80 * W)?;
    for _ in 0..20 {
        w.write(&c, W, W)?;
        r.read(&s, W)?;
    }
    let caught_up = k.dp().stats(&pair)?;
    ensure!(caught_up.demotions_coalesce == 2, "a reader that caught up: demoted: {caught_up:?}");
    ensure!(caught_up.redirected_msgs == 63 + 80 + 80 + 15, "demoted at message 96: {caught_up:?}");
    Ok(())
}

/// Nodelay, 64-byte writes, no reply: TCP would not coalesce them, so the
/// direction stays on the fast path while its reader keeps up (here in
/// lockstep, hundreds of messages). Once the reader stops reading, the
/// redirected backlog grows past `MW_POLICY_BEHIND` (32) messages and, at
/// the next check (every 16 messages), the direction moves to TCP, which
/// sends a backlog as a few large segments. Every byte arrives in order: the
/// psock's queue is read before TCP's.
#[test]
fn a_nodelay_stream_moves_to_tcp_when_its_reader_falls_behind() -> Result<()> {
    let k = kernel_test!();
    let (net, l, pair) = pods_pair(&k, 8208, FastPathMode::Adaptive)?;
    let (c, s) = connections(&net, &l, 8208, 1)?.remove(0);
    c.set_nodelay(true)?;
    let (mut up_w, mut up_r) = (Stream::new(41), Stream::new(41));

    for _ in 0..400 {
        up_w.write(&c, 64, 64)?;
        up_r.read(&s, 64)?;
    }
    let st = k.dp().stats(&pair)?;
    ensure!(st.demotions_behind == 0 && st.demotions_coalesce == 0, "a reader in lockstep keeps it: {st:?}");
    ensure!(st.redirected_msgs == 400 && st.policy_tcp_msgs == 0, "{st:?}");

    // The same thread writes 320 more without reading (the psock queue
    // only charges its bytes, so nothing blocks), then reads them all.
    up_w.write(&c, 320 * 64, 64)?;
    let st = k.dp().stats(&pair)?;
    ensure!(st.demotions_behind == 1 && st.demotions_coalesce == 0, "demoted once, reader behind: {st:?}");
    ensure!(
        (400 + 32..=400 + 32 + 16).contains(&st.redirected_msgs),
        "demoted at the first check 32 messages behind: {st:?}"
    );
    up_r.read(&s, 320 * 64)?;
    Ok(())
}

/// Large writes (64 KiB, nodelay) stay on the fast path while their reader
/// keeps up. The psock queue takes everything a sender writes, where TCP
/// stops a sender once the receiver's window and its own send buffer are
/// full: once as many redirected bytes wait unread as those could hold at
/// most (`tcp_rmem[2]` of the reader's namespace + `tcp_wmem[2]` of the
/// writer's; here 2 + 1 MiB), the direction moves to TCP and its writer
/// feels TCP's backpressure again. Every byte arrives in order.
#[test]
fn a_large_write_stream_moves_to_tcp_once_tcp_would_have_stopped_it() -> Result<()> {
    const CHUNK: usize = 64 << 10;
    const AHEAD: u64 = 3 << 20;
    let k = kernel_test!();
    let (net, l, pair) = pods_pair(&k, 8210, FastPathMode::Adaptive)?;
    net.pods[1].ns.exec(&["sysctl", "-qw", "net.ipv4.tcp_rmem=4096 131072 2097152"])?;
    net.pods[0].ns.exec(&["sysctl", "-qw", "net.ipv4.tcp_wmem=4096 16384 1048576"])?;
    let (c, s) = connections(&net, &l, 8210, 1)?.remove(0);
    c.set_nodelay(true)?;
    // Reader and writer on one CPU: a reader on another CPU with bytes
    // unread would send the writes around it instead (see
    // a_large_write_stream_into_a_reader_on_another_cpu_moves_to_tcp).
    meshwarp_testbed::pin_to_one_cpu()?;
    let (mut up_w, mut up_r) = (Stream::new(49), Stream::new(49));
    for _ in 0..80 {
        up_w.write(&c, CHUNK, CHUNK)?;
        up_r.read(&s, CHUNK)?;
    }
    let st = k.dp().stats(&pair)?;
    ensure!(st.demotions_behind == 0 && st.policy_tcp_msgs == 0, "a reader that keeps up keeps it: {st:?}");
    let lockstep = st.redirected_bytes;
    ensure!(lockstep == 80 * CHUNK as u64, "5 MiB in lockstep, all redirected: {st:?}");

    // 16 MiB more while the reader waits: far more than TCP's buffers
    // hold, so the writer blocks once the direction took TCP.
    writes_ahead_until_demoted(&k, &pair, (&c, &mut up_w), (&s, &mut up_r), CHUNK, lockstep, AHEAD)?;
    let st = k.dp().stats(&pair)?;
    ensure!(st.demotions_behind == 1 && st.policy_tcp_msgs > 0, "{st:?}");
    Ok(())
}

/// A program that fixes its buffers (SO_RCVBUF on the reader, SO_SNDBUF on
/// the writer) bounds what TCP lets its connection hold: then the
/// redirected backlog of a large-write stream is bounded by those sizes
/// (256 + 128 KiB asked, doubled by the kernel: 768 KiB), not by the
/// namespaces' autotuning maximum (tens of MiB), and the direction moves to
/// TCP as soon as that many bytes wait unread.
#[test]
fn fixed_socket_buffers_bound_the_redirected_backlog() -> Result<()> {
    const CHUNK: usize = 64 << 10;
    let k = kernel_test!();
    let (net, l, pair) = pods_pair(&k, 8216, FastPathMode::Adaptive)?;
    let (c, s) = connections(&net, &l, 8216, 1)?.remove(0);
    c.set_nodelay(true)?;
    socket2::SockRef::from(&s).set_recv_buffer_size(256 << 10)?;
    socket2::SockRef::from(&c).set_send_buffer_size(128 << 10)?;
    let ahead_max =
        (socket2::SockRef::from(&s).recv_buffer_size()? + socket2::SockRef::from(&c).send_buffer_size()?) as u64;
    ensure!(ahead_max == 768 << 10, "the kernel doubles what is asked: {ahead_max}");
    // One CPU, as in a_large_write_stream_moves_to_tcp_once_tcp_would_have_stopped_it.
    meshwarp_testbed::pin_to_one_cpu()?;
    let (mut up_w, mut up_r) = (Stream::new(53), Stream::new(53));
    for _ in 0..40 {
        up_w.write(&c, CHUNK, CHUNK)?;
        up_r.read(&s, CHUNK)?;
    }
    let st = k.dp().stats(&pair)?;
    ensure!(
        st.demotions_behind == 0 && st.redirected_bytes == 40 * CHUNK as u64,
        "in lockstep, all redirected: {st:?}"
    );
    let lockstep = st.redirected_bytes;
    writes_ahead_until_demoted(&k, &pair, (&c, &mut up_w), (&s, &mut up_r), CHUNK, lockstep, ahead_max)
}

/// Large writes (16 KiB, nodelay) into a reader that runs on another CPU
/// and has redirected bytes still to read: a redirect would wait for the
/// reader's socket lock while it copies them out, and sk_msg copies a whole
/// write in before the reader can copy any of it out, where TCP lets both
/// copy at once. So such a message moves the direction to TCP
/// (`demotions_around`) for good, anywhere in a run (MW_POLICY_LARGE; a
/// run's first message too, as HTTP/2's multiplexed responses come): no
/// promotion at the next exchange, and once out of the SOCKMAP the end
/// stays out (a relink would cost every later response its first messages
/// again: nginx's 1 MiB responses 1.3x TCP's time, 1.0x with this). A
/// reader on the writer's CPU cannot copy while the writer runs: there
/// every message is redirected; in lockstep nothing is unread. Every byte
/// checked, in order (the psock's queue is read before TCP's).
#[test]
fn a_large_write_stream_into_a_reader_on_another_cpu_moves_to_tcp() -> Result<()> {
    const W: usize = 16 << 10;
    let Some(TwoCpus { k, net, l, pair, writer_cpu, other_cpu, .. }) = TwoCpus::start(8217)? else { return Ok(()) };
    let mut conns = connections(&net, &l, 8217, 4)?;
    let counters = |what: &str, redirected: u64, demoted: u64| -> Result<RuleCounters> {
        let st = k.dp().stats(&pair)?;
        ensure!(
            st.redirected_msgs == redirected
                && st.demotions_around == demoted
                && st.fallback_reader_busy == 0
                && st.promotions == 0
                && st.relinks == 0,
            "{what}: {st:?}"
        );
        Ok(st)
    };

    // The reader on the other CPU (one thread: a reader of several threads
    // publishes no psock reads, and its bytes always look unread).
    let (c, s) = conns.remove(0);
    c.set_nodelay(true)?;
    let mut up_w = Stream::new(61);
    let (mut dn_w, mut dn_r) = (Stream::new(161), Stream::new(161));
    pinned_reader(other_cpu, &s, Stream::new(61), |read| -> Result<()> {
        // Its first read tells where it runs.
        up_w.write(&c, W, W)?;
        read(W)?;
        // The 2nd finds nothing unread; the 3rd finds the 2nd unread on
        // the other CPU.
        up_w.write(&c, 8 * W, W)?;
        counters("the 3rd moved the stream to TCP", 2, 1)?;
        up_w.write(&c, W, W)?;
        read(9 * W)?;
        counters("the 10th follows it on TCP", 2, 1)?;
        // A new exchange, every byte read: the server's answer redirected
        // (the other direction), the client's next write on TCP, no
        // promotion; the client end leaves the SOCKMAP at that look (after
        // its read).
        dn_w.write(&s, 64, 64)?;
        dn_r.read(&c, 64)?;
        up_w.write(&c, W, W)?;
        read(W)?;
        wait_counters(&k, &pair, "the streaming client end was unlinked", |c| c.unlinks == 1)?;
        counters("still on TCP", 3, 1)?;
        // And stays out: the server's answers and the client's requests on
        // TCP, no relink asked.
        for _ in 0..3 {
            dn_w.write(&s, 64, 64)?;
            dn_r.read(&c, 64)?;
            up_w.write(&c, W, W)?;
            read(W)?;
        }
        // A relink, asked by the client's read, would come within
        // milliseconds.
        thread::sleep(Duration::from_millis(300));
        let st = counters("out for good", 3, 1)?;
        ensure!(st.unlinks == 1, "{st:?}");
        // Listed as such: the client's sends on TCP for good.
        let cookie = meshwarp_core::sys::socket_cookie_of(&c)?;
        let listed = k.dp().connections(&meshwarp_core::ConnFilter { cookie: Some(cookie), ..Default::default() })?;
        ensure!(listed.len() == 1 && listed[0].tx_path == PathNow::Tcp(TcpReason::Streamed), "{listed:#?}");
        Ok(())
    })?;

    // The reader on the writer's CPU: all redirected, unread or not.
    let (c, s) = conns.remove(0);
    c.set_nodelay(true)?;
    let mut up_w = Stream::new(62);
    pinned_reader(writer_cpu, &s, Stream::new(62), |read| -> Result<()> {
        up_w.write(&c, W, W)?;
        read(W)?;
        up_w.write(&c, 12 * W, W)?;
        read(12 * W)?;
        counters("a reader on the writer's CPU", 3 + 13, 1).map(drop)
    })?;

    // In lockstep (every message read before the next), nothing unread:
    // redirected however long the run (past message 64 too); the 68th
    // finds the 67th unread on the other CPU: the rest of the run on TCP,
    // read or not.
    let (c, s) = conns.remove(0);
    c.set_nodelay(true)?;
    let mut up_w = Stream::new(63);
    pinned_reader(other_cpu, &s, Stream::new(63), |read| -> Result<()> {
        for _ in 0..66 {
            up_w.write(&c, W, W)?;
            read(W)?;
        }
        counters("66 in lockstep", 16 + 66, 1)?;
        up_w.write(&c, 2 * W, W)?;
        counters("demoted", 16 + 67, 2)?;
        read(2 * W)?;
        up_w.write(&c, W, W)?;
        read(W)?;
        counters("the run stays on TCP", 16 + 67, 2).map(drop)
    })?;

    // Runs of one write, as HTTP/2's multiplexed responses come between
    // the client's frames (each of the peer's messages starts a new run):
    // the first finds nothing unread, the second the first unread on the
    // other CPU, and moves the direction to TCP for good.
    let (c, s) = conns.remove(0);
    c.set_nodelay(true)?;
    s.set_nodelay(true)?;
    let mut up_w = Stream::new(64);
    let (mut dn_w, mut dn_r) = (Stream::new(164), Stream::new(164));
    pinned_reader(other_cpu, &s, Stream::new(64), |read| -> Result<()> {
        up_w.write(&c, W, W)?;
        read(W)?;
        for _ in 0..2 {
            dn_w.write(&s, 64, 64)?;
            dn_r.read(&c, 64)?;
            up_w.write(&c, W, W)?;
        }
        counters("the second run's write, the first unread", 16 + 67 + 4, 3)?;
        read(2 * W)?;
        dn_w.write(&s, 64, 64)?;
        dn_r.read(&c, 64)?;
        up_w.write(&c, W, W)?;
        read(W)?;
        counters("on TCP for good", 16 + 67 + 5, 3).map(drop)
    })
}

/// A Nagle client's large first request into a server reading on another
/// CPU stays redirected (memcached's 1 MiB sets): moved to TCP for good
/// there, the client end would stay in the SOCKMAP once the server's answer
/// comes on the fast path, and send every later request on TCP through its
/// psock (1.5-1.7x TCP's time). Its later requests stay redirected too.
#[test]
fn a_nagle_clients_large_first_request_stays_redirected() -> Result<()> {
    const W: usize = 16 << 10;
    let Some(t) = TwoCpus::start(8233)? else { return Ok(()) };
    let ((c, s), other_cpu) = (t.conn()?, t.other_cpu);
    // The client keeps Nagle on; the server answers with TCP_NODELAY.
    s.set_nodelay(true)?;
    let mut up_w = Stream::new(71);
    let (mut dn_w, mut dn_r) = (Stream::new(171), Stream::new(171));
    let counters = |what: &str, redirected: u64| -> Result<RuleCounters> {
        let st = t.k.dp().stats(&t.pair)?;
        ensure!(
            st.redirected_msgs == redirected
                && st.demotions_around == 0
                && st.policy_tcp_msgs == 0
                && st.fallback_reader_busy == 0
                && st.unlinks == 0,
            "{what}: {st:?}"
        );
        Ok(st)
    };
    pinned_reader(other_cpu, &s, Stream::new(71), |read| -> Result<()> {
        // Its first read tells where it runs; the 3rd write finds the 2nd
        // unread on the other CPU, and the run's 8th too.
        up_w.write(&c, W, W)?;
        read(W)?;
        up_w.write(&c, 7 * W, W)?;
        counters("the first request's writes, unread on the other CPU", 8)?;
        read(7 * W)?;
        // The answer, then requests and answers in turn: all redirected.
        for round in 1..=3u64 {
            dn_w.write(&s, 64, 64)?;
            dn_r.read(&c, 64)?;
            up_w.write(&c, 8 * W, W)?;
            read(8 * W)?;
            counters(&format!("exchange {round}"), 8 + round * 9)?;
        }
        let cookie = meshwarp_core::sys::socket_cookie_of(&c)?;
        let listed = t.k.dp().connections(&meshwarp_core::ConnFilter { cookie: Some(cookie), ..Default::default() })?;
        ensure!(listed.len() == 1 && listed[0].tx_path == PathNow::Fast, "{listed:#?}");
        Ok(())
    })
}

/// A write so large that sk_msg passes it in chunks of 256 KiB or more
/// (MW_POLICY_HUGE) stays redirected into a reader copying out on another
/// CPU, its smaller last chunk too: the reader copies one chunk out while
/// the writer copies the next in, as on TCP, and moving such a direction
/// cost its first requests more than the redirect (1 MiB requests in one
/// write). Every byte checked.
#[test]
fn chunks_of_256_kib_stay_redirected_into_a_copying_reader() -> Result<()> {
    const W: usize = 16 << 10;
    // Two chunks of 17 fragments (32 KiB pages) and a last one of 96 KiB.
    const HUGE: usize = (1 << 20) + (160 << 10);
    let Some(t) = TwoCpus::start(8234)? else { return Ok(()) };
    let ((c, s), other_cpu) = (t.conn()?, t.other_cpu);
    c.set_nodelay(true)?;
    let mut up_w = Stream::new(72);
    pinned_reader(other_cpu, &s, Stream::new(72), |read| -> Result<()> {
        // Its first read tells where it runs; the second write stays unread.
        up_w.write(&c, W, W)?;
        read(W)?;
        up_w.write(&c, W, W)?;
        // One write: its first chunk finds the 16 KiB unread on the other CPU.
        up_w.write(&c, HUGE, HUGE)?;
        read(W + HUGE)?;
        let st = t.k.dp().stats(&t.pair)?;
        ensure!(
            st.demotions_around == 0
                && st.policy_tcp_msgs == 0
                && st.fallback_reader_busy == 0
                && st.redirected_bytes == (2 * W + HUGE) as u64,
            "all redirected: {st:?}"
        );
        // sk_msg's chunks as this test expects them (page fragments of
        // 32 KiB: of 4 KiB, memory too fragmented, they would be 68 KiB).
        ensure!(st.redirected_msgs <= 2 + 3, "the write in three chunks: {st:?}");
        Ok(())
    })
}

/// A direction its large writes moved to TCP (`MW_DIR_STREAMED`) is timed
/// since (`MW_DIR_TIMED`): which path moves its responses faster is
/// measured, not assumed. Once its reader read 256 KiB more, the client's
/// next request times the exchange; the fast path not timed yet, it is
/// tried: the server end comes back into the SOCKMAP even in the middle of
/// a response (`MW_DIR_KEEP`), and a later response (16 KiB nodelay writes
/// into a reader copying out on another CPU) goes redirected, nothing
/// demoting it. Every byte checked across each switch.
#[test]
fn a_streamed_direction_is_timed_and_tries_the_fast_path_again() -> Result<()> {
    const W: usize = 16 << 10;
    const RESPONSE: usize = 512 << 10;
    let Some(t) = TwoCpus::start(8235)? else { return Ok(()) };
    let ((c, s), writer_cpu, other_cpu) = (t.conn()?, t.writer_cpu, t.other_cpu);
    s.set_nodelay(true)?;
    let (mut up_w, mut up_r) = (Stream::new(73), Stream::new(73));
    let mut dn_w = Stream::new(173);
    pinned_reader(other_cpu, &c, Stream::new(173), |read| -> Result<()> {
        let request = |up_w: &mut Stream, up_r: &mut Stream| -> Result<()> {
            up_w.write(&c, 64, 64)?;
            up_r.read(&s, 64)
        };
        // The first response: its 3rd write finds the 2nd unread on the
        // other CPU (as in a_large_write_stream_into_a_reader_on_another_cpu_moves_to_tcp).
        request(&mut up_w, &mut up_r)?;
        dn_w.write(&s, W, W)?;
        read(W)?;
        dn_w.write(&s, 8 * W, W)?;
        read(8 * W)?;
        let moved = t.k.dp().stats(&t.pair)?;
        ensure!(moved.demotions_around == 1 && moved.promotions == 0, "moved to TCP: {moved:?}");
        // The response is written while the client reads it (on TCP, a
        // blocking write of 512 KiB would wait for the reader).
        let response = |dn_w: &mut Stream| -> Result<()> {
            thread::scope(|scope| {
                let writer = scope.spawn(|| -> Result<()> {
                    meshwarp_testbed::pin_thread(writer_cpu)?;
                    dn_w.write(&s, RESPONSE, W)
                });
                let r = read(RESPONSE);
                writer.join().map_err(|_| anyhow::anyhow!("response writer panicked"))??;
                r
            })
        };
        // 2nd request: the first look (no time yet); its response on TCP,
        // timed by the 3rd request, which tries the fast path.
        for _ in 0..2 {
            request(&mut up_w, &mut up_r)?;
            response(&mut dn_w)?;
        }
        // Back in the SOCKMAP (relinked during the 3rd response, or
        // never out).
        let st = wait_counters(&t.k, &t.pair, "the server end is back", |c| c.relinks == c.unlinks)?;
        ensure!(st.demotions_around == 1, "{st:?}");
        // The 4th response is the first to start in it: promoted, then
        // redirected whole (a first message may go around a reader holding
        // its lock, and those after it on TCP until it read that one).
        request(&mut up_w, &mut up_r)?;
        response(&mut dn_w)?;
        let fast = t.k.dp().stats(&t.pair)?;
        ensure!(
            fast.promotions >= 1
                && fast.redirected_bytes >= st.redirected_bytes + (RESPONSE / 2) as u64
                && fast.demotions_around == 1,
            "the fast path tried: before {st:?}, after {fast:?}"
        );
        // Whatever the times decide from here, nothing is lost.
        for _ in 0..3 {
            request(&mut up_w, &mut up_r)?;
            response(&mut dn_w)?;
        }
        // The rule keeps both paths' rates for its next connections.
        let rule = rule_paths(&t.k, &t.pair)?;
        ensure!(rule.rate_fast > 0 && rule.rate_tcp > 0 && rule.looks >= 2, "{rule:?}");
        Ok(())
    })
}

/// The rule's share of what its timed directions measured (`mw_short`).
fn rule_paths(k: &KernelTest, pair: &EndpointPair) -> Result<Short> {
    let id = k.dp().rule_id(pair)?;
    let map: meshwarp_core::maps::TypedMap<u32, Short> = k.map(meshwarp_bpf::names::MAP_SHORT)?;
    map.get(&id)?.context("the rule's mw_short element")
}

/// A new connection of a rule whose timed directions found the fast path
/// faster does not pay the exchanges it takes to measure both: the large
/// write that would move its direction to TCP for good stays redirected,
/// timed (its own looks correct the rule's verdict). Where the rule found
/// TCP faster, the direction moves as before. The rates are written as
/// earlier connections' looks would have left them.
#[test]
fn a_rules_measured_path_starts_its_new_connections() -> Result<()> {
    const W: usize = 16 << 10;
    let Some(TwoCpus { k, net, l, pair, other_cpu, .. }) = TwoCpus::start(8236)? else { return Ok(()) };
    let id = k.dp().rule_id(&pair)?;
    let map: meshwarp_core::maps::TypedMap<u32, Short> = k.map(meshwarp_bpf::names::MAP_SHORT)?;
    for (fast, seed) in [(true, 74u64), (false, 75)] {
        let (rate_fast, rate_tcp) = if fast { (2000, 1000) } else { (1000, 2000) };
        map.put(&id, &Short { rate_fast, rate_tcp, ..Short::default() })?;
        let before = k.dp().stats(&pair)?;
        let (c, s) = connections(&net, &l, 8236, 1)?.remove(0);
        c.set_nodelay(true)?;
        let mut up_w = Stream::new(seed);
        pinned_reader(other_cpu, &s, Stream::new(seed), |read| -> Result<()> {
            // As in a_large_write_stream_into_a_reader_on_another_cpu_moves_to_tcp:
            // the 3rd write finds the 2nd unread on the other CPU.
            up_w.write(&c, W, W)?;
            read(W)?;
            up_w.write(&c, 8 * W, W)?;
            read(8 * W)?;
            let st = k.dp().stats(&pair)?;
            let (moved, redirected) =
                (st.demotions_around - before.demotions_around, st.redirected_bytes - before.redirected_bytes);
            if fast {
                ensure!(moved == 0 && redirected == 9 * W as u64, "stays redirected: {st:?}");
            } else {
                ensure!(moved == 1 && redirected == 2 * W as u64, "moves to TCP: {st:?}");
            }
            Ok(())
        })?;
    }
    Ok(())
}

/// An adaptive pair between two pods, this thread pinned to the writer's CPU
/// and the other CPU free for a pinned reader: the setup of the tests of
/// large writes into a reader copying out on another CPU. `None` where the
/// kernel test or two CPUs are missing (each says why).
struct TwoCpus {
    k: KernelTest,
    net: NodeWithPods,
    l: TcpListener,
    pair: EndpointPair,
    port: u16,
    writer_cpu: usize,
    other_cpu: usize,
}

impl TwoCpus {
    fn start(port: u16) -> Result<Option<Self>> {
        let Some((writer_cpu, other_cpu)) = writer_and_reader_cpus() else { return Ok(None) };
        let Some(k) = KernelTest::start(1024) else { return Ok(None) };
        let (net, l, pair) = pods_pair(&k, port, FastPathMode::Adaptive)?;
        meshwarp_testbed::pin_thread(writer_cpu)?;
        Ok(Some(Self { k, net, l, pair, port, writer_cpu, other_cpu }))
    }

    /// A new connection of the pair: (client end, server end).
    fn conn(&self) -> Result<(TcpStream, TcpStream)> {
        Ok(connections(&self.net, &self.l, self.port, 1)?.remove(0))
    }
}

/// Two CPUs this process may use, for a writer and a reader on another
/// one; `None` (missing_feature: a failure under CI=true) with fewer.
fn writer_and_reader_cpus() -> Option<(usize, usize)> {
    match meshwarp_testbed::usable_cpus()[..] {
        [writer, other, ..] => Some((writer, other)),
        _ => meshwarp_testbed::missing_feature("two CPUs (a reader on another CPU than its writer)"),
    }
}

/// Runs `body` with a reader of `s` on one thread pinned to `cpu`:
/// `read(len)` has it read and check `len` bytes, and waits until it did.
fn pinned_reader(
    cpu: usize,
    s: &TcpStream,
    mut up_r: Stream,
    body: impl FnOnce(&dyn Fn(usize) -> Result<()>) -> Result<()>,
) -> Result<()> {
    let (ask, asked) = std::sync::mpsc::channel::<usize>();
    let (done, finished) = std::sync::mpsc::channel::<Result<()>>();
    thread::scope(|scope| {
        scope.spawn(move || {
            if let Err(e) = meshwarp_testbed::pin_thread(cpu) {
                done.send(Err(e.into())).ok();
                return;
            }
            for len in asked {
                if done.send(up_r.read(s, len)).is_err() {
                    return;
                }
            }
        });
        // A reader that could not be pinned has said why, and hung up.
        let read = |len: usize| -> Result<()> {
            let asked = ask.send(len);
            let done = finished.recv_timeout(Duration::from_secs(60))?;
            asked?;
            done
        };
        let r = body(&read);
        drop(ask);
        r
    })
}

/// 16 MiB in `chunk` writes into a reader that waits: the direction moves to
/// TCP (`demotions_behind`) once `ahead_max` redirected bytes (past
/// `lockstep`) wait unread, checked every 16 messages; the writer then
/// waits on TCP's buffers until the reader reads everything, in order.
fn writes_ahead_until_demoted(
    k: &KernelTest,
    pair: &EndpointPair,
    (c, up_w): (&TcpStream, &mut Stream),
    (s, up_r): (&TcpStream, &mut Stream),
    chunk: usize,
    lockstep: u64,
    ahead_max: u64,
) -> Result<()> {
    let total = 16 << 20;
    thread::scope(|scope| -> Result<()> {
        let writer = scope.spawn(|| up_w.write(c, total, chunk));
        let st = wait_counters(k, pair, "demoted, reader behind", |st| st.demotions_behind == 1)?;
        let ahead = st.redirected_bytes - lockstep;
        ensure!(
            (ahead_max..=ahead_max + 16 * chunk as u64).contains(&ahead),
            "demoted with {ahead} redirected bytes unread (bound {ahead_max}, checked every 16 messages): {st:?}"
        );
        thread::sleep(Duration::from_millis(200));
        ensure!(!writer.is_finished(), "the writer waits on TCP's buffers");
        up_r.read(s, total)?;
        writer.join().unwrap()
    })
}

/// A reader of several threads does not publish its psock reads (they
/// cannot be attributed exactly): its peer's nodelay stream is never taken
/// for one whose reader fell behind, however long it runs.
#[test]
fn a_reader_of_several_threads_is_never_taken_for_behind() -> Result<()> {
    let k = kernel_test!();
    let (net, l, pair) = pods_pair(&k, 8209, FastPathMode::Adaptive)?;
    let (c, s) = connections(&net, &l, 8209, 1)?.remove(0);
    c.set_nodelay(true)?;
    let (mut up_w, mut up_r) = (Stream::new(43), Stream::new(43));
    // Two threads read the server end, in turns.
    for round in 0..10 {
        thread::scope(|scope| {
            scope
                .spawn(|| -> Result<()> {
                    for _ in 0..50 {
                        up_w.write(&c, 64, 64)?;
                        up_r.read(&s, 64)?;
                    }
                    Ok(())
                })
                .join()
                .unwrap()
        })
        .with_context(|| format!("round {round}"))?;
    }
    let st = k.dp().stats(&pair)?;
    ensure!(st.demotions_behind == 0 && st.demotions_coalesce == 0, "{st:?}");
    ensure!(st.redirected_msgs == 500, "{st:?}");
    Ok(())
}

/// Polls the pair's counters until `cond` holds (the unlink and relink are
/// served by the data path's thread, a few milliseconds later).
fn wait_counters(
    k: &KernelTest,
    pair: &EndpointPair,
    what: &str,
    cond: impl Fn(&RuleCounters) -> bool,
) -> Result<RuleCounters> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let st = k.dp().stats(pair)?;
        if cond(&st) {
            return Ok(st);
        }
        ensure!(std::time::Instant::now() < deadline, "{what}: {st:?}");
        thread::sleep(Duration::from_millis(5));
    }
}

/// A direction that keeps streaming small writes leaves the SOCKMAP (its
/// sends no longer run sk_msg at all); when the server answers, the client
/// is put back, and its next request is redirected again. Every byte checked.
#[test]
fn a_streaming_end_leaves_the_sockmap_and_comes_back() -> Result<()> {
    let k = kernel_test!();
    let (net, l, pair) = pods_pair(&k, 8206, FastPathMode::Adaptive)?;
    let (c, s) = connections(&net, &l, 8206, 1)?.remove(0);
    let (mut up_w, mut up_r) = (Stream::new(11), Stream::new(11));
    let (mut down_w, mut down_r) = (Stream::new(12), Stream::new(12));
    guard_waits_at(&k, libc::SCHED_FIFO)?;

    stream_one_way(&c, &s, &mut up_w, &mut up_r, 1 << 20, 512)?;
    let st = wait_counters(&k, &pair, "the streaming client end was unlinked", |c| c.unlinks == 1)?;
    ensure!(st.demotions_coalesce == 1 && st.relinks == 0, "{st:?}");
    // Out of the map: more streaming runs no sk_msg (plain TCP).
    stream_one_way(&c, &s, &mut up_w, &mut up_r, 2 << 20, 512)?;
    let after = k.dp().stats(&pair)?;
    ensure!(after.policy_tcp_msgs == st.policy_tcp_msgs, "no sk_msg ran once unlinked: {st:?} then {after:?}");

    // The server answers (on TCP: the client is parked): the client goes back.
    down_w.write(&s, 64, 64)?;
    down_r.read(&c, 64)?;
    let st = wait_counters(&k, &pair, "the client end was relinked", |c| c.relinks == 1)?;
    // A new exchange: the request is redirected again, and so is the reply.
    for _ in 0..3 {
        up_w.write(&c, 100, 100)?;
        up_r.read(&s, 100)?;
        down_w.write(&s, 100, 100)?;
        down_r.read(&c, 100)?;
    }
    let after = k.dp().stats(&pair)?;
    ensure!(after.promotions >= 1, "promoted after the relink: {after:?}");
    ensure!(after.redirected_bytes >= st.redirected_bytes + 500, "requests and replies redirected: {after:?}");
    // The relink was a walk, at normal priority: waiting again, real time.
    guard_waits_at(&k, libc::SCHED_FIFO)
}

/// Responses in small Nagle writes, each asked for by a redirected 64 B
/// request (a download). On TCP, Nagle holds a response's tail until the
/// client acknowledges what came before, and a client that answers soon
/// after it received delays that (40 ms or more): so a response stays
/// redirected up to `MW_POLICY_DELACK` (2 048) messages, 1 024 writes to its
/// end. One past that moves to TCP there, but its end stays in the SOCKMAP
/// (out of it, the next request would go on TCP and put the client's TCP in
/// pingpong mode): the next request is redirected, and its answer promoted.
/// One 32 768 messages past its demotion (`MW_POLICY_ANSWER`), a stream,
/// leaves. Every byte checked.
#[test]
fn a_nagle_response_to_a_redirected_request_stays_redirected() -> Result<()> {
    let k = kernel_test!();
    let (net, l, pair) = pods_pair(&k, 8221, FastPathMode::Adaptive)?;
    let (c, s) = connections(&net, &l, 8221, 1)?.remove(0);
    let (mut up_w, mut up_r) = (Stream::new(31), Stream::new(31));
    let (mut down_w, mut down_r) = (Stream::new(32), Stream::new(32));

    up_w.write(&c, 64, 64)?;
    up_r.read(&s, 64)?;
    stream_one_way(&s, &c, &mut down_w, &mut down_r, 1 << 20, 1024)?;
    let first = k.dp().stats(&pair)?;
    ensure!(
        first.demotions_coalesce == 0 && first.demotions_behind == 0 && first.demotions_around == 0,
        "the response stayed on the fast path: {first:?}"
    );
    ensure!(first.redirected_msgs == 1 + 1024, "the request and all of the response redirected: {first:?}");

    // In 64 B writes, 2 100 of them: redirected up to message 2 048.
    up_w.write(&c, 64, 64)?;
    up_r.read(&s, 64)?;
    stream_one_way(&s, &c, &mut down_w, &mut down_r, 2100 * 64, 64)?;
    let second = k.dp().stats(&pair)?;
    ensure!(second.demotions_coalesce == 1, "the long response moved to TCP: {second:?}");
    ensure!(
        second.redirected_msgs == first.redirected_msgs + 1 + 2047,
        "the request and the response's first 2 047 writes redirected: {second:?}"
    );
    // Its end stays in the SOCKMAP: it never asked to leave (its checks run
    // in its sends), and no unlink was served (in milliseconds if asked).
    let server = k.dp().socket_link(meshwarp_core::sys::socket_cookie_of(&s)?)?.context("server accelerated")?;
    let link = k.dp().link(&server)?.context("link")?;
    ensure!(
        link.dir[END_SERVER as usize].flags & (DIR_UNLINK_REQ | DIR_UNLINKED) == 0
            && link.end_flags[END_SERVER as usize] & EF_PARKED == 0,
        "the answering end never asked to leave: {link:?}"
    );
    thread::sleep(Duration::from_millis(200));
    let st = k.dp().stats(&pair)?;
    ensure!(st.unlinks == 0, "the answering end stayed in the SOCKMAP: {st:?}");

    up_w.write(&c, 64, 64)?;
    up_r.read(&s, 64)?;
    down_w.write(&s, 100, 100)?;
    down_r.read(&c, 100)?;
    let third = k.dp().stats(&pair)?;
    ensure!(third.promotions == 1, "the next answer was promoted: {third:?}");
    ensure!(third.redirected_msgs == st.redirected_msgs + 2, "request and answer redirected: {third:?}");

    // A run 32 768 messages past its demotion (`MW_POLICY_ANSWER`, counted
    // in checks of 16 from there) is a stream: it leaves.
    up_w.write(&c, 64, 64)?;
    up_r.read(&s, 64)?;
    stream_one_way(&s, &c, &mut down_w, &mut down_r, 35_000 * 64, 64)?;
    wait_counters(&k, &pair, "the end of a 35 000-message answer left the SOCKMAP", |c| {
        c.demotions_coalesce == 2 && c.unlinks == 1
    })?;
    Ok(())
}

/// A server that is never a target answers a client whose requests come on
/// TCP (it sits in mw_tgtmap). Its first response in small Nagle writes moves
/// to TCP at message 64 and leaves the SOCKMAP; the client's next request,
/// sent on TCP right after it received on TCP, puts its TCP in pingpong mode
/// (it then delays its acknowledgments, and on TCP Nagle would hold the next
/// response's tail until they come, 40 ms or more). Once the server end is
/// back, that response, 1 024 writes, stays redirected to its end. Every byte
/// checked.
#[test]
fn a_nagle_response_to_a_client_in_pingpong_mode_stays_redirected() -> Result<()> {
    let k = kernel_test!();
    let (net, l, pair) = pods_pair_server_no_target(&k, 8222)?;
    let (c, s) = connections(&net, &l, 8222, 1)?.remove(0);
    let (mut up_w, mut up_r) = (Stream::new(33), Stream::new(33));
    let (mut down_w, mut down_r) = (Stream::new(34), Stream::new(34));

    up_w.write(&c, 64, 64)?;
    up_r.read(&s, 64)?;
    stream_one_way(&s, &c, &mut down_w, &mut down_r, 1 << 20, 1024)?;
    // At once (within the client's delayed-ACK time of its last TCP read):
    // the client runs no sk_msg, so its request takes TCP in any case.
    up_w.write(&c, 64, 64)?;
    wait_counters(&k, &pair, "the first response moved to TCP, its end out of the SOCKMAP", |c| {
        c.demotions_coalesce == 1 && c.unlinks == 1
    })?;
    // The server's read of it, out of the SOCKMAP, asks for its relink.
    up_r.read(&s, 64)?;
    wait_counters(&k, &pair, "the server end was relinked", |c| c.relinks == 1)?;
    let before = k.dp().stats(&pair)?;
    stream_one_way(&s, &c, &mut down_w, &mut down_r, 1 << 20, 1024)?;
    let after = k.dp().stats(&pair)?;
    ensure!(after.tgtmap_clients == 1, "the client runs no sk_msg: {after:?}");
    ensure!(after.promotions == 1, "the second response was promoted: {after:?}");
    ensure!(
        after.demotions_coalesce == 1 && after.demotions_behind == 0 && after.demotions_around == 0,
        "the second response stayed on the fast path: {after:?}"
    );
    ensure!(after.redirected_msgs == before.redirected_msgs + 1024, "all of it redirected: {after:?}");
    Ok(())
}

/// Waits until this data path's guard thread runs under scheduling `policy`
/// (it waits for requests and serves unlinks at SCHED_FIFO, unless the
/// configuration says otherwise, and walks at SCHED_OTHER).
fn guard_waits_at(k: &KernelTest, policy: i32) -> Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut seen = None;
    loop {
        if let Some(tid) = k.dp().guard_thread_id() {
            let now = meshwarp_core::sys::thread_sched_policy(tid)?;
            if now == policy {
                return Ok(());
            }
            seen = Some(now);
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "the guard thread's scheduling policy is {seen:?}, not {policy} (SCHED_FIFO is 1)"
        );
        thread::sleep(Duration::from_millis(5));
    }
}

/// With `guard_realtime` off, the guard thread runs at normal priority, and
/// a streaming end still leaves the SOCKMAP (later, on a busy node).
#[test]
fn a_guard_configured_not_real_time_runs_at_normal_priority() -> Result<()> {
    let Some(k) = KernelTest::start_with(1024, 64, |c| c.guard_realtime = false) else { return Ok(()) };
    guard_waits_at(&k, libc::SCHED_OTHER)?;
    let (net, l, pair) = pods_pair(&k, 8218, FastPathMode::Adaptive)?;
    let (c, s) = connections(&net, &l, 8218, 1)?.remove(0);
    let (mut up_w, mut up_r) = (Stream::new(13), Stream::new(13));
    stream_one_way(&c, &s, &mut up_w, &mut up_r, 1 << 20, 512)?;
    wait_counters(&k, &pair, "the streaming client end was unlinked", |c| c.unlinks == 1)?;
    guard_waits_at(&k, libc::SCHED_OTHER)
}

/// An end out of the SOCKMAP is put back only while its peer has read all
/// it sent on TCP: then its next send can be redirected again. A download
/// (the server streams a response of small Nagle writes, the client reads
/// it all, then asks for the next) leaves the SOCKMAP at its first
/// response; the next request asks for the server end back, but the walk
/// that would put it back comes (the guard thread held here) after the
/// server began its next response on TCP: put back then, it would run
/// sk_msg on each send of that response only to pass it to TCP. It stays
/// out; once the client read that response, its next request puts the
/// server end back, and the answer is redirected. Every byte checked.
#[test]
fn an_end_is_not_put_back_in_the_middle_of_its_tcp_response() -> Result<()> {
    let k = kernel_test!();
    let (net, l, pair) = pods_pair(&k, 8230, FastPathMode::Adaptive)?;
    let (c, s) = connections(&net, &l, 8230, 1)?.remove(0);
    let (mut up_w, mut up_r) = (Stream::new(41), Stream::new(41));
    let (mut down_w, mut down_r) = (Stream::new(42), Stream::new(42));
    let server = k.dp().socket_link(meshwarp_core::sys::socket_cookie_of(&s)?)?.context("server accelerated")?;

    stream_one_way(&s, &c, &mut down_w, &mut down_r, 1 << 20, 512)?;
    let st = wait_counters(&k, &pair, "the streaming server end was unlinked", |c| c.unlinks == 1)?;
    ensure!(st.relinks == 0, "{st:?}");

    let held = HeldThread::named("meshwarp-guard")?;
    up_w.write(&c, 64, 64)?;
    up_r.read(&s, 64)?;
    down_w.write(&s, 64 << 10, 512)?;
    drop(held);
    thread::sleep(Duration::from_millis(200));
    let mid = k.dp().stats(&pair)?;
    let link = k.dp().link(&server)?.context("link")?;
    ensure!(mid.relinks == 0, "put back with its response unread: {mid:?}");
    ensure!(link.dir[END_SERVER as usize].flags & DIR_UNLINKED != 0, "still out: {link:?}");
    ensure!(mid.policy_tcp_msgs == st.policy_tcp_msgs, "no sk_msg ran on the response: {mid:?}");
    down_r.read(&c, 64 << 10)?;

    up_w.write(&c, 64, 64)?;
    up_r.read(&s, 64)?;
    let back = wait_counters(&k, &pair, "the server end was put back", |c| c.relinks == 1)?;
    down_w.write(&s, 100, 100)?;
    down_r.read(&c, 100)?;
    let after = k.dp().stats(&pair)?;
    ensure!(after.promotions >= 1, "promoted after the relink: {after:?}");
    ensure!(after.redirected_bytes >= back.redirected_bytes + 100, "the answer redirected: {after:?}");
    Ok(())
}

/// The client streams small corked writes for seconds while the server sends
/// it a short message every 20 ms: the client leaves the SOCKMAP, comes back
/// at the server's next message, leaves again, many times, with redirected
/// and TCP bytes racing into it. Both streams arrive whole and in order.
/// (Corked: with Nagle alone, an end whose peer redirects to it stays in
/// the SOCKMAP, see `a_nagle_response_to_a_redirected_request_stays_redirected`.)
#[test]
fn unlink_and_relink_under_two_way_traffic_lose_nothing() -> Result<()> {
    let k = kernel_test!();
    let (net, l, pair) = pods_pair(&k, 8207, FastPathMode::Adaptive)?;
    let conns = connections(&net, &l, 8207, 4)?;
    thread::scope(|scope| -> Result<()> {
        let mut handles = Vec::new();
        for (n, (c, s)) in conns.iter().enumerate() {
            let seed = 300 + 2 * n as u64;
            let (up_len, down_msgs) = (12 << 20, 120usize);
            // Client -> server: one long stream of 256-byte writes, corked
            // (uncorked at its end, which pushes the tail).
            handles.push(scope.spawn(move || write_corked(&mut Stream::new(seed), c, up_len, 256)));
            handles.push(scope.spawn(move || Stream::new(seed).read(s, up_len)));
            // Server -> client: 37-byte messages, 20 ms apart.
            handles.push(scope.spawn(move || -> Result<()> {
                let mut w = Stream::new(seed + 1);
                for _ in 0..down_msgs {
                    w.write(s, 37, 37)?;
                    thread::sleep(Duration::from_millis(20));
                }
                Ok(())
            }));
            handles.push(scope.spawn(move || Stream::new(seed + 1).read(c, 37 * down_msgs)));
        }
        for h in handles {
            h.join().unwrap()?;
        }
        Ok(())
    })?;
    let st = k.dp().stats(&pair)?;
    ensure!(st.unlinks >= 2 && st.relinks >= 1, "ends left the SOCKMAP and came back: {st:?}");
    Ok(())
}

/// A promotion must wait for the reader: while TCP bytes of the demoted
/// direction are unread, a new exchange does not bring it back (redirected
/// bytes would overtake them); once they are read, it does.
#[test]
fn no_promotion_while_tcp_bytes_are_unread() -> Result<()> {
    let k = kernel_test!();
    let (net, l, pair) = pods_pair(&k, 8202, FastPathMode::Adaptive)?;
    let (c, s) = connections(&net, &l, 8202, 1)?.remove(0);
    let (mut up_w, mut up_r) = (Stream::new(3), Stream::new(3));
    let (mut down_w, mut down_r) = (Stream::new(4), Stream::new(4));
    // 80 small writes, not read yet: 63 redirected, then TCP.
    up_w.write(&c, 80 * 200, 200)?;
    thread::sleep(Duration::from_millis(50));
    ensure!(k.dp().stats(&pair)?.demotions_coalesce == 1);
    // A reply, then a request, with the stream still unread.
    down_w.write(&s, 10, 10)?;
    down_r.read(&c, 10)?;
    up_w.write(&c, 300, 300)?;
    let st = k.dp().stats(&pair)?;
    ensure!(st.promotions == 0, "not promoted over unread TCP bytes: {st:?}");
    // The reader gets everything in order, then a new exchange promotes.
    up_r.read(&s, 80 * 200 + 300)?;
    down_w.write(&s, 10, 10)?;
    down_r.read(&c, 10)?;
    up_w.write(&c, 300, 300)?;
    up_r.read(&s, 300)?;
    let st = k.dp().stats(&pair)?;
    ensure!(st.promotions == 1, "promoted once read: {st:?}");
    Ok(())
}

/// nginx's read loop (epoll edge-triggered; a read that fills its buffer
/// asks FIONREAD how much is left and, told 0, waits for the next event) on
/// a socket whose incoming direction moved to TCP before its reader was
/// seen asking FIONREAD. Where FIONREAD counts only a psock's redirected
/// bytes, the TCP bytes that came before the reader's last event are never
/// counted and bring no new event: meshwarp wakes such a reader when it asks
/// (MW_EF_WAKE). Every byte checked; a reader left without an event fails.
#[test]
fn a_fionread_reader_is_woken_for_tcp_bytes_it_was_not_told_of() -> Result<()> {
    const LEN: usize = 400 * 64;
    let k = kernel_test!();
    let (net, l, pair) = pods_pair(&k, 8220, FastPathMode::Adaptive)?;
    let (c, s) = connections(&net, &l, 8220, 1)?.remove(0);
    ensure!(k.dp().socket_link(meshwarp_core::sys::socket_cookie_of(&s)?)?.is_some(), "accelerated");
    // Unread 64-byte writes: 63 redirected, the rest on TCP.
    Stream::new(31).write(&c, LEN, 64)?;
    let st = wait_counters(&k, &pair, "the stream moved to TCP", |c| c.demotions_coalesce == 1)?;
    ensure!(st.redirected_msgs == 63, "{st:?}");
    let got = fionread_reader(&s, LEN, Duration::from_secs(5))?;
    for (i, b) in got.iter().enumerate() {
        ensure!(*b == pattern_byte(31, i as u64), "wrong byte at offset {i}");
    }
    let st = k.dp().stats(&pair)?;
    if !k.dp().kernel().fionread_counts_tcp_with_psock {
        ensure!(st.reader_wakeups >= 1, "the reader was woken: {st:?}");
    }
    Ok(())
}

/// An end that asks to leave the SOCKMAP while no process serves the data
/// path (programs pinned and attached, no guard thread), and whose request
/// is lost (read off the ring buffer by someone else), stays parked, its
/// stream going on over TCP; the next process that opens the data path finds
/// it and unlinks it. Every byte checked.
#[test]
fn an_unlink_asked_while_no_process_serves_is_done_at_the_next_open() -> Result<()> {
    let mut k = kernel_test!();
    let (net, l, pair) = pods_pair(&k, 8207, FastPathMode::Adaptive)?;
    let (c, s) = connections(&net, &l, 8207, 1)?.remove(0);
    let (mut up_w, mut up_r) = (Stream::new(21), Stream::new(21));
    drop(k.dp.take());
    stream_one_way(&c, &s, &mut up_w, &mut up_r, 1 << 20, 512)?;
    let events = k
        .cfg
        .pin_root
        .join(format!("v{}", meshwarp_bpf::shared::SCHEMA_VERSION))
        .join("maps")
        .join(meshwarp_bpf::names::MAP_EVENTS);
    let events = libbpf_rs::MapHandle::from_pinned_path(events)?;
    let mut rb = libbpf_rs::RingBufferBuilder::new();
    rb.add(&events, |_| 0)?;
    rb.build()?.consume()?;
    k.dp = Some(Dataplane::open(&k.cfg)?);
    let st = wait_counters(&k, &pair, "unlinked by the next process", |c| c.unlinks == 1)?;
    ensure!(st.demotions_coalesce == 1, "{st:?}");
    stream_one_way(&c, &s, &mut up_w, &mut up_r, 1 << 20, 512)?;
    let after = k.dp().stats(&pair)?;
    ensure!(after.policy_tcp_msgs == st.policy_tcp_msgs, "out of the map: {st:?} then {after:?}");
    Ok(())
}

/// Mode `always`: the same stream is never demoted, every byte redirected.
/// Mode `never`: covered, but nothing is redirected, and it is counted.
#[test]
fn modes_always_and_never() -> Result<()> {
    let k = kernel_test!();
    let (net, l, always) = pods_pair(&k, 8203, FastPathMode::Always)?;
    let (c, s) = connections(&net, &l, 8203, 1)?.remove(0);
    stream_one_way(&c, &s, &mut Stream::new(5), &mut Stream::new(5), 1 << 20, 512)?;
    let st = k.dp().stats(&always)?;
    ensure!(st.demotions_coalesce == 0 && st.redirected_bytes == 1 << 20, "{st:?}");
    ensure!(k.dp().pairs().iter().any(|p| p.mode() == FastPathMode::Always), "the mode is kept in the maps");

    let to = SocketAddr::new(net.pods[1].addr(false), 8204);
    let l = net.pods[1].ns.listen(to)?;
    let never = EndpointPair::new(net.pods[0].addr(false), to.into())?.with_mode(FastPathMode::Never);
    k.dp().insert(&never, "test")?;
    let (c, s) = (net.pods[0].ns.connect(to)?, accept_timeout(&l, Duration::from_secs(60))?);
    ensure!(k.dp().socket_link(meshwarp_core::sys::socket_cookie_of(&c)?)?.is_none(), "mode never: not accelerated");
    stream_one_way(&c, &s, &mut Stream::new(6), &mut Stream::new(6), 256 << 10, 512)?;
    let st = k.dp().stats(&never)?;
    ensure!(st.fallback_mode_never == 1 && st.sockets == 0 && st.redirected_bytes == 0, "{st:?}");
    // Both ends listed as kept on TCP by the mode, under one connection id:
    // the server end found its rule by itself (the client end leaves no
    // link for a mirror pair in mode never).
    let mut ids = Vec::new();
    for end in [&c, &s] {
        let cookie = meshwarp_core::sys::socket_cookie_of(end)?;
        let listed = k.dp().connections(&meshwarp_core::ConnFilter { cookie: Some(cookie), ..Default::default() })?;
        ensure!(listed.len() == 1, "{listed:#?}");
        let e = &listed[0];
        ensure!(!e.accelerated && e.tx_path == PathNow::Tcp(TcpReason::ModeNever), "{e:?}");
        ids.push(e.conn_id);
    }
    ensure!(ids[0] == ids[1] && ids[0] != 0, "connection ids {ids:?}");
    Ok(())
}

/// `n` exchanges on a connection: a 1000-byte request, read whole, then a
/// 1000-byte answer, read whole (one redirected message each way).
fn request_answer(c: &TcpStream, s: &TcpStream, seed: u64, n: usize) -> Result<()> {
    let (mut up, mut up_rd, mut down, mut down_rd) =
        (Stream::new(seed), Stream::new(seed), Stream::new(seed + 1), Stream::new(seed + 1));
    for _ in 0..n {
        up.write(c, 1000, 1000)?;
        up_rd.read(s, 1000)?;
        down.write(s, 1000, 1000)?;
        down_rd.read(c, 1000)?;
    }
    Ok(())
}

/// An adaptive pair whose connections each carry one request and its
/// answer: once 16 in a row closed short, its new connections stay on TCP,
/// uncovered (`fallback_short`), their bytes whole, but for every 16th (a
/// probe, covered). A probe that grows long (three exchanges) ends the
/// run: the next connection is covered again. Mode always covers every
/// connection however short. With the reader guard on, a connection is
/// judged at `connect()` (it is stamped or not); with it off, at the
/// client's handshake.
#[test]
fn a_rule_whose_connections_are_short_leaves_new_ones_on_tcp() -> Result<()> {
    short_connections_stay_on_tcp(meshwarp_core::GuardMode::Auto)
}

#[test]
fn short_connections_stay_on_tcp_with_the_reader_guard_off() -> Result<()> {
    short_connections_stay_on_tcp(meshwarp_core::GuardMode::Off)
}

fn short_connections_stay_on_tcp(guard: meshwarp_core::GuardMode) -> Result<()> {
    let Some(k) = KernelTest::start_with(1024, 64, |c| c.guard = guard) else { return Ok(()) };
    ensure!(k.dp().guard_enabled() == (guard == meshwarp_core::GuardMode::Auto), "reader guard {guard:?}");
    let covered =
        |c: &TcpStream| -> Result<bool> { Ok(k.dp().socket_link(meshwarp_core::sys::socket_cookie_of(c)?)?.is_some()) };
    let (net, l, pair) = pods_pair(&k, 8205, FastPathMode::Adaptive)?;
    // A connection left out costs its sockets no socket storage element.
    let state: meshwarp_core::maps::TypedMap<i32, meshwarp_bpf::shared::SockState> =
        k.map(meshwarp_bpf::names::MAP_SK_STATE)?;
    let mut seed = 100;
    let mut short = |want_covered: Option<bool>| -> Result<bool> {
        use std::os::fd::AsRawFd;
        let (c, s) = connections(&net, &l, 8205, 1)?.remove(0);
        let was = covered(&c)?;
        if let Some(w) = want_covered {
            ensure!(was == w, "connection {seed}: covered {was}, expected {w}");
        }
        if !was {
            for end in [&c, &s] {
                let st = state.get(&end.as_raw_fd())?;
                ensure!(st.is_none(), "connection {seed} left out: no element, found {st:?}");
            }
        }
        request_answer(&c, &s, seed, 1)?;
        seed += 2;
        drop((c, s));
        Ok(was)
    };
    for _ in 0..16 {
        short(Some(true))?;
    }
    // Their closes are judged as their ends reach CLOSE, just after.
    let mut skipped = 0;
    for _ in 0..40 {
        if !short(None)? {
            skipped += 1;
            if skipped == 3 {
                break;
            }
        }
        thread::sleep(Duration::from_millis(5));
    }
    ensure!(skipped == 3, "short connections kept being covered: {:?}", k.dp().stats(&pair)?);
    let st = k.dp().stats(&pair)?;
    ensure!(st.fallback_short == 3, "three counted: {st:?}");
    // A probe in every 16 is covered; the one that grows long ends the run.
    let mut probes = 0;
    for i in 0..20 {
        let (c, s) = connections(&net, &l, 8205, 1)?.remove(0);
        let was = covered(&c)?;
        request_answer(&c, &s, 1000 + 2 * i, 3)?;
        drop((c, s));
        if was {
            probes += 1;
            break;
        }
    }
    ensure!(probes == 1, "no probe covered in 20 connections: {:?}", k.dp().stats(&pair)?);
    let st = k.dp().stats(&pair)?;
    // The run's first connection was a probe too: every one between the
    // two probes stayed on TCP.
    let between = u64::from(meshwarp_bpf::shared::SHORT_PROBE) - 1;
    ensure!(st.fallback_short == between, "the connections between the probes stayed on TCP: {st:?}");
    short(Some(true)).context("the connection after a long probe")?;
    // In a run of short ones again, an update of the rule starts afresh
    // (mode always and back: its next connection is covered).
    let mut again = false;
    for _ in 0..40 {
        if !short(None)? {
            again = true;
            break;
        }
        thread::sleep(Duration::from_millis(5));
    }
    ensure!(again, "short connections left out again: {:?}", k.dp().stats(&pair)?);
    k.dp().upsert(&pair.with_mode(FastPathMode::Always), "test")?;
    k.dp().upsert(&pair, "test")?;
    short(Some(true)).context("the connection after the rule's update")?;

    let to = SocketAddr::new(net.pods[1].addr(false), 8206);
    let l2 = net.pods[1].ns.listen(to)?;
    let always = EndpointPair::new(net.pods[0].addr(false), to.into())?.with_mode(FastPathMode::Always);
    k.dp().insert(&always, "test")?;
    for i in 0..40 {
        let (c, s) = (net.pods[0].ns.connect(to)?, accept_timeout(&l2, Duration::from_secs(60))?);
        ensure!(covered(&c)?, "mode always, connection {i}: covered");
        request_answer(&c, &s, 5000 + 2 * i, 1)?;
    }
    let st = k.dp().stats(&always)?;
    ensure!(st.fallback_short == 0 && st.sockets == 80, "{st:?}");
    Ok(())
}

/// 16 connections, both directions at once: bursts of small and large
/// writes, replies, idle turns; directions are demoted and promoted many
/// times, and every byte of every stream arrives once, in order. The bursts
/// are corked (uncorked at their end): Nagle alone, in connections whose
/// peers redirect, would keep runs this short on the fast path
/// (`MW_POLICY_DELACK`).
#[test]
fn streams_survive_demotions_and_promotions() -> Result<()> {
    let k = kernel_test!();
    let (net, l, pair) = pods_pair(&k, 8205, FastPathMode::Adaptive)?;
    let conns = connections(&net, &l, 8205, 16)?;
    thread::scope(|scope| -> Result<()> {
        let mut handles = Vec::new();
        for (n, (c, s)) in conns.iter().enumerate() {
            handles.push(scope.spawn(move || -> Result<()> {
                let seed = 100 + 2 * n as u64;
                let (mut up_w, mut up_r) = (Stream::new(seed), Stream::new(seed));
                let (mut down_w, mut down_r) = (Stream::new(seed + 1), Stream::new(seed + 1));
                for round in 0..24usize {
                    // Varied bursts: small Nagle writes (demote), single large
                    // messages (stay), a request/response turn (promote).
                    let (len, chunk) = match (round + n) % 4 {
                        0 => (48 * 1024, 300),
                        1 => (200 * 1024, 64 * 1024),
                        2 => (1, 1),
                        _ => (9000, 700),
                    };
                    // Both ends send their burst at once while both read.
                    thread::scope(|inner| -> Result<()> {
                        let up = inner.spawn(|| write_corked(&mut up_w, c, len, chunk));
                        let down = inner.spawn(|| write_corked(&mut down_w, s, len / 2 + 1, chunk));
                        up_r.read(s, len)?;
                        down_r.read(c, len / 2 + 1)?;
                        up.join().unwrap()?;
                        down.join().unwrap()
                    })?;
                }
                Ok(())
            }));
        }
        for h in handles {
            h.join().unwrap()?;
        }
        Ok(())
    })?;
    let st: RuleCounters = k.dp().stats(&pair)?;
    ensure!(st.sockets == 32, "every connection accelerated: {st:?}");
    ensure!(st.demotions_coalesce > 0 && st.promotions > 0, "directions moved both ways: {st:?}");
    Ok(())
}

/// An anonymous page whose first touch stops the touching thread until the
/// test lets it go (userfaultfd, missing-page mode). A reader that copies
/// into it from `recv` stops inside its copy, holding its socket's lock, as
/// a reader copying out a large read does for a while.
struct StallingPage {
    uffd: std::os::fd::OwnedFd,
    page: usize,
    len: usize,
}

// linux/userfaultfd.h: _IOWR(0xAA, nr, struct)
const UFFD_API: u64 = 0xAA;
const UFFDIO_API: libc::c_ulong = 0xC018_AA3F;
const UFFDIO_REGISTER: libc::c_ulong = 0xC020_AA00;
const UFFDIO_COPY: libc::c_ulong = 0xC028_AA03;
const UFFDIO_REGISTER_MODE_MISSING: u64 = 1;
const UFFD_EVENT_PAGEFAULT: u8 = 0x12;

impl StallingPage {
    fn new() -> Result<Self> {
        use std::os::fd::FromRawFd;
        // SAFETY: plain system calls on memory and a descriptor this owns;
        // the structs are linux/userfaultfd.h's.
        unsafe {
            let fd = libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK);
            ensure!(fd >= 0, "userfaultfd: {}", std::io::Error::last_os_error());
            let uffd = std::os::fd::OwnedFd::from_raw_fd(fd as i32);
            let mut api = [UFFD_API, 0, 0]; // api, features, ioctls
            ensure!(libc::ioctl(fd as i32, UFFDIO_API, api.as_mut_ptr()) == 0, "UFFDIO_API");
            let len = libc::sysconf(libc::_SC_PAGESIZE) as usize;
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            ensure!(p != libc::MAP_FAILED, "mmap");
            let page = Self { uffd, page: p as usize, len };
            let mut reg = [page.page as u64, len as u64, UFFDIO_REGISTER_MODE_MISSING, 0]; // range, mode, ioctls
            ensure!(
                libc::ioctl(fd as i32, UFFDIO_REGISTER, reg.as_mut_ptr()) == 0,
                "UFFDIO_REGISTER: {}",
                std::io::Error::last_os_error()
            );
            Ok(page)
        }
    }

    /// Waits until a thread touched the page (and stopped there).
    fn wait_fault(&self, timeout: Duration) -> Result<()> {
        use std::os::fd::AsRawFd;
        let mut pfd = libc::pollfd { fd: self.uffd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one pollfd; the message buffer is uffd_msg's 32 bytes.
        unsafe {
            let n = loop {
                let n = libc::poll(&mut pfd, 1, timeout.as_millis() as i32);
                if n >= 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                    break n;
                }
            };
            ensure!(n == 1, "nothing touched the page");
            let mut msg = [0u8; 32];
            ensure!(libc::read(pfd.fd, msg.as_mut_ptr().cast(), 32) == 32, "reading the fault");
            ensure!(msg[0] == UFFD_EVENT_PAGEFAULT, "event {:#x}", msg[0]);
        }
        Ok(())
    }

    /// Maps the page (zeros): the stopped thread goes on.
    fn release(&self) -> Result<()> {
        use std::os::fd::AsRawFd;
        let zeros = vec![0u8; self.len];
        // dst, src, len, mode, copy
        let mut copy = [self.page as u64, zeros.as_ptr() as u64, self.len as u64, 0, 0];
        // SAFETY: the source holds len bytes; dst is the registered page.
        let rc = unsafe { libc::ioctl(self.uffd.as_raw_fd(), UFFDIO_COPY, copy.as_mut_ptr()) };
        ensure!(rc == 0, "UFFDIO_COPY: {}", std::io::Error::last_os_error());
        Ok(())
    }
}

impl Drop for StallingPage {
    fn drop(&mut self) {
        // SAFETY: the mapping this made.
        unsafe { libc::munmap(self.page as *mut libc::c_void, self.len) };
    }
}

/// A namespace, its loopback pair and the connections to it.
type LoopbackPair = (meshwarp_testbed::NetNs, EndpointPair, Vec<(TcpStream, TcpStream)>);

/// An adaptive pair on loopback in a namespace of its own (one segment holds
/// 64 KiB there) and `n` connections to it, Nagle on: (client, server).
fn loopback_pair(k: &KernelTest, port: u16, n: usize) -> Result<LoopbackPair> {
    let ns = meshwarp_testbed::NetNs::new("busy")?;
    let addr = SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), port);
    let l = ns.listen(addr)?;
    let pair = EndpointPair::new(addr.ip(), addr.into())?;
    k.dp().insert(&pair, "test")?;
    let conns = connections_from(&ns, &l, addr, n)?;
    Ok((ns, pair, conns))
}

/// A stream TCP would coalesce (Nagle on, 8 KiB writes: over the small-write
/// bar, under a loopback segment) that stays on the fast path (its reader
/// was behind at message 64), whose reader is busy copying out (here
/// stopped inside its copy, holding its socket lock): its next message takes
/// the TCP path instead of waiting for that lock, so the write returns at
/// once; past message 64 of a run that is a demotion (`demotions_around`):
/// the rest of the run stays on TCP, read or not, and the first message
/// after a reply, every TCP byte read, is redirected again. Every byte
/// checked, both ways.
#[test]
fn a_coalescing_stream_goes_around_a_busy_reader() -> Result<()> {
    const W: usize = 8192;
    let k = kernel_test!();
    // Writer and readers on one CPU: its 8 KiB writes average over 4 KiB,
    // and a reader on another CPU with bytes unread would send them
    // around too (reader_concurrent); here only the stopped copy may.
    meshwarp_testbed::pin_to_one_cpu()?;
    let (_ns, pair, mut conns) = loopback_pair(&k, 8212, 1)?;
    let (c, s) = conns.remove(0);
    let (mut up_w, mut up_r) = (Stream::new(47), Stream::new(47));
    let (mut dn_w, mut dn_r) = (Stream::new(48), Stream::new(48));

    // A run without a reply past MW_POLICY_COALESCE (64) messages: its
    // first 64 written before the reader reads (a reader behind: the run
    // stays on the fast path), then two more read as they come.
    const RUN: u64 = 66;
    up_w.write(&c, 64 * W, W)?;
    up_r.read(&s, 64 * W)?;
    for _ in 64..RUN {
        up_w.write(&c, W, W)?;
        up_r.read(&s, W)?;
    }
    let st = k.dp().stats(&pair)?;
    ensure!(st.redirected_msgs == RUN && st.fallback_reader_busy == 0 && st.demotions_coalesce == 0, "{st:?}");

    // One more, which the reader starts copying into the stalling page.
    up_w.write(&c, W, W)?;
    let (returned, plen) = write_while_reader_stalled((&s, &mut up_r, W), (&c, &mut up_w, W), Duration::from_secs(10))?;
    ensure!(returned, "the write waited for the busy reader's lock");
    let st = k.dp().stats(&pair)?;
    ensure!(
        st.demotions_around == 1 && st.fallback_reader_busy == 0 && st.redirected_msgs == RUN + 1,
        "the busy reader's message went on TCP, the run demoted: {st:?}"
    );

    // The rest of the run stays on TCP, whether its reader caught up or not.
    up_w.write(&c, W, W)?;
    up_r.read(&s, (W - plen) + 2 * W)?;
    up_w.write(&c, W, W)?;
    up_r.read(&s, W)?;
    let st = k.dp().stats(&pair)?;
    ensure!(st.redirected_msgs == RUN + 1 && st.promotions == 0 && st.fallback_tcp_path == 0, "{st:?}");

    // A reply ends the run: the next message, every TCP byte read, is
    // redirected again.
    dn_w.write(&s, 64, 64)?;
    dn_r.read(&c, 64)?;
    up_w.write(&c, W, W)?;
    up_r.read(&s, W)?;
    let st = k.dp().stats(&pair)?;
    ensure!(
        st.redirected_msgs == RUN + 3 && st.promotions == 1 && st.demotions_around == 1 && st.demotions_coalesce == 0,
        "{st:?}"
    );
    Ok(())
}

/// Starts a read of up to `read_len` bytes (of stream `r`) on `s` that
/// stops inside its copy, holding `s`'s socket lock (a [`StallingPage`]),
/// then writes `write_len` bytes of stream `w` on `c` in one write: whether
/// that write returned within `patience` while the read was stopped. The
/// read is then let go and its bytes checked; also returns how many it read.
fn write_while_reader_stalled(
    (s, r, read_len): (&TcpStream, &mut Stream, usize),
    (c, w, write_len): (&TcpStream, &mut Stream, usize),
    patience: Duration,
) -> Result<(bool, usize)> {
    use std::os::fd::AsRawFd;
    let page = StallingPage::new()?;
    let (at, plen, fd) = (page.page, page.len.min(read_len), s.as_raw_fd());
    let (returned, got) = thread::scope(|scope| -> Result<(bool, isize)> {
        // SAFETY: the page stays mapped until the scope ends.
        let reader = scope.spawn(move || unsafe { libc::recv(fd, at as *mut libc::c_void, plen, 0) });
        let waited = page.wait_fault(Duration::from_secs(10)).map(|()| {
            let (tx, rx) = std::sync::mpsc::channel();
            let writer = scope.spawn(move || {
                let r = w.write(c, write_len, write_len);
                tx.send(()).ok();
                r
            });
            (rx.recv_timeout(patience).is_ok(), writer)
        });
        // Whatever happened, the reader goes on before the scope joins it.
        let released = page.release();
        let (returned, writer) = waited?;
        released?;
        writer.join().unwrap()?;
        Ok((returned, reader.join().unwrap()))
    })?;
    ensure!(got > 0 && got <= plen as isize, "the stopped read returned {got}");
    let got = got as usize;
    // SAFETY: the page is mapped, and recv filled `got` bytes of it.
    let copied = unsafe { std::slice::from_raw_parts(at as *const u8, got) };
    for (i, b) in copied.iter().enumerate() {
        ensure!(*b == pattern_byte(r.seed, r.at + i as u64), "wrong byte at offset {}", r.at + i as u64);
    }
    r.at += got as u64;
    Ok((returned, got))
}

/// The server copies a `len`-byte request out (stopped inside that copy,
/// holding its lock) while the client writes `next` bytes more; then the
/// server reads the rest of both, checked. Whether the client's write
/// returned within `patience` (see [`write_while_reader_stalled`]).
fn write_while_request_copied(
    (s, r, len): (&TcpStream, &mut Stream, usize),
    (c, w, next): (&TcpStream, &mut Stream, usize),
    patience: Duration,
) -> Result<bool> {
    let (returned, got) = write_while_reader_stalled((s, &mut *r, len), (c, w, next), patience)?;
    r.read(s, len - got + next)?;
    Ok(returned)
}

/// Nodelay, one CPU: the first message after the peer's (an answer, or
/// the next request after one) into a peer whose reader is copying out,
/// holding its lock, takes TCP rather than sleep on that lock: a 100 B
/// answer into the client, a 16 KiB request into the server. Both writes
/// return while the reader is stopped; a run's later messages do not look
/// (streams are judged past MW_POLICY_RUN) unless they are pipelined
/// requests of 4 KiB or more, sent before the peer's answer was read; the
/// next exchange, every TCP byte read, is redirected again. Every byte
/// checked, both ways.
#[test]
fn a_nodelay_runs_first_message_goes_around_a_peer_holding_its_lock() -> Result<()> {
    const W: usize = 16 << 10;
    let k = kernel_test!();
    meshwarp_testbed::pin_to_one_cpu()?;
    let (_ns, pair, mut conns) = loopback_pair(&k, 8219, 2)?;
    let (c, s) = conns.remove(0);
    let (c2, s2) = conns.remove(0);
    for sock in [&c, &s, &c2, &s2] {
        sock.set_nodelay(true)?;
    }
    // Redirected messages and those sent around the peer's lock so far.
    let counters = |what: &str, redirected: u64, around: u64| -> Result<()> {
        let st = k.dp().stats(&pair)?;
        ensure!(st.redirected_msgs == redirected && st.fallback_reader_busy == around, "{what}: {st:?}");
        Ok(())
    };
    let (mut up_w, mut up_r) = (Stream::new(61), Stream::new(61));
    let (mut dn_w, mut dn_r) = (Stream::new(62), Stream::new(62));

    // R1, A1, R2 redirected (A1 read only below).
    up_w.write(&c, 64, 64)?;
    up_r.read(&s, 64)?;
    dn_w.write(&s, 64, 64)?;
    up_w.write(&c, 64, 64)?;
    up_r.read(&s, 64)?;
    counters("R1, A1, R2 redirected", 3, 0)?;
    // The client copies A1 out (stopped there); the server's answer to R2
    // takes TCP.
    let (returned, got) =
        write_while_reader_stalled((&c, &mut dn_r, 64), (&s, &mut dn_w, 100), Duration::from_secs(10))?;
    ensure!(returned, "the answer waited for the client's lock");
    dn_r.read(&c, 64 - got + 100)?;
    counters("the answer took TCP", 3, 1)?;

    // Requests of 16 KiB: R3 redirected, answered (A3, redirected, read
    // later); the server copies R3 out (stopped there); R4, the client's
    // first message since A3, takes TCP.
    up_w.write(&c, W, W)?;
    dn_w.write(&s, 64, 64)?;
    let returned = write_while_request_copied((&s, &mut up_r, W), (&c, &mut up_w, W), Duration::from_secs(10))?;
    ensure!(returned, "the request waited for the server's lock");
    dn_r.read(&c, 64)?;
    counters("R4 took TCP", 5, 2)?;

    // A run's later message into a reader copying out is redirected
    // (waits for the lock): R5 and R6 (R4 started the run), no answer
    // between. (This client read on two threads: its psock reads are no
    // longer counted, so whether it read the answers is not judged.)
    up_w.write(&c, W, W)?;
    let returned = write_while_request_copied((&s, &mut up_r, W), (&c, &mut up_w, W), Duration::from_millis(300))?;
    ensure!(!returned, "R6 went around its reader");
    counters("R5, R6 redirected", 7, 2)?;

    // A new exchange, every TCP byte read: redirected both ways again.
    dn_w.write(&s, 64, 64)?;
    dn_r.read(&c, 64)?;
    up_w.write(&c, W, W)?;
    up_r.read(&s, W)?;
    let st = k.dp().stats(&pair)?;
    ensure!(st.redirected_msgs == 9 && st.fallback_reader_busy == 2 && st.fallback_tcp_path == 0, "{st:?}");

    // Pipelined, on a second connection whose client reads on one thread
    // (the first one's read on two: its psock reads are not counted): the
    // server answers first (A, redirected, not read yet); R10 is
    // redirected and the server copies it out (stopped there); R11, the
    // run's second message but sent before A was read, takes TCP.
    let (mut up2_w, mut up2_r) = (Stream::new(63), Stream::new(63));
    let (mut dn2_w, mut dn2_r) = (Stream::new(64), Stream::new(64));
    dn2_w.write(&s2, 64, 64)?;
    up2_w.write(&c2, W, W)?;
    let returned = write_while_request_copied((&s2, &mut up2_r, W), (&c2, &mut up2_w, W), Duration::from_secs(10))?;
    ensure!(returned, "the pipelined request waited for the server's lock");
    dn2_r.read(&c2, 64)?;
    counters("R11 took TCP", 11, 3)?;

    // Not pipelined, the same client: every answer read, R12 and R13 (the
    // run's third and fourth) into the server copying R12 out: R13 waits.
    up2_w.write(&c2, W, W)?;
    let returned = write_while_request_copied((&s2, &mut up2_r, W), (&c2, &mut up2_w, W), Duration::from_millis(300))?;
    ensure!(!returned, "R13 went around its reader with no answer unread");
    counters("R12, R13 redirected", 13, 3)?;

    // An answer unread but a request under 4 KiB: A (redirected), then
    // R14 (16 KiB, the run's first, the server not busy) and R15 (1 KiB)
    // into the server copying R14 out: R15 waits.
    dn2_w.write(&s2, 64, 64)?;
    up2_w.write(&c2, W, W)?;
    let returned =
        write_while_request_copied((&s2, &mut up2_r, W), (&c2, &mut up2_w, 1024), Duration::from_millis(300))?;
    ensure!(!returned, "a 1 KiB request went around its reader");
    dn2_r.read(&c2, 64)?;
    counters("A, R14, R15 redirected", 16, 3)?;
    Ok(())
}

/// Loopback (one segment holds 64 KiB, so 16 KiB Nagle writes are under
/// it), eight connections each streaming one way (half of them each way; a
/// reply would end the run) with readers that read in varied pieces, then
/// a half-close: messages go around busy readers (how often depends on timing;
/// `a_coalescing_stream_goes_around_a_busy_reader` makes it happen for sure)
/// and come back. Every byte arrives once, in order, then the end of the
/// stream.
#[test]
fn streams_around_busy_readers_lose_nothing() -> Result<()> {
    const LEN: usize = 4 << 20;
    let k = kernel_test!();
    let (_ns, pair, conns) = loopback_pair(&k, 8213, 8)?;
    thread::scope(|scope| -> Result<()> {
        let mut handles = Vec::new();
        for (n, (c, s)) in conns.iter().enumerate() {
            let (from, to) = if n % 2 == 0 { (c, s) } else { (s, c) };
            let seed = 200 + n as u64;
            handles.push(scope.spawn(move || -> Result<()> {
                let mut w = Stream::new(seed);
                let chunk = [16 << 10, 40 << 10, 30_000][n % 3];
                w.write(from, LEN, chunk)?;
                from.shutdown(std::net::Shutdown::Write)?;
                Ok(())
            }));
            handles.push(scope.spawn(move || -> Result<()> {
                let mut r = Stream::new(seed);
                let mut left = LEN;
                let mut i = 0usize;
                while left > 0 {
                    let piece = left.min([4096, 65536, 1, 20_000, 131_072][i % 5]);
                    r.read(to, piece)?;
                    left -= piece;
                    i += 1;
                }
                let mut end = [0u8; 1];
                let n = meshwarp_testbed::read_ready(&mut &*to, &mut end, T)?;
                ensure!(n == 0, "stream {seed}: {n} bytes after the end");
                Ok(())
            }));
        }
        for h in handles {
            h.join().unwrap()?;
        }
        Ok(())
    })?;
    let st = k.dp().stats(&pair)?;
    ensure!(st.sockets == 16 && st.redirected_msgs > 0, "{st:?}");
    eprintln!("fallback_reader_busy {}, fallback_tcp_path {}", st.fallback_reader_busy, st.fallback_tcp_path);
    Ok(())
}
