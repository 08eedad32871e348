//! The connection list: every socket meshwarp holds state for (covered by a
//! rule, accelerated or not), in every network namespace, as the `mw_conns`
//! iterator reads it from the kernel (or, where the kernel refuses
//! map-element iterators, `mw_conns_tcp` in each namespace a process or a
//! name holds, see [`ConnSource`]): tuple, rule,
//! process, traffic per path and, per direction, whether it takes the fast
//! path or TCP and why.

use std::fmt;
use std::fs;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use libbpf_rs::{MapHandle, ProgramHandle};
use meshwarp_bpf::names;
use meshwarp_bpf::shared::{
    ip_from_raw, str_of, Conn, Exe, ExeKey, Pod, DIR_STREAMED, DIR_TCP, DIR_UNLINKED, EF_CLOSED, EF_NOSEND, EF_PARKED,
    EF_PSOCK, EF_R_LOWAT, EF_R_PEEKOFF, EF_R_RULE, EF_R_SPLICE, EF_R_ULP, EF_TARGET, EF_ZEROCOPY, FB_COLLISION,
    FB_INSERT, FB_MODE_NEVER, FB_NO_SLOT, FB_NO_TARGET, FB_PEER, FB_READER, FB_SYN_DATA, FB_ZEROCOPY, LINK_HIT,
    LINK_POISONED,
};

use crate::error::{BpfError, IoError};
use crate::maps::{MapError, TypedMap};
use crate::pins::FamilyPins;

#[derive(Debug, thiserror::Error)]
pub enum ConnsError {
    #[error(transparent)]
    Bpf(#[from] BpfError),
    #[error(transparent)]
    Io(#[from] IoError),
    #[error(transparent)]
    Map(#[from] MapError),
    #[error(transparent)]
    Sys(#[from] crate::sys::SysError),
    #[error("the mw_conns iterator wrote {len} bytes, not a whole number of {size}-byte records")]
    Torn { len: usize, size: usize },
    #[error(
        "no connection-list program is pinned in {dir} (the programs of an older build run and could not be \
         upgraded): restart the node service to retry the upgrade"
    )]
    NoProgram { dir: PathBuf },
}

/// Why bytes of a direction take the TCP path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TcpReason {
    /// The rule's mode is `never`.
    ModeNever,
    /// A reader that may block (EAGAIN) or is not classified yet.
    Reader,
    /// Another connection built the same id.
    Collision,
    /// No free slot: the data path is full.
    NoSlot,
    /// The SOCKMAP refused the socket.
    Insert,
    /// The other end is not accelerated.
    Peer,
    /// A Fast Open server end: its handshake's last ACK has not come, or it
    /// cannot join by a relink (it would go to `mw_tgtmap`).
    SynData,
    /// Neither end may be given redirected bytes.
    NoTarget,
    /// The receiving end's reader can splice (or was seen splicing).
    Splice,
    /// The receiving end set SO_RCVLOWAT.
    RcvLowat,
    /// A ULP (kTLS) on the sending or receiving end.
    Ulp,
    /// The sending end's program sends urgent data (MSG_OOB), which only
    /// the TCP path carries.
    Urgent,
    /// The sending end has SO_ZEROCOPY on (or its program sets it):
    /// zero-copy completions are counted right only by plain TCP sends.
    Zerocopy,
    /// The receiving end set SO_PEEK_OFF (or its program does): the fast
    /// path's peeks ignore the offset.
    PeekOff,
    /// The rule says never redirect into the receiving end.
    Rule,
    /// The adaptive policy demoted the direction (a stream of writes TCP
    /// would coalesce, or one its reader fell behind on).
    Policy,
    /// The adaptive policy moved the direction to TCP for good: large
    /// writes into a reader copying out on another CPU, which TCP lets
    /// copy at once with the writer (unless its timed exchanges show the
    /// fast path faster: then it is tried again).
    Streamed,
    /// The receiving end is leaving or out of the SOCKMAP (the policy unlinked it).
    Parked,
    /// Being reset: a reader spliced, or urgent data was sent, with
    /// redirected bytes pending.
    Reset,
    /// The receiving end is closed.
    Closed,
}

impl TcpReason {
    /// Its stable name (API, CLI).
    pub fn name(self) -> &'static str {
        match self {
            TcpReason::ModeNever => "mode_never",
            TcpReason::Reader => "reader",
            TcpReason::Collision => "collision",
            TcpReason::NoSlot => "no_slot",
            TcpReason::Insert => "insert_failed",
            TcpReason::Peer => "peer_not_accelerated",
            TcpReason::SynData => "syn_data",
            TcpReason::NoTarget => "no_target",
            TcpReason::Splice => "splice",
            TcpReason::RcvLowat => "rcvlowat",
            TcpReason::Ulp => "ulp",
            TcpReason::Urgent => "urgent",
            TcpReason::Zerocopy => "zerocopy",
            TcpReason::PeekOff => "peek_off",
            TcpReason::Rule => "rule_no_target",
            TcpReason::Policy => "policy",
            TcpReason::Streamed => "streamed",
            TcpReason::Parked => "unlinked",
            TcpReason::Reset => "reset",
            TcpReason::Closed => "closed",
        }
    }

