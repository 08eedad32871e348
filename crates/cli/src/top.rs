//! `meshwarp top` and the other live views, apart from the RPCs: traffic
//! rates per rule from two connection lists, the frame `top` shows (rules
//! by traffic, with connections, rates and latency quantiles), and
//! [`Screen`], which redraws frames in place on a terminal (and restores the
//! cursor when dropped) or prints them one after another elsewhere.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, Write};
use std::time::Duration;

use meshwarp_grpc_api::pb;

use crate::conns::fully_fast;
use crate::latency::{MetricArg, StateView};
use crate::output::{human_ns, human_per_s, human_rate, rule_description, table};

/// What one socket had sent when the connections were listed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Sent {
    rule: u32,
    fast_bytes: u64,
    tcp_bytes: u64,
    fast_msgs: u64,
}

/// The sockets of one listing, by cookie, with what each had sent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    sent: BTreeMap<u64, Sent>,
}

impl Snapshot {
    pub fn from_connections(conns: &[pb::Connection]) -> Self {
        let sent = conns
            .iter()
            .map(|c| {
                let tx = c.tx.unwrap_or_default();
                let rule = c.rule.as_ref().map(|r| r.rule_id).unwrap_or(0);
                (
                    c.cookie,
                    Sent { rule, fast_bytes: tx.fast_bytes, tcp_bytes: tx.tcp_bytes, fast_msgs: tx.fast_messages },
                )
            })
            .collect();
        Self { sent }
    }
}

/// A rule's traffic per second between two listings.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RuleRates {
    pub fast_bytes: f64,
    pub tcp_bytes: f64,
    pub fast_msgs: f64,
}

impl RuleRates {
    pub fn bytes(&self) -> f64 {
        self.fast_bytes + self.tcp_bytes
    }
}

/// Traffic per rule and second from `prev` to `cur`, `secs` apart: what
/// every socket sent in between (each byte is sent by exactly one end, so
/// both directions count once). A socket is compared with itself (by
/// cookie): one that closed in between is gone from `cur` and counts
/// nothing, never a negative rate; one that appeared counts all it sent; a
/// counter that went back counts 0.
pub fn rates(prev: &Snapshot, cur: &Snapshot, secs: f64) -> BTreeMap<u32, RuleRates> {
    let mut out: BTreeMap<u32, RuleRates> = BTreeMap::new();
    if secs <= 0.0 {
        return out;
    }
    for (cookie, now) in &cur.sent {
        let before = prev.sent.get(cookie).copied().unwrap_or_default();
        let r = out.entry(now.rule).or_default();
        r.fast_bytes += now.fast_bytes.saturating_sub(before.fast_bytes) as f64 / secs;
        r.tcp_bytes += now.tcp_bytes.saturating_sub(before.tcp_bytes) as f64 / secs;
        r.fast_msgs += now.fast_msgs.saturating_sub(before.fast_msgs) as f64 / secs;
    }
    out
}

/// One refresh of `top`.
#[derive(Debug, Clone, Copy)]
pub struct Frame<'a> {
    /// The sockets listed now.
    pub conns: &'a [pb::Connection],
    /// Rates since the previous refresh (None on the first).
    pub rates: Option<&'a BTreeMap<u32, RuleRates>>,
    pub latency: &'a pb::GetLatencyResponse,
    pub interval: Duration,
    /// Which refresh this is, from 1.
    pub refresh: u64,
}

/// A rule's row.
#[derive(Debug, Clone, Default, PartialEq)]
struct Row {
    rule: u32,
    desc: String,
    conns: usize,
    fast_conns: usize,
    rates: Option<RuleRates>,
    /// (p50, p99) of the fast, TCP and response histograms.
    fast: Option<(u64, u64)>,
    tcp: Option<(u64, u64)>,
    response: Option<(u64, u64)>,
}

