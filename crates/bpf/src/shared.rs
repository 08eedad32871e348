//! `#[repr(C)]` mirrors of `include/meshwarp/shared.h`: the keys and values of
//! the maps that user space and the BPF programs both read and write.
//!
//! Addresses are 16 bytes in network byte order (IPv4 in the first word), ports
//! in host order, exactly as the sockops program builds them.

use std::net::IpAddr;

/// `struct mw_build`: the build id of the loaded programs.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Build {
    pub id: [u8; BUILD_LEN],
}

/// `MW_BUILD_LEN`.
pub const BUILD_LEN: usize = 16;

/// `MW_SCHEMA_VERSION`: bumped whenever a pinned map's key or value changes.
pub const SCHEMA_VERSION: u32 = 28;

pub const AF_INET: u32 = 2;
pub const AF_INET6: u32 = 10;

/// `MW_END_*`: which end of a connection a socket is.
pub const END_CLIENT: u32 = 0;
pub const END_SERVER: u32 = 1;
/// `MW_RULE_NO_TARGET_*` (`mw_rule.flags`).
pub const RULE_NO_TARGET_CLIENT: u32 = 1;
pub const RULE_NO_TARGET_SERVER: u32 = 2;
/// `MW_RULE_MODE_*` (`mw_rule.flags`); neither bit: adaptive.
pub const RULE_MODE_ALWAYS: u32 = 4;
pub const RULE_MODE_NEVER: u32 = 8;
/// `MW_LINK_*` (`mw_link.kind`).
pub const LINK_MIRROR: u32 = 1;
pub const LINK_CAPTURE: u32 = 2;
/// `MW_LINK_*` (`mw_link.flags`).
pub const LINK_CLAIMED: u32 = 1;
pub const LINK_POISONED: u32 = 2;
pub const LINK_HIT: u32 = 4;
pub const LINK_OBSERVE: u32 = 8;
pub const LINK_FIXED: u32 = 16;
pub const LINK_SLOT: u32 = 32;
pub const LINK_LONG: u32 = 64;
/// `MW_DIR_*` (`mw_dir.flags`).
pub const DIR_TCP: u32 = 1;
pub const DIR_UNLINK_REQ: u32 = 2;
pub const DIR_UNLINKED: u32 = 4;
pub const DIR_RELINK_REQ: u32 = 8;
pub const DIR_UNLINKING: u32 = 16;
pub const DIR_RD_SHARED: u32 = 32;
pub const DIR_MOVE: u32 = 64;
pub const DIR_QUIET: u32 = 128;
pub const DIR_STREAMED: u32 = 256;
pub const DIR_TIMED: u32 = 512;
pub const DIR_KEEP: u32 = 1024;
pub const DIR_SWITCHED: u32 = 2048;
/// `MW_EF_*` (`mw_link.end_flags`).
pub const EF_PSOCK: u32 = 1;
pub const EF_TARGET: u32 = 2;
pub const EF_NOSEND: u32 = 4;
pub const EF_CLOSED: u32 = 8;
pub const EF_PARKED: u32 = 0x10;
pub const EF_GONE: u32 = 0x20;
/// Its reader asks FIONREAD, which this kernel miscounts with a psock: the
/// policy keeps bytes into it on the fast path.
pub const EF_FIONREAD: u32 = 0x40;
/// Its reader asked FIONREAD with TCP bytes that FIONREAD missed queued: a
/// wake-up was asked for (`PARK_WAKE`).
pub const EF_WAKE: u32 = 0x80;
pub const EF_R_SPLICE: u32 = 0x100;
pub const EF_R_LOWAT: u32 = 0x200;
pub const EF_R_ULP: u32 = 0x400;
pub const EF_R_RULE: u32 = 0x800;
/// In the target-only SOCKMAP (`mw_tgtmap`): its own sends never run sk_msg.
pub const EF_TGTMAP: u32 = 0x1000;
pub const EF_ZEROCOPY: u32 = 0x2000;
pub const EF_R_PEEKOFF: u32 = 0x4000;
/// `MW_EXE_*` (`mw_exe_class.flags`, `mw_exe.flags`).
pub const EXE_CLASSIFIED: u32 = 1;
pub const EXE_SPLICE: u32 = 2;
pub const EXE_OPAQUE: u32 = 4;
pub const EXE_TRUSTED: u32 = 8;
pub const EXE_PENDING: u32 = 0x10;
pub const EXE_SEEN_SPLICE: u32 = 0x100;
pub const EXE_SEEN_BLOCKING: u32 = 0x200;
pub const EXE_SEEN_NONBLOCKING: u32 = 0x400;
pub const EXE_SEEN_FIONREAD: u32 = 0x800;
pub const EXE_SEEN_URGENT: u32 = 0x1000;
pub const EXE_SEEN_ZEROCOPY: u32 = 0x2000;
pub const EXE_SEEN_PEEK_OFF: u32 = 0x4000;
/// `MW_CFG_*` (`mw_config.flags`).
pub const CFG_GUARD: u32 = 1;
pub const CFG_SPLICE_BLIND: u32 = 2;
pub const CFG_FIONREAD_PSOCK: u32 = 4;
pub const CFG_BLOCKING_EAGAIN: u32 = 8;
pub const CFG_SYSCALL_WATCH: u32 = 16;
pub const CFG_LATENCY: u32 = 32;
pub const CFG_LAT_ALL: u32 = 64;
pub const CFG_LAT_EVERY: u32 = 128;
/// `MW_CFG_LAT_CLEAN`: the monitor never ran on these maps, so a new rule
/// id has no histogram or switch to forget (set when the maps are created).
pub const CFG_LAT_CLEAN: u32 = 256;
/// Sampling: at most this many sends skipped between a socket's own samples.
pub const LAT_SKIP_MAX: u32 = 63;
/// `MW_FB_*` (`mw_sock_state.fb`): why a covered connection stays on TCP.
pub const FB_NONE: u32 = 0;
pub const FB_MODE_NEVER: u32 = 1;
pub const FB_READER: u32 = 2;
pub const FB_COLLISION: u32 = 3;
pub const FB_NO_SLOT: u32 = 4;
pub const FB_INSERT: u32 = 5;
pub const FB_PEER: u32 = 6;
pub const FB_SYN_DATA: u32 = 7;
pub const FB_NO_TARGET: u32 = 8;
pub const FB_ZEROCOPY: u32 = 9;
/// `MW_LAT_*`: the latency monitor's metrics (`mw_lat_key.metric`).
pub const LAT_FAST: u32 = 1;
pub const LAT_TCP: u32 = 2;
pub const LAT_SETUP: u32 = 3;
pub const LAT_RESPONSE: u32 = 4;
pub const LAT_THINK: u32 = 5;
pub const LAT_HOP: u32 = 6;
pub const LAT_TRANSIT: u32 = 7;
/// `MW_LAT_ROW_METRICS`: the metrics of a row of `mw_lat_rows` (all but hops).
pub const LAT_ROW_METRICS: u32 = 5;
/// `MW_LAT_RT_ROW_METRICS`: the tc family's rows hold one metric, transit.
pub const LAT_RT_ROW_METRICS: u32 = 1;
/// `MW_LAT_ROWS`: rule ids below this keep their histograms in `mw_lat_rows`.
pub const LAT_ROWS: u32 = 256;
/// `MW_LAT_BUCKETS`: bucket i counts [2^i, 2^(i+1)) ns.
pub const LAT_BUCKETS: usize = 32;
/// `MW_EV_*` (`mw_event.type`).
pub const EV_CLASSIFY: u32 = 1;
pub const EV_SPLICE_HIT: u32 = 2;
pub const EV_SPLICE_SEEN: u32 = 3;
pub const EV_UNLINK: u32 = 4;
pub const EV_RELINK: u32 = 5;
pub const EV_SLOT_STALE: u32 = 6;
pub const EV_WAKE: u32 = 7;
pub const EV_MOVE: u32 = 8;
pub const EV_URGENT_HIT: u32 = 9;
/// `MW_PARK_*` (`mw_park_req.op`).
pub const PARK_RELINK: u32 = 2;
pub const PARK_WAKE: u32 = 4;
/// `MW_PARK_*` (`mw_park_req.result`).
pub const PARK_PENDING: u32 = 0;
pub const PARK_DONE: u32 = 1;
pub const PARK_BUSY: u32 = 2;
pub const PARK_MOOT: u32 = 3;
pub const PARK_FAILED: u32 = 4;
/// `MW_RD_SHARED` (`mw_sock_state.rd_pid`).
pub const RD_SHARED: u32 = u32::MAX;

