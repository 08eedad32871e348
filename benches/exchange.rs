//! The exchanges between a round trip and a stream (`#[path]`-included by
//! the paths bench): a small request answered by a large streamed response
//! (a file download), a large streamed request answered by a small one (an
//! upload, a cache's set), and bursts of pipelined requests. Each is one
//! connection's exchanges, timed from its first request to its last answer.

use std::net::{Shutdown, SocketAddr};
use std::time::{Duration, Instant};

use meshwarp_testbed::{accept_timeout, read_exact_ready, read_ready, write_all_ready, NetNs};

const TIMEOUT: Option<Duration> = Some(Duration::from_secs(30));

/// A connected pair in `ns` (a listener on `listen`, a client connecting to
/// `to`: the same address, or one iptables captures to it), both ends with
/// TCP_NODELAY set to `nodelay`: (client, accepted).
pub fn connected(
    ns: &NetNs,
    listen: SocketAddr,
    to: SocketAddr,
    nodelay: bool,
) -> (std::net::TcpStream, std::net::TcpStream) {
    let l = ns.listen(listen).expect("listen");
    let c = ns.connect(to).expect("connect");
    let s = accept_timeout(&l, Duration::from_secs(5)).expect("accept");
    c.set_nodelay(nodelay).expect("nodelay");
    s.set_nodelay(nodelay).expect("nodelay");
    (c, s)
}

/// `requests` times: a 64 B request, answered by `size` bytes that the
/// server writes `write` bytes at a time (keep-alive: one connection).
/// Returns the time per request.
pub fn download(ns: &NetNs, addr: SocketAddr, nodelay: bool, write: usize, size: usize, requests: u32) -> Duration {
    let (mut c, mut s) = connected(ns, addr, addr, nodelay);
    std::thread::scope(|scope| {
        scope.spawn(move || {
            let mut req = [0u8; 64];
            let chunk = vec![0x42u8; write];
            while read_exact_ready(&mut s, &mut req, TIMEOUT).is_ok() {
                let mut left = size;
                while left > 0 {
                    let n = write.min(left);
                    write_all_ready(&mut s, &chunk[..n], TIMEOUT).expect("response write");
                    left -= n;
                }
            }
        });
        let mut buf = vec![0u8; 64 * 1024];
        let start = Instant::now();
        for _ in 0..requests {
            write_all_ready(&mut c, &[0x51; 64], TIMEOUT).expect("request write");
            let mut got = 0;
            while got < size {
                let want = (size - got).min(buf.len());
                match read_ready(&mut c, &mut buf[..want], TIMEOUT) {
                    Ok(0) => panic!("response ended after {got} of {size} bytes"),
                    Ok(n) => got += n,
                    Err(e) => panic!("response read: {e}"),
                }
            }
        }
        let t = start.elapsed() / requests;
        c.shutdown(Shutdown::Write).expect("shutdown");
        t
    })
}

/// `requests` times: a request of `size` bytes that the client writes
/// `write` bytes at a time, answered by 64 B once the server read all of it
/// (keep-alive: one connection). Returns the time per request.
pub fn upload(ns: &NetNs, addr: SocketAddr, nodelay: bool, write: usize, size: usize, requests: u32) -> Duration {
    let (mut c, mut s) = connected(ns, addr, addr, nodelay);
    std::thread::scope(|scope| {
        scope.spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            'requests: loop {
                let mut got = 0;
                while got < size {
                    let want = (size - got).min(buf.len());
                    match read_ready(&mut s, &mut buf[..want], TIMEOUT) {
                        Ok(0) if got == 0 => break 'requests,
                        Ok(0) => panic!("request ended after {got} of {size} bytes"),
                        Ok(n) => got += n,
                        Err(e) => panic!("request read: {e}"),
                    }
                }
                write_all_ready(&mut s, &[0x41; 64], TIMEOUT).expect("answer write");
            }
        });
        let chunk = vec![0x51u8; write];
        let mut answer = [0u8; 64];
        let start = Instant::now();
        for _ in 0..requests {
            let mut left = size;
            while left > 0 {
                let n = write.min(left);
                write_all_ready(&mut c, &chunk[..n], TIMEOUT).expect("request write");
                left -= n;
            }
            read_exact_ready(&mut c, &mut answer, TIMEOUT).expect("answer read");
        }
        let t = start.elapsed() / requests;
        c.shutdown(Shutdown::Write).expect("shutdown");
        t
    })
}

/// `bursts` times: `k` requests of `size` bytes written back to back, each
/// answered with `answer` bytes as the server reads it (pipelining, as a
/// redis client does); the client reads the `k` answers once it wrote them
/// all. Returns the time per burst.
pub fn burst(
    ns: &NetNs,
    addr: SocketAddr,
    nodelay: bool,
    k: usize,
    size: usize,
    answer: usize,
    bursts: u32,
) -> Duration {
    let (mut c, mut s) = connected(ns, addr, addr, nodelay);
    std::thread::scope(|scope| {
        scope.spawn(move || {
            let mut req = vec![0u8; size];
            let ans = vec![0x41u8; answer];
            while read_exact_ready(&mut s, &mut req, TIMEOUT).is_ok() {
                write_all_ready(&mut s, &ans, TIMEOUT).expect("answer write");
            }
        });
        let msg = vec![0x51u8; size];
        let mut answers = vec![0u8; k * answer];
        let start = Instant::now();
        for _ in 0..bursts {
            for _ in 0..k {
                write_all_ready(&mut c, &msg, TIMEOUT).expect("request write");
            }
            read_exact_ready(&mut c, &mut answers, TIMEOUT).expect("answers read");
        }
        let t = start.elapsed() / bursts;
        c.shutdown(Shutdown::Write).expect("shutdown");
        t
    })
}
