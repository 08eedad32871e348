//! A listener's first client in another namespace, when the listener is no
//! redirect target (here SO_RCVLOWAT; haproxy, which can splice, is the real
//! case): no hint exists at its connect, so its end joins `mw_sockmap`, and
//! the server end then moves it to `mw_tgtmap`, where its sends run no
//! sk_msg. An upload of small Nagle writes from that client against the same
//! upload over plain TCP, interleaved, each turn on a fresh listener (every
//! covered client is a first one). The writer's time, medians.
//!
//! `cargo bench -p meshwarp-benches --bench first_client` (as root;
//! `MESHWARP_FIRST_TURNS`, default 15).

use std::net::{SocketAddr, TcpListener};
use std::thread;
use std::time::{Duration, Instant};

use meshwarp_core::EndpointPair;
use meshwarp_testbed::{accept_timeout, read_ready, write_all_ready, KernelTest, NodeWithPods};

// interleaved_medians is not used here.
#[allow(dead_code)]
#[path = "interleave.rs"]
mod interleave;

const T: Duration = Duration::from_secs(60);
const TOTAL: usize = 4 << 20;

fn no_target_listener(net: &NodeWithPods, addr: SocketAddr) -> TcpListener {
    let l = net.pods[1].ns.listen(addr).expect("listen");
    meshwarp_testbed::set_int_opt(&l, libc::SOL_SOCKET, libc::SO_RCVLOWAT, 100).expect("SO_RCVLOWAT");
    l
}

/// One upload of TOTAL bytes in `write`-byte writes (Nagle on) from pod 0 to
/// a fresh listener on `port` in pod 1; the writer's time.
fn upload(net: &NodeWithPods, l: &TcpListener, addr: SocketAddr, write: usize) -> Duration {
    let c = net.pods[0].ns.connect(addr).expect("connect");
    let s = accept_timeout(l, T).expect("accept");
    let reader = thread::spawn(move || {
        let (mut r, mut buf, mut got) = (&s, vec![0u8; 64 << 10], 0usize);
        loop {
            match read_ready(&mut r, &mut buf, Some(T)).expect("read") {
                0 => return got,
                n => got += n,
            }
        }
    });
    let msg = vec![0x5au8; write];
    let mut w = &c;
    let start = Instant::now();
    for _ in 0..TOTAL / write {
        write_all_ready(&mut w, &msg, Some(T)).expect("write");
    }
    let took = start.elapsed();
    c.shutdown(std::net::Shutdown::Write).expect("shutdown");
    assert_eq!(reader.join().expect("reader"), TOTAL, "every byte arrived");
    took
}

fn main() {
    let Some(k) = KernelTest::start(1024) else { return };
    let turns = std::env::var("MESHWARP_FIRST_TURNS").ok().and_then(|v| v.parse().ok()).unwrap_or(15);
    let net = NodeWithPods::new(2).expect("pods");
    let mut port = 9200u16;
    for write in [64usize, 1024] {
        let mut pairs = Vec::new();
        let medians = interleave::interleaved_timed(2, turns, |i| {
            port += 1;
            let addr = SocketAddr::new(net.pods[1].addr(false), port);
            let l = no_target_listener(&net, addr);
            if i == 0 {
                let pair = EndpointPair::new(net.pods[0].addr(false), addr.into()).expect("pair");
                k.dp().insert(&pair, "bench").expect("insert");
                pairs.push(pair);
            }
            upload(&net, &l, addr, write)
        });
        let (mut no_peer, mut moved) = (0, 0);
        for p in &pairs {
            let st = k.dp().stats(p).expect("stats");
            no_peer += st.fallback_no_peer;
            moved += st.tgtmap_clients;
            k.dp().remove(p).expect("remove");
        }
        eprintln!(
            "first_client/{write}B_nagle: covered first client {:.1} ms, tcp {:.1} ms, ratio {:.3}x \
             ({moved} of {} clients moved to mw_tgtmap; {no_peer} sends ran sk_msg to no avail)",
            medians[0] / 1e6,
            medians[1] / 1e6,
            medians[0] / medians[1],
            pairs.len(),
        );
    }
}