/// An address as the BPF programs store it: four words in network byte order.
pub type RawAddr = [u32; 4];

/// Converts an address into its map form and address family.
pub fn raw_addr(ip: IpAddr) -> (RawAddr, u32) {
    let mut out = [0u32; 4];
    match ip {
        IpAddr::V4(v4) => {
            out[0] = u32::from_ne_bytes(v4.octets());
            (out, AF_INET)
        }
        IpAddr::V6(v6) => {
            let o = v6.octets();
            for (i, w) in out.iter_mut().enumerate() {
                *w = u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]]);
            }
            (out, AF_INET6)
        }
    }
}

/// Inverse of [`raw_addr`]; `None` for an unknown family.
pub fn ip_from_raw(raw: RawAddr, family: u32) -> Option<IpAddr> {
    match family {
        AF_INET => Some(IpAddr::from(raw[0].to_ne_bytes())),
        AF_INET6 => {
            let mut o = [0u8; 16];
            for (i, w) in raw.iter().enumerate() {
                o[4 * i..4 * i + 4].copy_from_slice(&w.to_ne_bytes());
            }
            Some(IpAddr::from(o))
        }
        _ => None,
    }
}

/// Plain-old-data structs that are copied to and from map memory byte for
/// byte: `bytemuck::Pod` (derived, so `#[repr(C)]`, no padding and every
/// bit pattern valid are checked at compile time) with a default value.
pub trait Pod: bytemuck::Pod + Default {
    /// The struct's bytes.
    fn as_bytes(&self) -> &[u8] {
        bytemuck::bytes_of(self)
    }

    /// Reads a value from map bytes; `None` if the length differs.
    fn from_bytes(bytes: &[u8]) -> Option<Self> {
        bytemuck::try_pod_read_unaligned(bytes).ok()
    }
}

impl<T: bytemuck::Pod + Default> Pod for T {}

/// `struct mw_slot`: which link owns a pair of SOCKMAP entries
/// (`2 * slot + end`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Slot {
    /// The owning link's id; 0: free.
    pub owner: u64,
    /// The link is gone; user space frees the slot once both entries are empty.
    pub stale: u32,
    pub pad: u32,
}

/// The SOCKMAP index of one end of the link owning `slot`.
pub fn sockmap_index(slot: u32, end: u32) -> u32 {
    slot * 2 + (end & 1)
}

/// `struct mw_pair_key`: a mirror-pairing rule.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, bytemuck::Pod, bytemuck::Zeroable)]
pub struct PairKey {
    pub client_ip: RawAddr,
    pub server_ip: RawAddr,
    pub server_port: u32,
    pub family: u32,
}

/// `struct mw_capture_key`: a capture-pairing rule (client all-zero: any).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, bytemuck::Pod, bytemuck::Zeroable)]
pub struct CaptureKey {
    pub client_ip: RawAddr,
    pub dst_ip: RawAddr,
    pub dst_port: u32,
    pub family: u32,
}

/// `struct mw_rule`: value of both rule maps.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Rule {
    pub id: u32,
    pub listener_port: u32,
    pub listener_ip: RawAddr,
    pub flags: u32,
    pub pad: u32,
}