    fn from_fb(fb: u32) -> Option<Self> {
        Some(match fb {
            FB_MODE_NEVER => TcpReason::ModeNever,
            FB_READER => TcpReason::Reader,
            FB_COLLISION => TcpReason::Collision,
            FB_NO_SLOT => TcpReason::NoSlot,
            FB_INSERT => TcpReason::Insert,
            FB_PEER => TcpReason::Peer,
            FB_SYN_DATA => TcpReason::SynData,
            FB_NO_TARGET => TcpReason::NoTarget,
            FB_ZEROCOPY => TcpReason::Zerocopy,
            _ => return None,
        })
    }

    /// Why a receiving end is not a target, from its `end_flags`.
    fn of_target(flags: u32) -> Self {
        if flags & EF_PSOCK == 0 {
            TcpReason::Peer // it never joined the link
        } else if flags & EF_R_SPLICE != 0 {
            TcpReason::Splice
        } else if flags & EF_R_LOWAT != 0 {
            TcpReason::RcvLowat
        } else if flags & EF_R_ULP != 0 {
            TcpReason::Ulp
        } else if flags & EF_R_PEEKOFF != 0 {
            TcpReason::PeekOff
        } else if flags & EF_R_RULE != 0 {
            TcpReason::Rule
        } else if flags & EF_CLOSED != 0 {
            TcpReason::Closed
        } else {
            TcpReason::NoTarget
        }
    }
}

impl fmt::Display for TcpReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The path one direction's new messages take now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PathNow {
    Fast,
    Tcp(TcpReason),
}

impl PathNow {
    pub fn is_fast(self) -> bool {
        self == PathNow::Fast
    }
}

impl fmt::Display for PathNow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PathNow::Fast => f.write_str("fast"),
            PathNow::Tcp(r) => write!(f, "tcp({r})"),
        }
    }
}

/// Traffic of one direction, as seen by one socket.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Messages redirected (sent by this end; 0 for what it receives: see the peer).
    pub fast_msgs: u64,
    pub fast_bytes: u64,
    /// Bytes on TCP (sent: transmitted once, retransmissions not counted).
    pub tcp_bytes: u64,
    /// Data segments on TCP.
    pub tcp_segs: u64,
}

/// One socket meshwarp holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connection {
    /// The socket's cookie (what `ss -e` prints as `sk:`).
    pub cookie: u64,
    /// Network namespace cookie.
    pub netns: u64,
    /// The connection's id (client and server ISN + 1): both ends share it.
    pub conn_id: u64,
    pub local: SocketAddr,
    pub remote: SocketAddr,
    /// TCP state (`TCP_ESTABLISHED` = 1, ...).
    pub state: u32,
    pub rule_id: u32,
    /// The end that called connect() (or, for a capture, the origin).
    pub client_end: bool,
    pub accelerated: bool,
    /// What this end sends, and what it receives.
    pub tx_path: PathNow,
    pub rx_path: PathNow,
    /// Who connected or listened (the reader guard's stamp), and who reads it.
    pub owner_pid: Option<u32>,
    pub reader_pid: Option<u32>,
    /// The process name (of the owner, else the reader).
    pub comm: Option<String>,
    pub tx: Traffic,
    pub rx: Traffic,
    /// Redirected bytes waiting in its receive queue.
    pub unread: u32,
}

