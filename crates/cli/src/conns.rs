//! `meshwarp conns`, apart from the RPCs: its filter flags (cookies in
//! decimal or `0x` hex), the ListConnections request they make, and the
//! connection table.

use meshwarp_grpc_api::pb;

use crate::output::{human_bytes, table};

/// A u64 in decimal or, with `0x` (or `sk:`, as `ss -e` prints socket
/// cookies), in hex.
pub fn parse_u64(s: &str) -> Result<u64, String> {
    let t = s.trim();
    match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")).or_else(|| t.strip_prefix("sk:")) {
        Some(hex) => u64::from_str_radix(hex, 16).map_err(|e| format!("{s:?}: {e}")),
        None => t.parse().map_err(|e| format!("{s:?}: {e}")),
    }
}

/// Which connections by path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PathArg {
    /// Both directions on the fast path.
    Fast,
    /// At least one direction on TCP.
    Tcp,
}

/// The filters of `meshwarp conns`; unset: any.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ConnsFilterArgs {
    /// Only connections of this rule (the id `stats`, `latency` and `top` show).
    #[arg(long)]
    pub rule_id: Option<u32>,
    /// Only sockets of this network namespace (its cookie; decimal or 0x hex).
    #[arg(long, value_name = "COOKIE", value_parser = parse_u64)]
    pub netns: Option<u64>,
    /// Only sockets this process owns or reads.
    #[arg(long)]
    pub pid: Option<u32>,
    /// Only the socket of this cookie, in decimal or 0x hex: `ss -e` prints
    /// the same cookie in hex as `sk:` (`sk:1f3a` is `--cookie 0x1f3a`, and
    /// `--cookie sk:1f3a` works too).
    #[arg(long, value_parser = parse_u64)]
    pub cookie: Option<u64>,
    /// Only sockets whose local or remote port is this.
    #[arg(long)]
    pub port: Option<u16>,
    /// Only connections on this path.
    #[arg(long, value_enum)]
    pub path: Option<PathArg>,
}

/// Connections asked for per page (the most the node gives).
pub const PAGE_SIZE: u32 = 1000;

impl ConnsFilterArgs {
    /// The request for the page after `page_token` (empty: the first).
    pub fn request(&self, page_token: String) -> pb::ListConnectionsRequest {
        pb::ListConnectionsRequest {
            rule_id: self.rule_id,
            netns_cookie: self.netns,
            pid: self.pid,
            cookie: self.cookie,
            port: self.port.map(u32::from),
            path: match self.path {
                None => pb::PathFilter::Unspecified,
                Some(PathArg::Fast) => pb::PathFilter::Fast,
                Some(PathArg::Tcp) => pb::PathFilter::Tcp,
            } as i32,
            page_size: PAGE_SIZE,
            page_token,
        }
    }
}

/// Where a direction's new messages go: `fast`, or `tcp:<reason>`.
pub fn show_path(p: &Option<pb::ConnectionPath>) -> String {
    match p {
        Some(p) if p.fast => "fast".into(),
        Some(p) if !p.tcp_reason.is_empty() => format!("tcp:{}", p.tcp_reason),
        Some(_) => "tcp".into(),
        None => "-".into(),
    }
}

/// Both directions of the socket on the fast path.
pub fn fully_fast(c: &pb::Connection) -> bool {
    c.tx_path.as_ref().is_some_and(|p| p.fast) && c.rx_path.as_ref().is_some_and(|p| p.fast)
}

/// Bytes of one direction, both paths.
pub fn traffic_bytes(t: &Option<pb::ConnectionTraffic>) -> u64 {
    t.as_ref().map(|t| t.fast_bytes.saturating_add(t.tcp_bytes)).unwrap_or(0)
}