/// `struct mw_exe_key`: an executable by device (kernel encoding) and inode.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, bytemuck::Pod, bytemuck::Zeroable)]
pub struct ExeKey {
    pub dev: u64,
    pub ino: u64,
}

/// `struct mw_link`: a connection both of whose ends are accelerated.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Link {
    pub family: u32,
    pub kind: u32,
    pub client_ip: RawAddr,
    pub server_ip: RawAddr,
    pub client_port: u32,
    pub server_port: u32,
    pub rule_id: u32,
    pub flags: u32,
    pub end_flags: [u32; 2],
    pub cookie: [u64; 2],
    /// Each end's `struct sock` address: a hint for the policy only.
    pub sk: [u64; 2],
    pub exe: [ExeKey; 2],
    /// Each end's network namespace (cookie).
    pub netns: [u64; 2],
    pub dir: [Dir; 2],
    /// `mw_slots` index (with `LINK_SLOT`): the ends' SOCKMAP entries.
    pub slot: u32,
    pub pad: u32,
    /// The link id (0: the element is free).
    pub id: u64,
}

/// `struct mw_dir`: one direction of a link (the adaptive policy), by sending end.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Dir {
    pub flags: u32,
    pub run: u32,
    pub run_bytes: u32,
    pub tcp_read: u32,
    pub redir: u32,
    pub psock_read: u32,
    /// The CPU the peer's reader last read on, plus one (0: none yet).
    pub rd_cpu: u32,
    /// A `DIR_TIMED` direction's timing (`judge_streamed`): the peer's last
    /// look (ktime >> 10), its reader's reads then, each path's rate, looks.
    pub t0: u32,
    pub r0: u32,
    pub rate_fast: u32,
    pub rate_tcp: u32,
    pub timed: u32,
}

/// `struct mw_park_req`: one request to the mw_park iterator.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct ParkReq {
    pub op: u32,
    pub result: u32,
}

/// `struct mw_cookie_val`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct CookieVal {
    pub link: u64,
    pub end: u32,
    pub rule_id: u32,
    /// The link's `mw_links` index.
    pub slot: u32,
    pub pad: u32,
}

/// `struct mw_sock_state`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct SockState {
    pub link: u64,
    pub rule_id: u32,
    pub flags: u32,
    pub end: u32,
    /// `MW_LEARN | port` on an unstamped server end whose reader names its service.
    pub learn: u32,
    pub rd_pub: u32,
    pub rd_tgid: u32,
    pub rd_seen: u32,
    pub skipped: u32,
    pub read: u32,
    pub psock_rd: u32,
    pub rd_pid: u32,
    /// The link's `mw_links` index (with `link`).
    pub slot: u32,
    /// The connection's id (ISNs), accelerated or not.
    pub conn: u64,
    pub tx_msgs: u64,
    pub tx_bytes: u64,
    pub req_ts: u64,
    /// `FB_*`.
    pub fb: u32,
    /// Latency sampling: this end's last own sample (ns >> 10, wrapping).
    pub lat_last: u32,
    /// Sends left to skip before its next own sample.
    pub lat_skip: u16,
    /// The skip count its last own sample chose.
    pub lat_cap: u16,
    /// TCP-path sends: the write_seq the send last seen ends at.
    pub lat_end: u32,
    /// Who owns the socket (kept from connect(), or, for a covered server
    /// end, its listener's, from its service).
    pub own: SockOwner,
}

/// `struct mw_lat_key`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, bytemuck::Pod, bytemuck::Zeroable)]
pub struct LatKey {
    pub rule_id: u32,
    pub metric: u32,
    /// `LAT_HOP`: the rule whose socket the proxy read (`MW_NO_ID` otherwise).
    pub from_rule: u32,
    pub pad: u32,
}

/// `struct mw_lat_hist` (one per CPU).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct LatHist {
    pub count: u64,
    pub sum_ns: u64,
    pub bucket: [u64; LAT_BUCKETS],
}

/// `struct mw_conn`: one socket as the `mw_conns` iterator writes it.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Conn {
    pub cookie: u64,
    pub netns: u64,
    pub conn: u64,
    pub link: u64,
    pub family: u32,
    pub state: u32,
    pub local_ip: RawAddr,
    pub remote_ip: RawAddr,
    pub local_port: u32,
    pub remote_port: u32,
    pub rule_id: u32,
    pub end: u32,
    pub fb: u32,
    pub sock_flags: u32,
    pub owner_tgid: u32,
    pub reader_tgid: u32,
    pub exe: ExeKey,
    pub link_found: u32,
    pub link_flags: u32,
    pub end_flags: u32,
    pub peer_flags: u32,
    pub tx_dir_flags: u32,
    pub rx_dir_flags: u32,
    pub tx_fast_msgs: u64,
    pub tx_fast_bytes: u64,
    pub rx_fast_bytes: u64,
    pub tx_tcp_bytes: u64,
    pub rx_tcp_bytes: u64,
    pub tx_segs: u32,
    pub rx_segs: u32,
    pub unread: u32,
    pub pad: u32,
}

/// `struct mw_sock_owner`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct SockOwner {
    pub exe: ExeKey,
    pub tgid: u32,
    pub flags: u32,
}

/// `struct mw_exe`: what the programs saw an executable do.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Exe {
    pub flags: u32,
    pub tgid: u32,
    pub comm: [u8; 16],
}

/// `struct mw_exe_class`: how user space classified an executable.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct ExeClass {
    pub flags: u32,
    pub pad: u32,
}

/// `struct mw_service_key`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, bytemuck::Pod, bytemuck::Zeroable)]
pub struct ServiceKey {
    pub netns: u64,
    pub port: u32,
    pub family: u32,
}

/// `struct mw_service` (`mw_services`' value): the program listening on a
/// service, the process that listened (0 when learned from reads), and
/// `SVC_*` flags.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Service {
    pub exe: ExeKey,
    pub tgid: u32,
    pub flags: u32,
}

