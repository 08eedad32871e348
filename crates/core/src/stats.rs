//! Counters as the library reports them, summed over CPUs.

use meshwarp_bpf::shared::{GlobalStats, RuleStats};

/// Counters of one pair or capture rule.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RuleCounters {
    /// Sockets inserted into the SOCKHASH under this rule.
    pub sockets: u64,
    /// Messages moved straight into the peer's receive queue.
    pub redirected_msgs: u64,
    /// Bytes moved straight into the peer's receive queue.
    pub redirected_bytes: u64,
    /// Fallbacks: messages sent on the TCP path because the peer was absent.
    pub fallback_no_peer: u64,
    /// Fallbacks: messages sent on the TCP path because that direction had
    /// already carried TCP payload (redirecting would reorder bytes).
    pub fallback_tcp_path: u64,
    /// Fallbacks: covered sockets left on the TCP path because the SOCKHASH was full.
    pub fallback_map_full: u64,
    /// Fallbacks: covered sockets the kernel refused to insert (e.g. a ULP such as kTLS).
    pub fallback_insert_error: u64,
}

impl From<RuleStats> for RuleCounters {
    fn from(s: RuleStats) -> Self {
        Self {
            sockets: s.sockets,
            redirected_msgs: s.msgs,
            redirected_bytes: s.bytes,
            fallback_no_peer: s.fb_no_peer,
            fallback_tcp_path: s.fb_tcp_path,
            fallback_map_full: s.fb_map_full,
            fallback_insert_error: s.fb_insert_err,
        }
    }
}

/// Node-wide counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GlobalCounters {
    /// TCP connections that reached ESTABLISHED in the attached cgroup.
    pub established: u64,
    /// Of those, connections no rule covers (left entirely alone).
    pub not_covered: u64,
    /// Messages of a SOCKHASH socket without state (passed on the TCP path).
    pub no_state: u64,
}

impl From<GlobalStats> for GlobalCounters {
    fn from(s: GlobalStats) -> Self {
        Self { established: s.established, not_covered: s.not_covered, no_state: s.no_state }
    }
}