fn quantiles(q: Option<(u64, u64)>) -> String {
    match q {
        Some((p50, p99)) => format!("{}/{}", human_ns(p50), human_ns(p99)),
        None => "-".into(),
    }
}

/// The rows of a frame, the busiest rule first.
fn rows(f: &Frame<'_>) -> Vec<Row> {
    let mut rows: BTreeMap<u32, Row> = BTreeMap::new();
    let mut row = |r: &pb::RuleRef| {
        let row = rows.entry(r.rule_id).or_insert_with(|| Row { rule: r.rule_id, ..Default::default() });
        if row.desc.is_empty() {
            row.desc = rule_description(r);
        }
        r.rule_id
    };
    // A connection: its id (both ends share it), else the socket's cookie;
    // fast when every end listed is fast both ways.
    let mut connections: BTreeMap<u32, BTreeMap<(bool, u64), bool>> = BTreeMap::new();
    for c in f.conns {
        let id = row(&c.rule.clone().unwrap_or_default());
        let key = if c.connection_id != 0 { (true, c.connection_id) } else { (false, c.cookie) };
        let fast = connections.entry(id).or_default().entry(key).or_insert(true);
        *fast &= fully_fast(c);
    }
    let enabled = f.latency.state.as_ref().is_some_and(|s| s.enabled);
    let mut latency: BTreeMap<(u32, MetricArg), (u64, u64)> = BTreeMap::new();
    for h in &f.latency.histograms {
        let metric = MetricArg::from_pb(h.metric);
        if !matches!(metric, Some(MetricArg::Fast | MetricArg::Tcp | MetricArg::Response)) {
            continue;
        }
        let id = row(&h.rule.clone().unwrap_or_default());
        if let (Some(m), true, true) = (metric, enabled, h.count > 0) {
            latency.insert((id, m), (h.p50_ns, h.p99_ns));
        }
    }
    let mut out: Vec<Row> = rows
        .into_values()
        .map(|mut r| {
            let c = connections.get(&r.rule);
            r.conns = c.map_or(0, BTreeMap::len);
            r.fast_conns = c.map_or(0, |c| c.values().filter(|&&fast| fast).count());
            r.rates = f.rates.map(|rates| rates.get(&r.rule).copied().unwrap_or_default());
            r.fast = latency.get(&(r.rule, MetricArg::Fast)).copied();
            r.tcp = latency.get(&(r.rule, MetricArg::Tcp)).copied();
            r.response = latency.get(&(r.rule, MetricArg::Response)).copied();
            r
        })
        .collect();
    out.sort_by(|a, b| {
        let bytes = |r: &Row| r.rates.map_or(0.0, |x| x.bytes());
        bytes(b).total_cmp(&bytes(a)).then(b.conns.cmp(&a.conns)).then(a.rule.cmp(&b.rule))
    });
    out
}

/// The text of a frame: two header lines, then one row per rule.
pub fn render_frame(f: &Frame<'_>) -> String {
    let rows = rows(f);
    let rules: BTreeSet<u32> = f.conns.iter().map(|c| c.rule.as_ref().map_or(0, |r| r.rule_id)).collect();
    let fast = f.conns.iter().filter(|c| fully_fast(c)).count();
    let mut out = format!(
        "meshwarp top: every {:.1}s (refresh {}); {} sockets in {} rules, {fast} on the fast path both ways\n",
        f.interval.as_secs_f64(),
        f.refresh,
        f.conns.len(),
        rules.len()
    );
    let state = StateView::from_pb(&f.latency.state);
    if state.enabled {
        out.push_str(&format!("{}; latency p50/p99 since it was switched on\n", state.line()));
    } else {
        out.push_str("latency monitor off: no latency columns (`meshwarp latency on` switches it on)\n");
    }
    let mut t = table(
        &[
            "RULE",
            "WHAT",
            "CONNS",
            "FAST",
            "FAST B/s",
            "TCP B/s",
            "MSG/s",
            "FAST p50/p99",
            "TCP p50/p99",
            "RESPONSE p50/p99",
        ],
        &[0, 2, 3, 4, 5, 6],
    );
    for r in &rows {
        let rate = |v: fn(&RuleRates) -> f64, show: fn(f64) -> String| r.rates.as_ref().map(v).map_or("-".into(), show);
        t.add_row([
            r.rule.to_string(),
            if r.desc.is_empty() { "-".into() } else { r.desc.clone() },
            r.conns.to_string(),
            r.fast_conns.to_string(),
            rate(|x| x.fast_bytes, human_rate),
            rate(|x| x.tcp_bytes, human_rate),
            rate(|x| x.fast_msgs, human_per_s),
            quantiles(r.fast),
            quantiles(r.tcp),
            quantiles(r.response),
        ]);
    }
    out.push_str(&t.to_string());
    out.push('\n');
    if rows.is_empty() {
        out.push_str("(no connections on any rule)\n");
    }
    out
}