/// `MW_SVC_*` (`mw_service.flags`): learned from an end's reads; two
/// programs listened on the service (none is known for its ends).
pub const SVC_LEARNED: u32 = 1;
pub const SVC_MIXED: u32 = 2;

/// `struct mw_join`: a TCP Fast Open server end to join `mw_sockmap`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Join {
    pub netns: u64,
    /// The thread that asked (its namespace is tried first).
    pub tid: u32,
    pub pad: u32,
}

/// `struct mw_short` (`mw_short`, per rule id): how many of an adaptive
/// rule's connections in a row closed short, and how many were met while
/// that run was long enough to leave them on TCP (every
/// [`SHORT_PROBE`]-th is covered).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Short {
    pub score: u32,
    pub seen: u32,
    /// When the last short one closed (ns, `CLOCK_MONOTONIC`).
    pub last: u64,
    /// The rule's timed directions (`DIR_TIMED`): each path's rate, averaged
    /// over its connections, and its looks (the probes).
    pub rate_fast: u32,
    pub rate_tcp: u32,
    pub looks: u32,
    pub pad: u32,
}

/// `MW_SHORT_*`: a connection is long once an end redirected this many
/// messages or bytes; a rule's new connections stay on TCP after this many
/// short ones in a row, but for every `SHORT_PROBE`-th.
pub const SHORT_MSGS: u64 = 3;
pub const SHORT_BYTES: u64 = 256 * 1024;
pub const SHORT_AFTER: u32 = 16;
pub const SHORT_PROBE: u32 = 16;

/// `MW_PORT_WORDS`: `struct mw_ports` holds one bit per port.
pub const PORT_WORDS: usize = 1024;

/// `struct mw_ports`: the server ports some rule names, one bit each (host
/// order); bit 0 says user space keeps the set.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Ports {
    pub bits: [u64; PORT_WORDS],
}

impl Default for Ports {
    fn default() -> Self {
        bytemuck::Zeroable::zeroed()
    }
}

impl Ports {
    /// The set of `ports`, kept (bit 0 set).
    pub fn of(ports: impl IntoIterator<Item = u16>) -> Self {
        let mut p = Self::default();
        p.bits[0] = 1;
        for port in ports {
            p.bits[usize::from(port >> 6)] |= 1 << (port & 63);
        }
        p
    }

    /// Whether `port`'s bit is set.
    pub fn has(&self, port: u16) -> bool {
        self.bits[usize::from(port >> 6)] >> (port & 63) & 1 == 1
    }
}

/// `struct mw_reader_key`: how one executable reads one service.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, bytemuck::Pod, bytemuck::Zeroable)]
pub struct ReaderKey {
    pub exe: ExeKey,
    pub netns: u64,
    /// A server end's local port, a client end's remote port.
    pub port: u16,
    /// [`END_CLIENT`] or [`END_SERVER`].
    pub end: u16,
    pub pad: u32,
}

/// `struct mw_config`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Config {
    pub flags: u32,
    pub pad: u32,
    /// With `CFG_LAT_ALL`: when the monitor was switched on (CLOCK_MONOTONIC ns).
    pub lat_since: u64,
}

/// `struct mw_event`: what the programs tell user space.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Event {
    pub kind: u32,
    pub pid: u32,
    pub tgid: u32,
    pub rule_id: u32,
    pub comm: [u8; 16],
    pub exe: ExeKey,
    pub link: u64,
    pub cookie: u64,
    pub peer_cookie: u64,
    pub netns: u64,
    pub end: u32,
    pub pending: u32,
    pub family: u32,
    pub client_port: u32,
    pub server_port: u32,
    /// `EV_SLOT_STALE`: the `mw_slots` index.
    pub slot: u32,
    pub client_ip: RawAddr,
    pub server_ip: RawAddr,
}

/// `struct mw_rule_stats`: per-rule counters (one per CPU).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct RuleStats {
    pub sockets: u64,
    pub msgs: u64,
    pub bytes: u64,
    pub fb_no_peer: u64,
    pub fb_tcp_path: u64,
    pub fb_map_full: u64,
    pub fb_insert_err: u64,
    pub fb_collision: u64,
    pub fb_reader: u64,
    pub fb_splice: u64,
    pub fb_lowat: u64,
    pub fb_ulp: u64,
    pub ulp_refused: u64,
    pub splice_hits: u64,
    pub demotions: u64,
    pub promotions: u64,
    pub policy_tcp_msgs: u64,
    pub fb_mode_never: u64,
    pub unlinks: u64,
    pub relinks: u64,
    pub demotions_behind: u64,
    pub fb_reader_busy: u64,
    pub reader_wakeups: u64,
    pub tgtmap_clients: u64,
    pub hint_stale: u64,
    pub fb_urgent: u64,
    pub urgent_hits: u64,
    pub fb_zerocopy: u64,
    pub zc_refused: u64,
    pub fb_peek_off: u64,
    pub peek_off_refused: u64,
    pub fb_short: u64,
    pub demotions_around: u64,
}

/// `MW_OWNER_LEN`: bytes of an owner name, NUL padding included.
pub const OWNER_LEN: usize = 64;

/// `struct mw_owner`: the controller that owns a rule slot.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct OwnerName {
    pub name: [u8; OWNER_LEN],
}

impl Default for OwnerName {
    fn default() -> Self {
        Self { name: [0; OWNER_LEN] }
    }
}

impl OwnerName {
    /// `None` if `owner` does not fit with its NUL terminator or holds a NUL.
    pub fn new(owner: &str) -> Option<Self> {
        if owner.len() >= OWNER_LEN || owner.contains('\0') {
            return None;
        }
        let mut o = Self::default();
        o.name[..owner.len()].copy_from_slice(owner.as_bytes());
        Some(o)
    }