/// The connection table: one row per socket, and a count.
pub fn render_table(conns: &[pb::Connection]) -> String {
    let mut t = table(
        &[
            "COOKIE", "NETNS", "LOCAL", "REMOTE", "STATE", "RULE", "END", "TX PATH", "RX PATH", "PID", "COMM", "TX",
            "RX", "UNREAD",
        ],
        &[0, 1, 5, 9, 11, 12, 13],
    );
    for c in conns {
        let pid = if c.owner_pid != 0 { c.owner_pid } else { c.reader_pid };
        t.add_row([
            c.cookie.to_string(),
            c.netns_cookie.to_string(),
            c.local.clone(),
            c.remote.clone(),
            c.state.clone(),
            c.rule.as_ref().map(|r| r.rule_id.to_string()).unwrap_or_else(|| "-".into()),
            if c.client_end { "client" } else { "server" }.to_string(),
            show_path(&c.tx_path),
            show_path(&c.rx_path),
            if pid == 0 { "-".into() } else { pid.to_string() },
            if c.comm.is_empty() { "-".into() } else { c.comm.clone() },
            human_bytes(traffic_bytes(&c.tx)),
            human_bytes(traffic_bytes(&c.rx)),
            human_bytes(u64::from(c.unread_bytes)),
        ]);
    }
    let fast = conns.iter().filter(|c| fully_fast(c)).count();
    let s = if conns.len() == 1 { "" } else { "s" };
    format!("{t}\n({} socket{s}, {fast} on the fast path both ways)", conns.len())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn conn(cookie: u64, rule: u32, client_end: bool, fast: bool, tx: (u64, u64)) -> pb::Connection {
        let path = |fast| pb::ConnectionPath { fast, tcp_reason: if fast { String::new() } else { "reader".into() } };
        pb::Connection {
            cookie,
            netns_cookie: 4026531840,
            connection_id: cookie / 2,
            local: if client_end { "10.0.0.1:40000".into() } else { "10.0.0.2:80".into() },
            remote: if client_end { "10.0.0.2:80".into() } else { "10.0.0.1:40000".into() },
            state: "ESTAB".into(),
            rule: Some(pb::RuleRef { rule_id: rule, rule: None }),
            client_end,
            accelerated: true,
            tx_path: Some(path(fast)),
            rx_path: Some(path(true)),
            owner_pid: if client_end { 0 } else { 4242 },
            reader_pid: 77,
            comm: if client_end { "curl".into() } else { "nginx".into() },
            tx: Some(pb::ConnectionTraffic { fast_messages: 3, fast_bytes: tx.0, tcp_bytes: tx.1, tcp_segments: 1 }),
            rx: Some(pb::ConnectionTraffic { fast_messages: 1, fast_bytes: 2048, tcp_bytes: 0, tcp_segments: 0 }),
            unread_bytes: 10,
        }
    }

    #[test]
    fn cookies_in_decimal_or_hex() {
        assert_eq!(parse_u64("8003"), Ok(8003));
        assert_eq!(parse_u64("0x1f43"), Ok(0x1f43));
        assert_eq!(parse_u64("0X1F43"), Ok(0x1f43));
        assert_eq!(parse_u64("sk:1f43"), Ok(0x1f43));
        assert!(parse_u64("1f43").is_err() && parse_u64("0x").is_err() && parse_u64("-1").is_err());
        let f = ConnsFilterArgs { cookie: Some(7), port: Some(80), path: Some(PathArg::Tcp), ..Default::default() };
        let r = f.request("12".into());
        assert_eq!((r.cookie, r.port, r.path, r.page_size), (Some(7), Some(80), pb::PathFilter::Tcp as i32, 1000));
        assert_eq!((r.rule_id, r.pid, r.page_token.as_str()), (None, None, "12"));
    }

    #[test]
    fn table_of_a_fast_and_a_tcp_connection() {
        let conns = [conn(8001, 3, true, true, (4096, 0)), conn(8002, 3, false, false, (100, 3 * 1024 * 1024))];
        let text = render_table(&conns);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        let cells: Vec<Vec<&str>> = lines.iter().map(|l| l.split_whitespace().collect()).collect();
        assert_eq!(
            cells[0],
            [
                "COOKIE", "NETNS", "LOCAL", "REMOTE", "STATE", "RULE", "END", "TX", "PATH", "RX", "PATH", "PID",
                "COMM", "TX", "RX", "UNREAD"
            ]
        );
        assert_eq!(
            cells[1],
            [
                "8001",
                "4026531840",
                "10.0.0.1:40000",
                "10.0.0.2:80",
                "ESTAB",
                "3",
                "client",
                "fast",
                "fast",
                "77",
                "curl",
                "4.0KiB",
                "2.0KiB",
                "10B"
            ]
        );
        assert_eq!(
            cells[2],
            [
                "8002",
                "4026531840",
                "10.0.0.2:80",
                "10.0.0.1:40000",
                "ESTAB",
                "3",
                "server",
                "tcp:reader",
                "fast",
                "4242",
                "nginx",
                "3.0MiB",
                "2.0KiB",
                "10B"
            ]
        );
        assert_eq!(lines[3], "(2 sockets, 1 on the fast path both ways)");
        // Columns line up.
        assert_eq!(lines[1].find("client"), lines[2].find("server"), "{text}");
        assert_eq!(lines[1].find("curl"), lines[2].find("nginx"), "{text}");
    }
}