impl Connection {
    /// The TCP state's name, as `ss` prints it.
    pub fn state_name(&self) -> &'static str {
        match self.state {
            1 => "ESTAB",
            2 => "SYN-SENT",
            3 => "SYN-RECV",
            4 => "FIN-WAIT-1",
            5 => "FIN-WAIT-2",
            6 => "TIME-WAIT",
            7 => "CLOSE",
            8 => "CLOSE-WAIT",
            9 => "LAST-ACK",
            10 => "LISTEN",
            11 => "CLOSING",
            _ => "UNKNOWN",
        }
    }

    fn from_raw(c: &Conn, comm: Option<String>) -> Self {
        // A dual-stack socket's IPv4-mapped address is shown as IPv4, as ss does.
        let addr = |ip: &[u32; 4], port: u32| {
            let ip = ip_from_raw(*ip, c.family).unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
            SocketAddr::new(ip.to_canonical(), port as u16)
        };
        let (tx_path, rx_path) = paths(c);
        Self {
            cookie: c.cookie,
            netns: c.netns,
            conn_id: c.conn,
            local: addr(&c.local_ip, c.local_port),
            remote: addr(&c.remote_ip, c.remote_port),
            state: c.state,
            rule_id: c.rule_id,
            client_end: c.end == 0,
            accelerated: c.link_found != 0,
            tx_path,
            rx_path,
            owner_pid: (c.owner_tgid != 0).then_some(c.owner_tgid),
            reader_pid: (c.reader_tgid != 0).then_some(c.reader_tgid),
            comm,
            tx: Traffic {
                fast_msgs: c.tx_fast_msgs,
                fast_bytes: c.tx_fast_bytes,
                tcp_bytes: c.tx_tcp_bytes,
                tcp_segs: c.tx_segs.into(),
            },
            rx: Traffic {
                fast_msgs: 0,
                fast_bytes: c.rx_fast_bytes,
                tcp_bytes: c.rx_tcp_bytes,
                tcp_segs: c.rx_segs.into(),
            },
            unread: c.unread,
        }
    }
}

/// Where each direction's new messages go now, and why TCP.
fn paths(c: &Conn) -> (PathNow, PathNow) {
    if c.link_found == 0 {
        let r = PathNow::Tcp(TcpReason::from_fb(c.fb).unwrap_or(TcpReason::Peer));
        return (r, r);
    }
    if c.link_flags & LINK_POISONED != 0 {
        return (PathNow::Tcp(TcpReason::Collision), PathNow::Tcp(TcpReason::Collision));
    }
    if c.link_flags & LINK_HIT != 0 {
        return (PathNow::Tcp(TcpReason::Reset), PathNow::Tcp(TcpReason::Reset));
    }
    let dir = |recv_flags: u32, send_flags: u32, dir_flags: u32| {
        if send_flags & EF_NOSEND != 0 {
            // NOSEND comes with a ULP (EF_R_ULP), SO_ZEROCOPY (EF_ZEROCOPY) or
            // from urgent data.
            PathNow::Tcp(if send_flags & EF_R_ULP != 0 {
                TcpReason::Ulp
            } else if send_flags & EF_ZEROCOPY != 0 {
                TcpReason::Zerocopy
            } else {
                TcpReason::Urgent
            })
        } else if recv_flags & EF_TARGET == 0 {
            PathNow::Tcp(TcpReason::of_target(recv_flags))
        } else if dir_flags & DIR_STREAMED != 0 {
            PathNow::Tcp(TcpReason::Streamed)
        } else if dir_flags & DIR_UNLINKED != 0 || recv_flags & EF_PARKED != 0 {
            PathNow::Tcp(TcpReason::Parked)
        } else if dir_flags & DIR_TCP != 0 {
            PathNow::Tcp(TcpReason::Policy)
        } else {
            PathNow::Fast
        }
    };
    (dir(c.peer_flags, c.end_flags, c.tx_dir_flags), dir(c.end_flags, c.peer_flags, c.rx_dir_flags))
}