    /// The name up to the first NUL (lossy for invalid UTF-8).
    pub fn as_string(&self) -> String {
        let end = self.name.iter().position(|b| *b == 0).unwrap_or(OWNER_LEN);
        String::from_utf8_lossy(&self.name[..end]).into_owned()
    }
}

/// `struct mw_global_stats`: node-wide counters (one per CPU; the library
/// reports their sum as they are).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct GlobalStats {
    /// TCP connections that reached ESTABLISHED in the attached cgroup.
    pub established: u64,
    /// Of those, connections no rule covers (left entirely alone).
    pub not_covered: u64,
    /// Messages of a SOCKMAP socket without state (passed on the TCP path).
    pub no_state: u64,
    /// Server ends of a covered connection whose client end was not
    /// accelerated (not covered there, its reader not safe, another node).
    pub no_link: u64,
    /// Covered connections left on TCP: no free SOCKMAP slot near their hash
    /// (more sockets than `max_sockets`).
    pub no_slot: u64,
    /// Slots whose link closed with redirected bytes unread (its socket still
    /// in the SOCKMAP): freed by the guard thread once both entries are empty.
    pub slots_stale: u64,
}

/// `enum mw_route_action`.
pub const ACT_REDIRECT: u32 = 1;
pub const ACT_REDIRECT_PEER: u32 = 2;
pub const ACT_REDIRECT_NEIGH: u32 = 3;
/// `mw_route.flags`.
pub const ROUTE_REWRITE_MAC: u32 = 1;
pub const ROUTE_HAS_NEXTHOP: u32 = 2;
pub const ROUTE_HAS_SRC: u32 = 4;
/// `mw_attach_key.dir`.
pub const DIR_INGRESS: u32 = 1;
pub const DIR_EGRESS: u32 = 2;
/// Bits of an LPM route key before the destination (ifindex + dir).
pub const ROUTE_KEY_PREFIX_BITS: u32 = 64;

/// `struct mw_route_key4`: LPM key of an IPv4 route.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, bytemuck::Pod, bytemuck::Zeroable)]
pub struct RouteKey4 {
    pub prefixlen: u32,
    pub ifindex: u32,
    pub dir: u32,
    pub dst: [u8; 4],
}

/// `struct mw_route_key6`: LPM key of an IPv6 route.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, bytemuck::Pod, bytemuck::Zeroable)]
pub struct RouteKey6 {
    pub prefixlen: u32,
    pub ifindex: u32,
    pub dir: u32,
    pub dst: [u8; 16],
}

/// `struct mw_route`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct RouteValue {
    pub id: u32,
    pub action: u32,
    pub target_ifindex: u32,
    pub flags: u32,
    pub smac: [u8; 6],
    pub dmac: [u8; 6],
    pub src_prefixlen: u32,
    pub src: [u8; 16],
    pub nh_family: u32,
    pub nh_addr: [u8; 16],
}

/// `struct mw_route_stats` (one per CPU).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct RouteStats {
    pub packets: u64,
    pub bytes: u64,
    pub redirect_err: u64,
}

/// `struct mw_attach_key`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, bytemuck::Pod, bytemuck::Zeroable)]
pub struct AttachKey {
    pub ifindex: u32,
    pub dir: u32,
}

/// `struct mw_attach_stats` (one per CPU).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct AttachStats {
    pub packets: u64,
    pub misses: u64,
}

// SAFETY: all are repr(C), made of u32/u64 fields laid out without padding
// (checked by the layout tests below), valid for any bit pattern.
/// `MW_ABI_MAJOR` / `MW_ABI_MINOR`: the plugin ABI this host offers.
pub const ABI_MAJOR: u16 = 2;
pub const ABI_MINOR: u16 = 0;
/// `MW_HOOK_*`.
pub const HOOK_CONNECTION: u32 = 1;
pub const HOOK_MESSAGE: u32 = 2;
pub const HOOK_PACKET: u32 = 3;
pub const HOOKS: u32 = 3;
/// `MW_CHAIN_MAX`, `MW_MAX_PLUGINS`, `MW_PLUGIN_CFG_MAX`, `MW_CHAIN_FIN`.
pub const CHAIN_MAX: u32 = 8;
pub const MAX_PLUGINS: u32 = 64;
pub const PLUGIN_CFG_MAX: usize = 512;
pub const CHAIN_FIN: u32 = 2 * CHAIN_MAX;
/// `MW_PLUGIN_FAIL_CLOSED`.
pub const PLUGIN_FAIL_CLOSED: u32 = 1;
pub const PLUGIN_NAME_LEN: usize = 64;
pub const PLUGIN_VERSION_LEN: usize = 32;
/// Name of the ELF section holding a plugin's [`PluginAbi`].
pub const PLUGIN_ABI_SECTION: &str = ".mw_abi";

/// Index of a chain position in `mw_chain` (`mw_chain_index`).
pub fn chain_index(gen: u32, hook: u32, pos: u32) -> u32 {
    (gen * HOOKS + (hook - 1)) * CHAIN_MAX + pos
}

/// `struct mw_plugin_abi`: the `.mw_abi` section of a plugin object.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct PluginAbi {
    pub major: u16,
    pub minor: u16,
    pub hook: u32,
}

/// `struct mw_chain_pos`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct ChainPos {
    pub plugin_id: u32,
    pub cfg_slot: u32,
    pub flags: u32,
    pub pad: u32,
}

/// `struct mw_plugin_config`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct PluginConfig {
    pub len: u32,
    pub data: [u8; PLUGIN_CFG_MAX],
}

impl Default for PluginConfig {
    fn default() -> Self {
        Self { len: 0, data: [0; PLUGIN_CFG_MAX] }
    }
}

impl PluginConfig {
    /// `None` if `bytes` is longer than [`PLUGIN_CFG_MAX`].
    pub fn new(bytes: &[u8]) -> Option<Self> {
        let mut c = Self::default();
        c.data.get_mut(..bytes.len())?.copy_from_slice(bytes);
        c.len = bytes.len() as u32;
        Some(c)
    }

