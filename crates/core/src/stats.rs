//! Counters as the library reports them, summed over CPUs.

use meshwarp_bpf::shared::RuleStats;

/// Counters of one pair or capture rule.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RuleCounters {
    /// Sockets inserted into the SOCKMAP under this rule.
    pub sockets: u64,
    /// Messages moved straight into the peer's receive queue.
    pub redirected_msgs: u64,
    /// Bytes moved straight into the peer's receive queue.
    pub redirected_bytes: u64,
    /// Fallbacks: messages sent on the TCP path because the peer was absent.
    pub fallback_no_peer: u64,
    /// Fallbacks: messages sent on the TCP path because TCP bytes of that
    /// direction were not read by the peer yet (redirecting would reorder).
    pub fallback_tcp_path: u64,
    /// Fallbacks: covered sockets left on the TCP path because the SOCKMAP was full.
    pub fallback_map_full: u64,
    /// Fallbacks: covered sockets the kernel refused to insert.
    pub fallback_insert_error: u64,
    /// Fallbacks: connections not accelerated because another connection
    /// built the same key (never a wrong peer).
    pub fallback_collision: u64,
    /// Fallbacks (reader guard): ends not accelerated because their reader
    /// may block (EAGAIN) or is not classified yet.
    pub fallback_reader: u64,
    /// Reader guard: ends not made redirect targets because their program can splice.
    pub fallback_splice: u64,
    /// Ends withdrawn as redirect targets by SO_RCVLOWAT.
    pub fallback_rcvlowat: u64,
    /// Ends taken off the fast path by a ULP (kTLS).
    pub fallback_ulp: u64,
    /// ULPs refused because redirected bytes were waiting to be read.
    pub ulp_refused: u64,
    /// Readers that spliced with redirected bytes pending: connection reset.
    pub splice_hits: u64,
    /// Adaptive policy: directions moved to the TCP path because they stream
    /// writes that TCP coalesces (Nagle or cork on): small ones, or up to
    /// 32 KiB into a reader that keeps up; at message 64, or at 2 048 for a
    /// Nagle run whose tail TCP would hold for the peer's delayed ACK (the
    /// peer redirects to it, or its TCP is in pingpong mode).
    pub demotions_coalesce: u64,
    /// Adaptive policy: directions moved back to the fast path (a new
    /// exchange began and the peer had read every byte sent on TCP).
    pub promotions: u64,
    /// Adaptive policy: messages demoted directions sent on the TCP path.
    pub policy_tcp_msgs: u64,
    /// Connections left on the TCP path because the rule's mode is `never`.
    pub fallback_mode_never: u64,
    /// Adaptive policy: demoted ends taken out of the SOCKMAP after they kept
    /// streaming (their TCP path is plain TCP again, without tcp_bpf).
    pub unlinks: u64,
    /// Adaptive policy: unlinked ends put back because their peer sent.
    pub relinks: u64,
    /// Adaptive policy: directions moved to the TCP path because their
    /// reader fell behind: small writes TCP does not coalesce (nodelay), 256
    /// messages behind (TCP then sends the backlog as a few large segments),
    /// or larger writes, as far ahead as TCP's buffers could hold (the
    /// sizes the programs fixed with SO_RCVBUF/SO_SNDBUF, else `tcp_rmem[2]`
    /// + `tcp_wmem[2]`; TCP then stops the writer).
    pub demotions_behind: u64,
    /// Adaptive policy: messages of a stream sent on the TCP path around
    /// the peer's reader: writes averaging 4 KiB or more into a reader that
    /// held its socket or ran on another CPU with redirected bytes unread,
    /// or a stream TCP would coalesce into a reader holding its socket; or
    /// a nodelay answer (a run's first message) or pipelined request of
    /// 4 KiB or more (sent before the peer's answer was read) into a peer
    /// holding its socket. A redirect would have waited for that lock.
    pub fallback_reader_busy: u64,
    /// Readers woken because they asked FIONREAD with bytes queued that
    /// this kernel's FIONREAD does not count (TCP bytes behind a psock): an
    /// edge-triggered reader told 0 would wait for an event they never bring.
    pub reader_wakeups: u64,
    /// Client ends that joined the target-only SOCKMAP at connect: their
    /// server end is never a target (the rule says so, or its listener's
    /// last accepted end was none), so no sk_msg runs on their sends.
    pub tgtmap_clients: u64,
    /// Server ends withdrawn as targets because their client went by a
    /// stale hint of the listener (it would have been a target): that one
    /// connection sends client to server on TCP.
    pub hint_stale: u64,
    /// Ends whose sends left the fast path for good because their program
    /// sends urgent data (MSG_OOB), which exists only on the TCP path: at
    /// its first urgent send, or from the start once the program was seen.
    pub fallback_urgent: u64,
    /// Urgent data sent while its reader had redirected bytes unread: a
    /// recv(MSG_OOB) would read those in-band bytes instead, so the
    /// connection was reset (an incident).
    pub urgent_hits: u64,
    /// Ends whose sends stay on TCP for good because SO_ZEROCOPY is on
    /// (zero-copy completions are counted right only by plain TCP sends):
    /// set on the socket, or from the start once its program was seen (also
    /// counted for an end that then is not accelerated for another reason).
    pub fallback_zerocopy: u64,
    /// SO_ZEROCOPY refused (EOPNOTSUPP) on a socket whose sends run sk_msg;
    /// its program's later sockets take it, their sends on TCP.
    pub zerocopy_refused: u64,
    /// Ends withdrawn as targets because SO_PEEK_OFF is on (a psock's
    /// peeks ignore the offset): set on the socket or its listener, or from
    /// the start once its program was seen setting it.
    pub fallback_peek_off: u64,
    /// SO_PEEK_OFF refused (EOPNOTSUPP) on a socket with redirected bytes
    /// unread (they would be peeked at the wrong place).
    pub peek_off_refused: u64,
    /// Adaptive policy: connections left on the TCP path, uncovered, because
    /// the rule's last connections were all short (16 in a row closed
    /// before an end redirected 3 messages or 256 KiB: their handshake and
    /// close cost more than they won). Every 16th is still covered, and one
    /// that grows long ends the run.
    pub fallback_short: u64,
    /// Adaptive policy: directions moved to the TCP path because a run
    /// without a reply went on past 64 messages (MW_POLICY_COALESCE) and one
    /// of them would have gone around its busy reader
    /// (`fallback_reader_busy`): a stream whose reader copies at its own
    /// pace. TCP through a psock sends smaller segments than plain TCP, so
    /// the rest of the run leaves the SOCKMAP (`unlinks`; not a Nagle end
    /// whose peer redirects to it, whose next request would then go on TCP,
    /// nor a Nagle run before 2 048 messages while TCP would hold its tail
    /// for the peer's delayed ACK, which does not go around). Or, past 8
    /// messages, a run of large writes (not of 256 KiB messages) into a
    /// reader on another CPU, or earlier in a run a message of 16 KiB up to
    /// 256 KiB (not from a Nagle writer, nor of a larger write) into such a
    /// reader with this direction's bytes still to read: that direction
    /// stays on TCP for good (connection reason `streamed`).
    pub demotions_around: u64,
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
            fallback_collision: s.fb_collision,
            fallback_reader: s.fb_reader,
            fallback_splice: s.fb_splice,
            fallback_rcvlowat: s.fb_lowat,
            fallback_ulp: s.fb_ulp,
            ulp_refused: s.ulp_refused,
            splice_hits: s.splice_hits,
            demotions_coalesce: s.demotions,
            promotions: s.promotions,
            policy_tcp_msgs: s.policy_tcp_msgs,
            fallback_mode_never: s.fb_mode_never,
            unlinks: s.unlinks,
            relinks: s.relinks,
            demotions_behind: s.demotions_behind,
            fallback_reader_busy: s.fb_reader_busy,
            reader_wakeups: s.reader_wakeups,
            tgtmap_clients: s.tgtmap_clients,
            hint_stale: s.hint_stale,
            fallback_urgent: s.fb_urgent,
            urgent_hits: s.urgent_hits,
            fallback_zerocopy: s.fb_zerocopy,
            zerocopy_refused: s.zc_refused,
            fallback_peek_off: s.fb_peek_off,
            peek_off_refused: s.peek_off_refused,
            fallback_short: s.fb_short,
            demotions_around: s.demotions_around,
        }
    }
}

/// Node-wide counters: the programs' own struct, summed over CPUs.
pub use meshwarp_bpf::shared::GlobalStats as GlobalCounters;