/// Which sockets to list; every field set must match.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConnFilter {
    pub rule_id: Option<u32>,
    pub netns: Option<u64>,
    /// Owner or reader process.
    pub pid: Option<u32>,
    pub cookie: Option<u64>,
    /// A local or remote port.
    pub port: Option<u16>,
    /// Only sockets one of whose directions takes TCP (`Some(false)`) or
    /// both the fast path (`Some(true)`).
    pub fast: Option<bool>,
}

impl ConnFilter {
    pub fn matches(&self, c: &Connection) -> bool {
        self.rule_id.is_none_or(|r| r == c.rule_id)
            && self.netns.is_none_or(|n| n == c.netns)
            && self.pid.is_none_or(|p| c.owner_pid == Some(p) || c.reader_pid == Some(p))
            && self.cookie.is_none_or(|k| k == c.cookie)
            && self.port.is_none_or(|p| c.local.port() == p || c.remote.port() == p)
            && self.fast.is_none_or(|f| f == (c.tx_path.is_fast() && c.rx_path.is_fast()))
    }
}

/// Where a data path's connection list is read from.
#[derive(Debug)]
enum Source {
    /// `mw_conns` over `mw_sk_state`: every namespace in one read.
    Storage(OwnedFd),
    /// `mw_conns_tcp` (iter/tcp), read in each network namespace, where the
    /// kernel refuses map-element iterators.
    EachNetns(OwnedFd),
    /// Neither is pinned: an older build's programs run (a failed upgrade).
    Missing(PathBuf),
}

/// Which iterator a [`ConnLister`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnSource {
    /// One iterator over the socket storage: every socket with state, in
    /// every network namespace.
    SocketStorage,
    /// An iter/tcp iterator in each network namespace that can be entered
    /// (see [`crate::sys::in_each_netns`]); sockets out of TCP's hash tables
    /// (closed but still open), and namespaces that only sockets keep
    /// alive, are not listed.
    EachNetns,
}

impl ConnSource {
    /// What a data path loaded on this kernel reads (probed once).
    pub fn on_this_kernel() -> Self {
        if crate::loader::map_elem_iter_loads() {
            Self::SocketStorage
        } else {
            Self::EachNetns
        }
    }
}

/// Reads the connection list of one socket data path.
#[derive(Debug)]
pub struct ConnLister {
    source: Source,
    exes: TypedMap<ExeKey, Exe>,
}

impl ConnLister {
    pub(crate) fn open(layout: &FamilyPins) -> Result<Self, ConnsError> {
        let pinned = |name: &str| {
            ProgramHandle::from_pinned_path(layout.prog(name))
                .map_err(|e| BpfError::new(format!("opening pinned {name}"), e))
        };
        let source = if layout.prog(names::PROG_CONNS).exists() {
            let state = MapHandle::from_pinned_path(layout.map(names::MAP_SK_STATE))
                .map_err(|e| BpfError::new("opening pinned mw_sk_state", e))?;
            Source::Storage(
                crate::sys::iter_link_map(&pinned(names::PROG_CONNS)?, state.as_fd())
                    .map_err(|e| IoError::new("creating the mw_conns iterator link", e))?,
            )
        } else if layout.prog(names::PROG_CONNS_TCP).exists() {
            Source::EachNetns(
                crate::sys::iter_link(&pinned(names::PROG_CONNS_TCP)?)
                    .map_err(|e| IoError::new("creating the mw_conns_tcp iterator link", e))?,
            )
        } else {
            Source::Missing(layout.dir().join("progs"))
        };
        Ok(Self { source, exes: TypedMap::pinned(&layout.maps_dir(), names::MAP_EXES)? })
    }