    pub fn bytes(&self) -> &[u8] {
        &self.data[..(self.len as usize).min(PLUGIN_CFG_MAX)]
    }
}

/// `struct mw_plugin_stats` (one per CPU).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct PluginStats {
    pub runs: u64,
    pub cont: u64,
    pub verdict1: u64,
    pub drop: u64,
    pub invalid: u64,
    pub missing: u64,
}

/// `struct mw_plugin_meta`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct PluginMeta {
    pub name: [u8; PLUGIN_NAME_LEN],
    pub version: [u8; PLUGIN_VERSION_LEN],
    pub hook: u32,
    pub phase: u32,
    pub priority: i32,
    pub flags: u32,
    pub cfg_slot: u32,
    pub abi: u32,
    pub sha256: [u8; 32],
    /// The controller that loaded it.
    pub owner: OwnerName,
}

impl Default for PluginMeta {
    fn default() -> Self {
        Self {
            name: [0; PLUGIN_NAME_LEN],
            version: [0; PLUGIN_VERSION_LEN],
            hook: 0,
            phase: 0,
            priority: 0,
            flags: 0,
            cfg_slot: 0,
            abi: 0,
            sha256: [0; 32],
            owner: OwnerName::default(),
        }
    }
}

/// Copies `s` into a NUL-padded field; `None` if it does not fit with a NUL.
pub fn fixed_str<const N: usize>(s: &str) -> Option<[u8; N]> {
    let mut out = [0u8; N];
    if s.len() >= N || s.contains('\0') {
        return None;
    }
    out[..s.len()].copy_from_slice(s.as_bytes());
    Some(out)
}

/// The string in a NUL-padded field.
pub fn str_of(field: &[u8]) -> String {
    let end = field.iter().position(|&b| b == 0).unwrap_or(field.len());
    String::from_utf8_lossy(&field[..end]).into_owned()
}

/// The head of `struct __sk_buff` (uapi/linux/bpf.h) up to `cb[]`: the
/// context user space gives `mw_unlink` under BPF_PROG_TEST_RUN, with the
/// socket cookie in `cb[0]` (low half) and `cb[1]` (high half). The kernel
/// accepts a shorter context and zeroes the rest; every field before `cb`
/// must stay zero.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct UnlinkCtx {
    pub head: [u32; 12],
    pub cb: [u32; 5],
}