/// Where live frames go: on a terminal each frame replaces the previous one
/// (cursor home, every line cleared to its end, the rest of the screen
/// cleared; the cursor hidden meanwhile and shown again on drop); elsewhere
/// frames follow each other, a blank line between two.
#[derive(Debug)]
pub struct Screen<W: Write> {
    out: W,
    tty: bool,
    frames: u64,
}

impl<W: Write> Screen<W> {
    pub fn new(out: W, tty: bool) -> Self {
        Self { out, tty, frames: 0 }
    }

    /// Shows `text` as the next frame.
    pub fn show(&mut self, text: &str) -> io::Result<()> {
        let mut buf = String::new();
        if self.tty {
            if self.frames == 0 {
                buf.push_str("\x1b[?25l\x1b[2J");
            }
            buf.push_str("\x1b[H");
            for line in text.lines() {
                buf.push_str(line);
                buf.push_str("\x1b[K\n");
            }
            buf.push_str("\x1b[J");
        } else {
            if self.frames > 0 {
                buf.push('\n');
            }
            buf.push_str(text);
            if !text.ends_with('\n') {
                buf.push('\n');
            }
        }
        self.frames += 1;
        self.out.write_all(buf.as_bytes())?;
        self.out.flush()
    }
}

impl<W: Write> Drop for Screen<W> {
    fn drop(&mut self) {
        if self.tty && self.frames > 0 {
            // Best effort: the terminal may be gone.
            let _ = self.out.write_all(b"\x1b[?25h");
            let _ = self.out.flush();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conns::tests::conn;
    use crate::latency::tests::{hist, pair_ref};

    #[test]
    fn rates_compare_each_socket_with_itself() {
        // Rule 3: socket 1 sends 2000 fast bytes in 2 s; socket 2, which
        // had sent 50 000, closes. Rule 4: socket 3 appears with 600 TCP
        // bytes; socket 4's counter went back (clamped).
        let prev = Snapshot::from_connections(&[
            conn(1, 3, true, true, (1000, 0)),
            conn(2, 3, false, true, (50_000, 0)),
            conn(4, 4, true, false, (0, 900)),
        ]);
        let cur = Snapshot::from_connections(&[
            conn(1, 3, true, true, (3000, 0)),
            conn(3, 4, false, false, (0, 600)),
            conn(4, 4, true, false, (0, 100)),
        ]);
        let r = rates(&prev, &cur, 2.0);
        assert_eq!(r[&3], RuleRates { fast_bytes: 1000.0, tcp_bytes: 0.0, fast_msgs: 0.0 });
        assert_eq!(r[&4].tcp_bytes, 300.0);
        assert_eq!(r[&4].fast_msgs, 1.5, "socket 3's 3 messages, new");
        // Only vanished sockets: nothing, not a negative rate.
        let gone = rates(&prev, &Snapshot::default(), 1.0);
        assert!(gone.is_empty());
        let closed = Snapshot::from_connections(&[conn(1, 3, true, true, (1000, 0))]);
        assert_eq!(rates(&prev, &closed, 1.0)[&3].bytes(), 0.0);
        assert!(rates(&prev, &cur, 0.0).is_empty());
    }

    #[test]
    fn frame_sorts_rules_by_traffic_and_shows_latency() {
        let mut conns = vec![
            conn(10, 3, true, true, (100, 0)),
            conn(11, 3, false, true, (100, 0)),
            conn(20, 5, true, true, (0, 0)),
            conn(21, 5, false, false, (0, 0)),
        ];
        conns[1].connection_id = conns[0].connection_id;
        conns[3].connection_id = conns[2].connection_id;
        conns[0].rule = Some(pair_ref(3, "10.0.0.1", "10.0.0.2", 80));
        let mut rates = BTreeMap::new();
        rates.insert(3, RuleRates { fast_bytes: 10.0, ..Default::default() });
        rates.insert(5, RuleRates { fast_bytes: 2048.0, tcp_bytes: 1024.0, fast_msgs: 1500.0 });
        let latency = pb::GetLatencyResponse {
            state: Some(pb::LatencyState { enabled: true, all_rules: true, ..Default::default() }),
            histograms: vec![
                hist(pair_ref(5, "10.0.0.5", "10.0.0.6", 80), pb::LatencyMetric::Response, None, &[(20, 1)]),
                hist(pair_ref(5, "10.0.0.5", "10.0.0.6", 80), pb::LatencyMetric::Think, None, &[(20, 1)]),
            ],
        };
        let frame = Frame {
            conns: &conns,
            rates: Some(&rates),
            latency: &latency,
            interval: Duration::from_secs(1),
            refresh: 2,
        };
        let text = render_frame(&frame);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0], "meshwarp top: every 1.0s (refresh 2); 4 sockets in 2 rules, 3 on the fast path both ways",
            "{text}"
        );
        assert!(lines[1].starts_with("latency monitor on for every rule"), "{text}");
        let row5: Vec<&str> = lines[3].split_whitespace().collect();
        assert_eq!(
            row5,
            [
                "5",
                "pair",
                "10.0.0.5",
                "->",
                "10.0.0.6:80",
                "1",
                "0",
                "2.0KiB/s",
                "1.0KiB/s",
                "1.5k/s",
                "-",
                "-",
                "1.5ms/3.9ms"
            ],
            "{text}"
        );
        let row3: Vec<&str> = lines[4].split_whitespace().collect();
        assert_eq!(
            row3,
            ["3", "pair", "10.0.0.1", "->", "10.0.0.2:80", "1", "1", "10B/s", "0B/s", "0/s", "-", "-", "-"],
            "{text}"
        );

        // Monitor off and no rates yet.
        let off = pb::GetLatencyResponse::default();
        let first = Frame { rates: None, latency: &off, refresh: 1, ..frame };
        let text = render_frame(&first);
        assert!(text.lines().nth(1).unwrap().starts_with("latency monitor off"), "{text}");
        assert!(!text.contains("ms/"), "{text}");
        assert!(text.lines().nth(3).unwrap().contains(" - "), "{text}");
    }

    #[test]
    fn screen_redraws_in_place_only_on_a_terminal() {
        let mut plain = Vec::new();
        {
            let mut s = Screen::new(&mut plain, false);
            s.show("a\nb\n").unwrap();
            s.show("c").unwrap();
        }
        assert_eq!(String::from_utf8(plain).unwrap(), "a\nb\n\nc\n");
        let mut tty = Vec::new();
        {
            let mut s = Screen::new(&mut tty, true);
            s.show("a\nb").unwrap();
            s.show("c").unwrap();
        }
        let tty = String::from_utf8(tty).unwrap();
        assert_eq!(tty, "\x1b[?25l\x1b[2J\x1b[Ha\x1b[K\nb\x1b[K\n\x1b[J\x1b[Hc\x1b[K\n\x1b[J\x1b[?25h");
    }
}