    /// Which iterator this lister reads (`None`: none is pinned).
    pub fn source(&self) -> Option<ConnSource> {
        match self.source {
            Source::Storage(_) => Some(ConnSource::SocketStorage),
            Source::EachNetns(_) => Some(ConnSource::EachNetns),
            Source::Missing(_) => None,
        }
    }

    /// The raw records, one per socket.
    fn records(&self) -> Result<Vec<Conn>, ConnsError> {
        let size = std::mem::size_of::<Conn>();
        let parse = |bytes: Vec<u8>| {
            if bytes.len() % size != 0 {
                return Err(ConnsError::Torn { len: bytes.len(), size });
            }
            Ok(bytes.chunks_exact(size).filter_map(Conn::from_bytes).collect::<Vec<_>>())
        };
        match &self.source {
            Source::Storage(link) => parse(
                crate::sys::read_iterator(link.as_fd())
                    .map_err(|e| IoError::new("reading the mw_conns iterator", e))?,
            ),
            Source::EachNetns(link) => {
                let reads = crate::sys::in_each_netns(|ns| {
                    crate::sys::read_iterator(link.as_fd())
                        .map_err(|e| IoError::new(format!("reading the mw_conns_tcp iterator in {}", ns.display()), e))
                })?;
                let mut all = Vec::new();
                for bytes in reads {
                    all.extend(parse(bytes?)?);
                }
                Ok(all)
            }
            Source::Missing(dir) => Err(ConnsError::NoProgram { dir: dir.clone() }),
        }
    }

    /// Every socket matching `filter`, ordered by cookie.
    pub fn list(&self, filter: &ConnFilter) -> Result<Vec<Connection>, ConnsError> {
        let mut out: Vec<Connection> = self
            .records()?
            .into_iter()
            .map(|c| {
                let comm = [c.owner_tgid, c.reader_tgid]
                    .into_iter()
                    .filter(|&p| p != 0)
                    .find_map(proc_comm)
                    .or_else(|| self.exe_comm(&c.exe));
                Connection::from_raw(&c, comm)
            })
            .filter(|c| filter.matches(c))
            .collect();
        out.sort_by_key(|c| c.cookie);
        // iter/tcp may show a socket twice when a read resumes inside a
        // hash bucket that changed meanwhile.
        out.dedup_by_key(|c| c.cookie);
        Ok(out)
    }

    fn exe_comm(&self, key: &ExeKey) -> Option<String> {
        if key.ino == 0 {
            return None;
        }
        Some(str_of(&self.exes.get(key).ok().flatten()?.comm))
    }
}

fn proc_comm(pid: u32) -> Option<String> {
    let s = fs::read_to_string(Path::new("/proc").join(pid.to_string()).join("comm")).ok()?;
    Some(s.trim_end().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_direction_is_fast_only_into_a_target_not_demoted() {
        let mut c = Conn { link_found: 1, end_flags: EF_PSOCK | EF_TARGET, peer_flags: EF_PSOCK, ..Conn::default() };
        assert_eq!(paths(&c), (PathNow::Tcp(TcpReason::NoTarget), PathNow::Fast));
        let joining = Conn { peer_flags: 0, ..c };
        assert_eq!(paths(&joining).0, PathNow::Tcp(TcpReason::Peer));
        c.peer_flags |= EF_R_SPLICE;
        assert_eq!(paths(&c).0, PathNow::Tcp(TcpReason::Splice));
        c.peer_flags = EF_PSOCK | EF_TARGET;
        c.tx_dir_flags = DIR_TCP;
        assert_eq!(paths(&c), (PathNow::Tcp(TcpReason::Policy), PathNow::Fast));
        c.tx_dir_flags = DIR_TCP | DIR_STREAMED | DIR_UNLINKED;
        assert_eq!(paths(&c).0, PathNow::Tcp(TcpReason::Streamed));
        let never = Conn { fb: FB_MODE_NEVER, ..Conn::default() };
        assert_eq!(paths(&never).0, PathNow::Tcp(TcpReason::ModeNever));
    }
}