impl UnlinkCtx {
    pub fn for_cookie(cookie: u64) -> Self {
        let mut c = Self::default();
        c.cb[0] = cookie as u32;
        c.cb[1] = (cookie >> 32) as u32;
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sockredir::types;
    use std::mem::{align_of, offset_of, size_of};

    #[test]
    fn schema_version_matches_the_header() {
        let header = include_str!("../include/meshwarp/shared.h");
        let line = header.lines().find(|l| l.starts_with("#define MW_SCHEMA_VERSION ")).expect("MW_SCHEMA_VERSION");
        assert_eq!(line.rsplit(' ').next(), Some(SCHEMA_VERSION.to_string().as_str()));
    }

    /// The value of `#define name` in shared.h.
    fn define(name: &str) -> u32 {
        let header = include_str!("../include/meshwarp/shared.h");
        let line = header.lines().find(|l| l.starts_with(&format!("#define {name} "))).expect(name);
        let v = line.split_whitespace().nth(2).map(|v| v.trim_end_matches('u')).expect(name);
        match v.strip_prefix("0x") {
            Some(hex) => u32::from_str_radix(hex, 16),
            None => v.parse::<u32>(),
        }
        .expect(name)
    }

    #[test]
    fn latency_rows_match_the_header() {
        assert_eq!(define("MW_LAT_ROWS"), LAT_ROWS);
        assert_eq!(define("MW_CFG_LAT_ALL"), CFG_LAT_ALL);
        assert_eq!(define("MW_CFG_LAT_EVERY"), CFG_LAT_EVERY);
        assert_eq!(define("MW_CFG_LAT_CLEAN"), CFG_LAT_CLEAN);
        assert_eq!(define("MW_LAT_SKIP_MAX"), LAT_SKIP_MAX);
        assert_eq!(define("MW_LAT_ROW_METRICS"), LAT_ROW_METRICS);
        assert_eq!(define("MW_LAT_RT_ROW_METRICS"), LAT_RT_ROW_METRICS);
        assert_eq!(define("MW_LAT_TRANSIT"), LAT_TRANSIT);
        assert_eq!(define("MW_LAT_HOP"), LAT_ROW_METRICS + 1, "a row holds every metric before the hop");
    }

    #[test]
    fn port_set_matches_the_header() {
        assert_eq!(define("MW_PORT_WORDS") as usize, PORT_WORDS);
        assert_eq!(define("MW_SHORT_MSGS") as u64, SHORT_MSGS);
        assert_eq!(define("MW_SHORT_AFTER"), SHORT_AFTER);
        assert_eq!(define("MW_SHORT_PROBE"), SHORT_PROBE);
        assert_eq!(define("MW_SVC_LEARNED"), SVC_LEARNED);
        assert_eq!(define("MW_SVC_MIXED"), SVC_MIXED);
        let p = Ports::of([80, 15006, 65535]);
        assert!(p.has(80) && p.has(15006) && p.has(65535) && p.has(0), "bit 0: the set is kept");
        assert!(!p.has(81) && !p.has(8080));
        assert_eq!(p.bits.iter().map(|w| w.count_ones()).sum::<u32>(), 4);
    }

    #[test]
    fn flags_match_the_header() {
        for (name, ours) in [
            ("MW_DIR_TCP", DIR_TCP),
            ("MW_DIR_UNLINK_REQ", DIR_UNLINK_REQ),
            ("MW_DIR_UNLINKED", DIR_UNLINKED),
            ("MW_DIR_RELINK_REQ", DIR_RELINK_REQ),
            ("MW_DIR_UNLINKING", DIR_UNLINKING),
            ("MW_DIR_RD_SHARED", DIR_RD_SHARED),
            ("MW_DIR_MOVE", DIR_MOVE),
            ("MW_DIR_QUIET", DIR_QUIET),
            ("MW_DIR_STREAMED", DIR_STREAMED),
            ("MW_DIR_TIMED", DIR_TIMED),
            ("MW_DIR_KEEP", DIR_KEEP),
            ("MW_DIR_SWITCHED", DIR_SWITCHED),
            ("MW_EV_UNLINK", EV_UNLINK),
            ("MW_EV_RELINK", EV_RELINK),
            ("MW_EV_WAKE", EV_WAKE),
            ("MW_EV_MOVE", EV_MOVE),
            ("MW_EV_URGENT_HIT", EV_URGENT_HIT),
            ("MW_EXE_SEEN_URGENT", EXE_SEEN_URGENT),
            ("MW_EXE_SEEN_ZEROCOPY", EXE_SEEN_ZEROCOPY),
            ("MW_EXE_SEEN_PEEK_OFF", EXE_SEEN_PEEK_OFF),
            ("MW_EF_TGTMAP", EF_TGTMAP),
            ("MW_EF_ZEROCOPY", EF_ZEROCOPY),
            ("MW_EF_R_PEEKOFF", EF_R_PEEKOFF),
            ("MW_FB_ZEROCOPY", FB_ZEROCOPY),
            ("MW_CFG_GUARD", CFG_GUARD),
            ("MW_CFG_SYSCALL_WATCH", CFG_SYSCALL_WATCH),
        ] {
            assert_eq!(define(name), ours, "{name}");
        }
    }

    /// Checks size, alignment and every field offset against the skeleton's
    /// types, which libbpf-cargo generates from the BPF object's BTF.
    macro_rules! same_layout {
        ($ours:ty, $theirs:ty, [$($f:ident),*]) => {{
            assert_eq!(size_of::<$ours>(), size_of::<$theirs>(), "size of {}", stringify!($ours));
            assert_eq!(align_of::<$ours>(), align_of::<$theirs>(), "align of {}", stringify!($ours));
            $( assert_eq!(offset_of!($ours, $f), offset_of!($theirs, $f),
                "offset of {}.{}", stringify!($ours), stringify!($f)); )*
        }};
    }

    #[test]
    fn mirrors_match_btf_layout() {
        same_layout!(Slot, types::mw_slot, [owner, stale, pad]);
        same_layout!(PairKey, types::mw_pair_key, [client_ip, server_ip, server_port, family]);
        same_layout!(CaptureKey, types::mw_capture_key, [client_ip, dst_ip, dst_port, family]);
        same_layout!(Rule, types::mw_rule, [id, listener_port, listener_ip, flags, pad]);
        same_layout!(ExeKey, types::mw_exe_key, [dev, ino]);
        same_layout!(
            Link,
            types::mw_link,
            [
                family,
                kind,
                client_ip,
                server_ip,
                client_port,
                server_port,
                rule_id,
                flags,
                end_flags,
                cookie,
                sk,
                exe,
                netns,
                dir,
                slot,
                pad,
                id
            ]
        );
        same_layout!(CookieVal, types::mw_cookie_val, [link, end, rule_id, slot, pad]);
        same_layout!(
            Dir,
            types::mw_dir,
            [flags, run, run_bytes, tcp_read, redir, psock_read, rd_cpu, t0, r0, rate_fast, rate_tcp, timed]
        );
        same_layout!(ParkReq, types::mw_park_req, [op, result]);
        assert_eq!(offset_of!(UnlinkCtx, cb), offset_of!(types::__sk_buff, cb));
        assert_eq!(size_of::<[u32; 5]>(), size_of_val(&types::__sk_buff::default().cb));
        same_layout!(
            SockState,
            types::mw_sock_state,
            [
                link, rule_id, flags, end, learn, rd_pub, rd_tgid, rd_seen, skipped, read, psock_rd, rd_pid, slot,
                conn, tx_msgs, tx_bytes, req_ts, fb, lat_last, lat_skip, lat_cap, lat_end, own
            ]
        );
        same_layout!(LatKey, types::mw_lat_key, [rule_id, metric, from_rule, pad]);
        same_layout!(LatHist, types::mw_lat_hist, [count, sum_ns, bucket]);
        same_layout!(
            Conn,
            types::mw_conn,
            [
                cookie,
                netns,
                conn,
                link,
                family,
                state,
                local_ip,
                remote_ip,
                local_port,
                remote_port,
                rule_id,
                end,
                fb,
                sock_flags,
                owner_tgid,
                reader_tgid,
                exe,
                link_found,
                link_flags,
                end_flags,
                peer_flags,
                tx_dir_flags,
                rx_dir_flags,
                tx_fast_msgs,
                tx_fast_bytes,
                rx_fast_bytes,
                tx_tcp_bytes,
                rx_tcp_bytes,
                tx_segs,
                rx_segs,
                unread,
                pad
            ]
        );
        same_layout!(SockOwner, types::mw_sock_owner, [exe, tgid, flags]);
        same_layout!(Exe, types::mw_exe, [flags, tgid, comm]);
        same_layout!(ExeClass, types::mw_exe_class, [flags, pad]);
        same_layout!(ServiceKey, types::mw_service_key, [netns, port, family]);
        same_layout!(Service, types::mw_service, [exe, tgid, flags]);
        same_layout!(ReaderKey, types::mw_reader_key, [exe, netns, port, end, pad]);
        same_layout!(Join, types::mw_join, [netns, tid, pad]);
        same_layout!(Ports, types::mw_ports, [bits]);
        same_layout!(Short, types::mw_short, [score, seen, last, rate_fast, rate_tcp, looks, pad]);
        same_layout!(Config, types::mw_config, [flags, pad, lat_since]);
        same_layout!(
            RuleStats,
            types::mw_rule_stats,
            [
                sockets,
                msgs,
                bytes,
                fb_no_peer,
                fb_tcp_path,
                fb_map_full,
                fb_insert_err,
                fb_collision,
                fb_reader,
                fb_splice,
                fb_lowat,
                fb_ulp,
                ulp_refused,
                splice_hits,
                demotions,
                promotions,
                policy_tcp_msgs,
                fb_mode_never,
                unlinks,
                relinks,
                demotions_behind,
                fb_reader_busy,
                reader_wakeups,
                tgtmap_clients,
                hint_stale,
                fb_urgent,
                urgent_hits,
                fb_zerocopy,
                zc_refused,
                fb_peek_off,
                peek_off_refused,
                fb_short,
                demotions_around
            ]
        );
        same_layout!(
            GlobalStats,
            types::mw_global_stats,
            [established, not_covered, no_state, no_link, no_slot, slots_stale]
        );
        assert_eq!(size_of::<Event>(), size_of::<types::mw_event>());
        assert_eq!(offset_of!(Event, kind), offset_of!(types::mw_event, r#type));
        assert_eq!(offset_of!(Event, server_ip), offset_of!(types::mw_event, server_ip));
        assert_eq!(offset_of!(Event, pending), offset_of!(types::mw_event, pending));
        assert_eq!(offset_of!(Event, slot), offset_of!(types::mw_event, slot));
        same_layout!(ChainPos, types::mw_chain_pos, [plugin_id, cfg_slot, flags, pad]);
        same_layout!(PluginConfig, types::mw_plugin_config, [len, data]);
        same_layout!(PluginStats, types::mw_plugin_stats, [runs, cont, verdict1, drop, invalid, missing]);
        same_layout!(
            PluginMeta,
            types::mw_plugin_meta,
            [name, version, hook, phase, priority, flags, cfg_slot, abi, sha256, owner]
        );
        same_layout!(Build, types::mw_build, [id]);
    }

    #[test]
    fn no_padding() {
        assert_eq!(size_of::<Slot>(), 16);
        assert_eq!(size_of::<PairKey>(), 16 + 16 + 4 + 4);
        assert_eq!(size_of::<CaptureKey>(), 16 + 16 + 4 + 4);
        assert_eq!(size_of::<Rule>(), 4 + 4 + 16 + 8);
        assert_eq!(size_of::<Link>(), 8 + 32 + 16 + 8 + 16 + 16 + 32 + 16 + 96 + 8 + 8);
        assert_eq!(size_of::<Dir>(), 48);
        assert_eq!(size_of::<ParkReq>(), 8);
        assert_eq!(size_of::<SockState>(), 8 + 16 + 32 + 32 + 16 + 24);
        assert_eq!(size_of::<LatKey>(), 16);
        assert_eq!(size_of::<LatHist>(), 16 + 8 * LAT_BUCKETS);
        assert_eq!(size_of::<Conn>(), 32 + 8 + 32 + 8 + 24 + 16 + 24 + 40 + 16);
        assert_eq!(size_of::<SockOwner>(), 16 + 8);
        assert_eq!(size_of::<Exe>(), 8 + 16);
        assert_eq!(size_of::<Event>(), 16 + 16 + 16 + 32 + 24 + 32);
        assert_eq!(size_of::<RuleStats>(), 33 * 8);
        assert_eq!(size_of::<GlobalStats>(), 6 * 8);
        assert_eq!(size_of::<Short>(), 16 + 16);
        assert_eq!(size_of::<Service>(), 16 + 8);
        assert_eq!(size_of::<RouteKey4>(), 16);
        assert_eq!(size_of::<RouteKey6>(), 28);
        assert_eq!(size_of::<RouteValue>(), 4 * 4 + 12 + 4 + 16 + 4 + 16);
        assert_eq!(size_of::<PluginAbi>(), 8);
        assert_eq!(size_of::<ChainPos>(), 16);
        assert_eq!(size_of::<PluginConfig>(), 4 + PLUGIN_CFG_MAX);
        assert_eq!(size_of::<PluginStats>(), 6 * 8);
        assert_eq!(size_of::<PluginMeta>(), 64 + 32 + 6 * 4 + 32 + OWNER_LEN);
    }

    #[test]
    fn raw_addr_is_network_order() {
        let (v4, fam) = raw_addr("127.0.0.1".parse().unwrap());
        assert_eq!(fam, AF_INET);
        assert_eq!(v4[0].to_ne_bytes(), [127, 0, 0, 1]);
        assert_eq!(&v4[1..], &[0, 0, 0]);
        let (v6, fam) = raw_addr("::1".parse().unwrap());
        assert_eq!(fam, AF_INET6);
        assert_eq!(v6[3].to_ne_bytes(), [0, 0, 0, 1]);
        for ip in ["198.18.0.1", "2001:db8::7", "::ffff:1.2.3.4"] {
            let ip: IpAddr = ip.parse().unwrap();
            let (raw, fam) = raw_addr(ip);
            assert_eq!(ip_from_raw(raw, fam), Some(ip));
        }
    }

    #[test]
    fn owner_names() {
        assert_eq!(OwnerName::new("istio-agent").unwrap().as_string(), "istio-agent");
        assert_eq!(OwnerName::new("").unwrap().as_string(), "");
        assert!(OwnerName::new(&"x".repeat(OWNER_LEN)).is_none());
        assert!(OwnerName::new("a\0b").is_none());
    }

    #[test]
    fn pod_round_trip() {
        let k = Slot { owner: 0x1234_5678_9abc_def0, stale: 1, pad: 0 };
        assert_eq!(Slot::from_bytes(k.as_bytes()), Some(k));
        assert_eq!(Slot::from_bytes(&[0u8; 3]), None);
        assert_eq!(sockmap_index(7, END_SERVER), 15);
    }
}
