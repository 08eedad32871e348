/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Structs shared between meshwarp's BPF programs and user space.
 *
 * Every struct here has a #[repr(C)] mirror in crates/bpf/src/shared.rs with a
 * layout test; change both together and bump MW_SCHEMA_VERSION when a pinned map's
 * key or value changes, so an agent never adopts maps of another layout.
 *
 * Addresses are 16 bytes for both families, in network byte order exactly as the
 * kernel hands them to sockops (IPv4 in ip[0], ip[1..3] zero). Ports are host order.
 */
#ifndef MESHWARP_SHARED_H
#define MESHWARP_SHARED_H

#define MW_SCHEMA_VERSION 28

#define MW_AF_INET 2
#define MW_AF_INET6 10

/*
 * ---- socket redirection (sockredir.bpf.c) ----
 *
 * A connection both of whose ends meshwarp accelerates is a *link*. Its id is
 * the pair of initial sequence numbers (client ISN + 1 in the high word, server
 * ISN + 1 in the low word): both ends know it at ESTABLISHED without talking to
 * each other, NAT does not change it, and two connections only share it if
 * their ISNs coincide. The client end creates the link with BPF_NOEXIST; a
 * second connection building the same id poisons it, so neither is redirected
 * (a collision is counted, never a wrong peer).
 *
 * Each accelerated link owns a *slot* (mw_slots, claimed with a compare and
 * swap): its ends sit in the SOCKMAP at 2 * slot + end, so a message finds its
 * peer by array index instead of hashing a key (SOCKHASH). A slot is free
 * again once neither end can still be in the SOCKMAP: an end closed with
 * redirected bytes unread keeps its entry until its file is closed, so its
 * slot is marked stale and user space frees it once both entries are empty.
 */

/* Which end of a connection a socket is. */
#define MW_END_CLIENT 0 /* it called connect() (capture: the origin) */
#define MW_END_SERVER 1 /* it was accepted (capture: by the proxy's listener) */

/* mw_slots value: the link id that owns the slot (0: free). */
struct mw_slot {
	__u64 owner;
	/* The link is gone but an end may still be in the SOCKMAP (closed with
	 * redirected bytes unread, its file still open): user space frees it. */
	__u32 stale;
	__u32 pad;
};

/* Positions a new link's client end tries in mw_slots, from its id's hash. */
#define MW_SLOT_PROBES 16

/* Mirror-pairing rule: connections from client_ip (any port) to
 * server_ip:server_port are covered, both ends. */
struct mw_pair_key {
	__u32 client_ip[4];
	__u32 server_ip[4];
	__u32 server_port;
	__u32 family;
};

/* Capture-pairing rule: connections from client_ip (all-zero: any client of
 * this family) to the original destination dst_ip:dst_port, which iptables
 * captures to a proxy listening on the rule's listener. */
struct mw_capture_key {
	__u32 client_ip[4];
	__u32 dst_ip[4];
	__u32 dst_port;
	__u32 family;
};

/* mw_rule.flags: ends a controller declared must never receive redirected
 * bytes (e.g. a proxy that splices). */
#define MW_RULE_NO_TARGET_CLIENT 1u
#define MW_RULE_NO_TARGET_SERVER 2u
/* mw_rule.flags: the rule's mode (neither bit: adaptive, the default). */
#define MW_RULE_MODE_ALWAYS 4u /* redirect every message the guard allows; no policy */
#define MW_RULE_MODE_NEVER 8u  /* covered, but every connection stays on TCP */

/* Value of both rule maps. */
struct mw_rule {
	/* Index into mw_stats; allocated by user space, < max rules. */
	__u32 id;
	/* Capture rules only: where the captured connection is accepted. */
	__u32 listener_port;
	__u32 listener_ip[4];
	__u32 flags;
	__u32 pad;
};

/* mw_link.kind */
#define MW_LINK_MIRROR 1
#define MW_LINK_CAPTURE 2

/* mw_link.flags */
#define MW_LINK_CLAIMED 1u  /* the server end found the link */
#define MW_LINK_POISONED 2u /* another connection built the same id: neither redirects */
#define MW_LINK_HIT 4u      /* a reader spliced with redirected bytes pending: being reset */
#define MW_LINK_OBSERVE 8u  /* the client end is not accelerated: the server end only learns its reader */
#define MW_LINK_FIXED 16u   /* the rule's mode is always: the policy never demotes */
#define MW_LINK_SLOT 32u    /* owns mw_slots[slot] (every accelerated link; not observe-only ones) */
#define MW_LINK_LONG 64u    /* an end redirected enough to pay for the handshake (struct mw_short) */

/* mw_link.end_flags[end] */
#define MW_EF_PSOCK 1u   /* in a SOCKMAP: its sends run sk_msg, unless MW_EF_TGTMAP */
#define MW_EF_TARGET 2u  /* its reader may be given redirected bytes */
#define MW_EF_NOSEND 4u  /* its own sends stay on TCP (a ULP such as kTLS, urgent data, SO_ZEROCOPY) */
#define MW_EF_CLOSED 8u
/* Not a target while its socket leaves the SOCKMAP, or is out of it (the
 * policy unlinked it, see mw_dir); cleared when it is back. */
#define MW_EF_PARKED 0x10u
/* Out of the SOCKMAP for good: it closed with nothing redirected left unread. */
#define MW_EF_GONE 0x20u
/* Its reader asks FIONREAD, and this kernel's FIONREAD counts only the
 * redirected bytes of a socket with a psock: bytes sent into it on TCP
 * would go uncounted (nginx, told 0, waits for an event, which only a
 * wake-up would bring: MW_EF_WAKE, a round trip through user space per
 * read), so the adaptive policy never moves a direction into it to TCP.
 * Set where the kernel has
 * that gap, at insert (the executable was seen asking, or FIONREAD readers
 * are not watched) or at its first FIONREAD on the socket. */
#define MW_EF_FIONREAD 0x40u
/* Its reader asked FIONREAD with TCP bytes queued behind its psock: that
 * FIONREAD did not count them, and bytes that came before the reader's
 * last event bring no new one (an edge-triggered epoll reader such as
 * nginx would wait for good). User space was asked to wake the reader
 * (mw_park, MW_PARK_WAKE), which clears the flag. */
#define MW_EF_WAKE 0x80u
/* Why an end is not, or no longer, a target. */
#define MW_EF_R_SPLICE 0x100u /* its reader can splice (program), or was seen splicing */
#define MW_EF_R_LOWAT 0x200u  /* SO_RCVLOWAT: the fast path ignores it */
#define MW_EF_R_ULP 0x400u    /* a ULP (kTLS) was set on it */
#define MW_EF_R_RULE 0x800u   /* the rule says never redirect into this end */
/* In mw_tgtmap, not mw_sockmap: a target whose own sends can never be
 * redirected (its peer is no target), so no sk_msg runs on them and its
 * socket keeps tcp_prot's sendmsg; redirects into it name mw_tgtmap. */
#define MW_EF_TGTMAP 0x1000u
/* With MW_EF_NOSEND: SO_ZEROCOPY is on (its completions count tcp_sendmsg
 * calls, which tcp_bpf's push would multiply), so it never rejoins
 * mw_sockmap either. */
#define MW_EF_ZEROCOPY 0x2000u
#define MW_EF_R_PEEKOFF 0x4000u /* SO_PEEK_OFF: a psock's peeks ignore the offset */

/* An executable, as the kernel names it: device and inode of its file. */
struct mw_exe_key {
	__u64 dev; /* super_block s_dev (kernel encoding) */
	__u64 ino;
};

/*
 * One direction of a link, indexed by its sending end: the adaptive policy.
 * A direction is demoted to the TCP path when it streams writes that TCP
 * would coalesce (Nagle or cork on; small ones, or up to MW_POLICY_BATCH
 * into a reader that keeps up), or small nodelay writes its reader falls
 * behind on (MW_POLICY_BEHIND): bytes already redirected sit in the
 * peer's psock queue, which tcp_bpf reads before its TCP queue, so demoting
 * never reorders. It is promoted back only when every byte it sent on TCP has
 * been read by the peer (tcp_read == the sender's write_seq): only then can
 * new redirected bytes not overtake older TCP ones.
 */
struct mw_dir {
	__u32 flags;     /* MW_DIR_* */
	__u32 run;       /* messages sent since the other end last sent (or, its sends passing no sk_msg, since this end read TCP bytes) */
	__u32 run_bytes; /* their bytes (the run's first MW_POLICY_RUN messages) */
	/* The peer's copied_seq as its reads publish it: how far its reader
	 * consumed this direction's TCP bytes. Starts at this end's ISN + 1. */
	__u32 tcp_read;
	/* Bytes this end's sender handed to the peer's psock, counted before
	 * each redirect: the peer may leave the SOCKMAP only once its reads
	 * of redirected bytes (mw_sock_state.psock_rd) caught up with them. */
	__u32 redir;
	/* The peer's reads of redirected bytes (its mw_sock_state.psock_rd)
	 * as it publishes them: redir - psock_read is how far its reader is
	 * behind this direction's fast path (a stale value only overstates
	 * it). Not published by a reader of several threads (MW_DIR_RD_SHARED). */
	__u32 psock_read;
	/* The CPU the peer's reader last read on, plus one (0: no read yet): a
	 * reader on another CPU than the sender copies out while it sends
	 * (reader_concurrent). A hint: a stale one can send a message on TCP
	 * (and those after it, until the reader read them) where the fast
	 * path would not have waited, or redirect into a reader copying out
	 * (a wait); both deliver every byte in order. */
	__u32 rd_cpu;
	/* A MW_DIR_TIMED direction's exchanges, timed by the peer's sends
	 * (judge_streamed): when the peer last looked (ktime >> 10, about
	 * microseconds; 0: never) and how far its reader had read then
	 * (tcp_read + psock_read); each path's rate over the exchanges since
	 * (bytes per ~ms, averaged; 0: not measured yet); exchanges timed. */
	__u32 t0;
	__u32 r0;
	__u32 rate_fast;
	__u32 rate_tcp;
	__u32 timed;
};

/* mw_dir.flags */
#define MW_DIR_TCP 1u        /* demoted by the policy */
#define MW_DIR_UNLINK_REQ 2u /* parked and drained: user space was asked to delete its entry */
#define MW_DIR_UNLINKED 4u   /* out of the SOCKMAP: plain tcp_prot, its sends cost nothing */
#define MW_DIR_RELINK_REQ 8u /* user space was asked to put it back */
/* mw_unlink is deleting its entry: until it is done the end counts as in the
 * SOCKMAP, so its slot cannot be freed and reused under the delete. */
#define MW_DIR_UNLINKING 16u
/* The peer reads from several threads: its psock reads are not counted
 * (psock_read stays behind), so no reader-behind check for this direction. */
#define MW_DIR_RD_SHARED 32u
/* A client end whose server end turned out to be no target after it joined
 * mw_sockmap (no hint at its connect): its sends can never be redirected, so
 * it leaves mw_sockmap (mw_unlink) and joins mw_tgtmap once its psock is
 * gone (mw_park), where no sk_msg runs on its sends. Parked meanwhile: its
 * peer's bytes take TCP until it is in. */
#define MW_DIR_MOVE 64u
/* Its relink was asked without waking user space (a TCP Fast Open server
 * end's first join, in mw_joins): the peer's next send, finding it still
 * out, asks with a wake-up once. */
#define MW_DIR_QUIET 128u
/* Demoted streaming large writes into a reader on another CPU: never
 * promoted, and once out of the SOCKMAP it stays out (no relink): TCP
 * copies in and out at once there, and every return cost the next
 * response its first messages again (finish_msg). Until its timed
 * exchanges (MW_DIR_TIMED) show the fast path faster. */
#define MW_DIR_STREAMED 256u
/* A direction whose exchanges its peer times (judge_streamed): one
 * MW_DIR_STREAMED put on TCP, or one its rule's rates kept redirected
 * instead (keep_by_rule). Which path moves its large writes faster is
 * measured, not assumed (a host's wake-ups decide it). */
#define MW_DIR_TIMED 512u
/* The fast path measured faster for a MW_DIR_TIMED direction, or is being
 * tried again: its large writes stay redirected into a reader copying out
 * (no large_into_copying_reader, no goes_around for large writes, no
 * coalescing of large writes, no pipelined-request rule of
 * nodelay_around_lock); on TCP, its end is relinked even mid-response
 * (mw_park), does not leave the SOCKMAP, and is promoted at any look once
 * its reader read every TCP byte. Cleared by any demotion (demote), and
 * by a look that finds the try still on TCP. */
#define MW_DIR_KEEP 1024u
/* judge_streamed switched its path: the next exchange is not timed. */
#define MW_DIR_SWITCHED 2048u

/* The policy: after MW_POLICY_COALESCE messages without a reply, a direction
 * whose sender lets TCP coalesce (Nagle or cork) and whose first
 * MW_POLICY_RUN messages averaged under MW_POLICY_SMALL bytes moves to TCP
 * (for nodelay senders see MW_POLICY_BEHIND; for writes up to
 * MW_POLICY_BATCH, MW_POLICY_KEEPUP). Other writes stay: redirecting
 * them beats TCP (benches/README.md); sk_msg sees a large write in chunks
 * (as send buffer space allows), so the bars sit well below the chunk size.
 * They move only if their reader falls as far behind as TCP's buffers could
 * hold (tcp_ahead_max); and a message at a time (goes_around) when writes
 * averaging MW_POLICY_SMALL or more find their reader copying out on
 * another CPU (reader_concurrent: TCP lets both copy at once, a redirect
 * waits for the reader's lock), or small Nagle writes find it busy
 * (reader_busy); and nodelay answers and pipelined requests whose peer
 * holds its lock (nodelay_around_lock). */
#define MW_POLICY_RUN 8
#define MW_POLICY_SMALL 4096
/* Writes under MW_POLICY_BATCH bytes (on average over the run's first
 * MW_POLICY_RUN) that TCP would coalesce move to TCP at MW_POLICY_COALESCE
 * too, or at any check after it, once their reader keeps up (no more than
 * MW_POLICY_KEEPUP redirected
 * bytes unread; a reader of several threads, whose reads are not counted,
 * is taken as keeping up): such a reader sleeps between writes, and the fast path
 * wakes it once per write where TCP gathers several writes into one
 * segment and one wake-up. socat's 8 KiB writes to a reader keeping up took
 * 1.08x TCP's time; 1 x 16 KiB Nagle streams 0.77-0.92x TCP's throughput
 * (benches/README.md, 2026-11-25 night). A reader behind takes several
 * writes per read anyway: there the fast path's cheaper bytes win (8 x 16
 * KiB Nagle streams 1.45x TCP), and the writes stay while it stays
 * behind (but for messages that go around a reader on another CPU,
 * goes_around). Judged at message 64 only, a reader behind at that moment that
 * caught up later kept socat's 8 KiB writes on the fast path at 1.07x
 * TCP's time; judged at every check after it too, 0.94x (2026-11-28). */
#define MW_POLICY_BATCH 32768
#define MW_POLICY_KEEPUP 131072
/* Not sooner: a burst of pipelined requests (a redis client's) is a run
 * too, and a burst split between the two paths waits on TCP's timers. Its
 * tail goes on TCP while the head is still being read, and Nagle holds
 * that tail until its first segment is acknowledged, which the peer delays
 * (40 ms) when its answers, redirected, carry no acknowledgment. A burst of
 * 16 x 64 B Nagle writes, answered one by one, took 44–88 ms per burst
 * with the demotion at 8 messages, 44 ms on plain TCP, 0.2 ms redirected
 * (benches/README.md, 2026-11-25 evening). Streams pay the redirect's
 * per-message cost for 56 messages more. */
#define MW_POLICY_COALESCE 64
/* A Nagle run (not corked) whose tail TCP would hold for the peer's delayed
 * ACK (tail_waits_ack: the peer redirects to this end, or its TCP is in
 * pingpong mode) is not moved to TCP for coalescing, nor around a busy
 * reader, before this many messages. On TCP, Nagle sends a run's last
 * partial segment only once the peer acknowledged what went before, and a
 * peer whose TCP answered soon after it received (a client asking for the
 * next response) acknowledges a small segment only when its delayed-ACK
 * timer fires, 40 ms or more: a 1 MiB download in 1 KiB Nagle writes took
 * 20 ms on TCP, 1.2 ms redirected, 22 ms in adaptive mode, which moved it
 * to TCP at MW_POLICY_COALESCE (benches/README.md, 2026-12-05, night).
 * Past this many, such a run has paid the redirect's extra cost per small
 * write (about 1.1-1.8 us: 1 KiB Nagle streams run 0.27x TCP's throughput
 * redirected) for a few milliseconds, a fraction of one delayed ACK, and
 * moves at the next check. Meanwhile its reader may fall behind only as
 * far as TCP's buffers would let it (tcp_ahead_max; a reader of several
 * threads, whose reads are not counted, as far as these messages). */
#define MW_POLICY_DELACK 2048
/* A write this large in a run's first MW_POLICY_RUN messages, into a reader
 * copying out this direction's redirected bytes on another CPU, moves the
 * direction to TCP for good (large_into_copying_reader, MW_DIR_STREAMED;
 * not from a Nagle writer), up to a message of MW_POLICY_HUGE. */
#define MW_POLICY_LARGE 16384
#define MW_POLICY_HUGE 262144
/* A MW_DIR_TIMED direction is judged once its reader read MW_POLICY_HUGE
 * bytes since the last look, and every MW_POLICY_PROBE judgements it tries
 * the other path for one exchange: a choice measured once would hold
 * against a host whose load changed. */
#define MW_POLICY_PROBE 64
/* The longest span a look times (ktime >> 10 units, about 10 s): a longer
 * one is the application's pause, or a clock past its 32 bits. */
#define MW_POLICY_SPAN 10000000u
/* A demoted direction looks at its link on its first send after it read
 * something (a new exchange may have started) and otherwise once per
 * MW_POLICY_CHECK messages; the others cost one storage lookup. */
#define MW_POLICY_CHECK 16
/* A demoted direction that kept streaming for MW_POLICY_UNLINK checks after
 * its demotion (about MW_POLICY_UNLINK * MW_POLICY_CHECK messages without a
 * reply) asks to leave
 * the SOCKMAP: a psock socket pays tcp_bpf on every send and read even on the
 * TCP path. Its peer's next message asks to put it back (not a
 * MW_DIR_STREAMED one: it asks at any check, and stays out; but see the
 * Nagle answers below). A direction demoted
 * because its reader fell behind had already streamed MW_POLICY_BEHIND
 * messages: it asks at its first check after the demotion (one at
 * MW_POLICY_COALESCE itself waits two checks too). Two checks (not
 * eight): 8 x 1 KiB Nagle streams went from 0.93x to 0.96x of TCP (paths
 * bench, interleaved medians of 41 turns). A Nagle end (not corked) whose
 * peer redirects to it does not ask (MW_DIR_STREAMED or not) while its run
 * is under MW_POLICY_ANSWER: out of the SOCKMAP, the peer's next request
 * would go on TCP right after an answer came on TCP, putting the peer's TCP
 * in pingpong mode, where the next answer's tail waits for a delayed ACK
 * (MW_POLICY_DELACK). A run counts its messages until its demotion, then
 * its checks (one per MW_POLICY_CHECK messages): one demoted at
 * MW_POLICY_DELACK stays in for 32 768 messages more. A run that long is a
 * stream, not an answer waited for: a greeting that once came redirected
 * does not keep an end streaming for good in the SOCKMAP. */
#define MW_POLICY_UNLINK 2
#define MW_POLICY_ANSWER 4096
/* A direction whose writes TCP would not coalesce (nodelay) stays on the
 * fast path while its reader keeps up. Once a stream of small writes finds
 * its reader MW_POLICY_BEHIND messages behind (checked every
 * MW_POLICY_CHECK messages of the run), TCP, which sends a backlog as a few
 * large segments, costs less per byte than one psock message per write.
 * 32, not 256: streams of 64 connections reached 256 behind almost at once
 * and paid the redirect's cost (0.57x TCP there) for their first ~290
 * writes: 64 x 64 B nodelay 0.75-0.81x TCP, 0.90x at 32; a burst of 100
 * nodelay requests 1.07-1.12x TCP's time, 1.01x at 32; one connection,
 * whose reader falls behind now and then, loses its small gain (1.07x
 * always) but stays at TCP's (benches/README.md, 2026-12-04, late). */
#define MW_POLICY_BEHIND 32

/* The connection both accelerated ends share (mw_links, indexed by its slot;
 * found from the id alone by probing the slots the id hashes to). */
struct mw_link {
	__u32 family;
	__u32 kind;
	__u32 client_ip[4];
	/* Mirror: the server; capture: the listener that accepts the captured
	 * connection. What the server end sees as its local endpoint. */
	__u32 server_ip[4];
	__u32 client_port;
	__u32 server_port;
	__u32 rule_id;
	__u32 flags;
	__u32 end_flags[2];
	__u64 cookie[2];
	/* Each end's struct sock address, set as it enters the SOCKMAP: a hint
	 * for the policy (reader_busy), read through an untrusted cast only. */
	__u64 sk[2];
	struct mw_exe_key exe[2]; /* who reads each end (owner stamp), for sweeps */
	__u64 netns[2];           /* each end's network namespace (cookie) */
	struct mw_dir dir[2];
	__u32 slot; /* mw_slots index: the ends are at 2 * slot + end in the SOCKMAP */
	__u32 pad;  /* observe-only links (mw_observe): why the client end is not accelerated (MW_FB_*) */
	/* The link id (0: the element is free). mw_links is an array indexed
	 * by the slot: a program that knows the slot finds the link by index
	 * and checks the id, instead of hashing it on every message. */
	__u64 id;
};

/* What mw_cookies maps a socket cookie to (found from a file descriptor). */
struct mw_cookie_val {
	__u64 link;
	__u32 end;
	__u32 rule_id;
	__u32 slot; /* the link's mw_links index */
	__u32 pad;
};

/* Where a socket's message or connection is in its plugin chain (socket
 * local storage, mw_sk_chain): the only per-socket state plugins reach. The
 * host sets it when a chain starts; each plugin moves it to the next
 * position. The host never trusts it for anything but the chain. */
struct mw_sk_chain {
	__u32 flags;   /* chain generation and position (MW_SOCK_CHAIN_*_SHIFT) */
	__u32 rule_id; /* the covering rule, for the plugin's context */
};

/* Who owns a socket: stamped at connect() of a covered connection, in the
 * caller's context (mw_sock_state.own); a covered server end's is copied
 * at its handshake from its listener's service (struct mw_service). */
struct mw_sock_owner {
	struct mw_exe_key exe;
	__u32 tgid;
	__u32 flags;
};

/* mw_sock_owner.flags */
#define MW_OWN_KNOWN 1u
/* Set while its connect() was in progress (mw_setsockopt): the kernel
 * applies an option after the hook, in a second section under the socket's
 * lock, and the handshake can complete in between. */
#define MW_OWN_ZEROCOPY 2u
#define MW_OWN_PEEK_OFF 4u

/* Per-socket state set by sockops (socket local storage), read and written
 * by the host's programs only. Also kept for covered sockets that are not
 * accelerated, so their reads can be observed. */
struct mw_sock_state {
	__u64 link; /* 0: not accelerated */
	__u32 rule_id;
	__u32 flags; /* sk_msg and plugins, under the socket lock */
	__u32 end;
	__u32 learn; /* an unstamped server end: MW_LEARN | its listening port */
	__u32 rd_pub;   /* the copied_seq last published to mw_link.dir[peer].tcp_read */
	__u32 rd_tgid;  /* the process whose reads were last recorded ... */
	__u32 rd_seen;  /* ... and which MW_EXE_SEEN_* bits they set (reads skip known ones) */
	__u32 skipped;  /* messages a demoted direction sent since its last policy check */
	__u32 read;     /* a demoted end read since that check: its next send checks */
	__u32 psock_rd; /* bytes its reader took from the psock queue (redirected ones) */
	__u32 rd_pid;   /* the thread that reads it, MW_RD_SHARED once several did */
	__u32 slot;     /* the link's mw_links index (with link) */
	/* The connection's id (ISNs, as mw_link.id) whether accelerated or
	 * not: the latency monitor and the connection list key on it. */
	__u64 conn;
	__u64 tx_msgs;  /* messages this end redirected */
	__u64 tx_bytes; /* their bytes */
	__u64 req_ts;   /* latency monitor: the oldest send not answered by a read yet */
	__u32 fb;       /* why this connection is not accelerated (MW_FB_*) */
	/* Latency monitor sampling (sends, under the socket lock): the time of
	 * this end's last sample of its own (ns >> 10, wrapping), the sends
	 * still to skip before the next, and how many the last sample chose. */
	__u32 lat_last;
	__u16 lat_skip;
	__u16 lat_cap;
	/* The TCP-path send tracepoint fires once per skb a send fills: the
	 * write_seq the send it saw last will end at (write_seq + bytes left
	 * stays the same through one send, and across a retried partial one). */
	__u32 lat_end;
	/* Who owns the socket, kept across init_state: one socket storage
	 * element per socket, made at connect() (or at a server end's
	 * handshake) and only filled in at the handshake, instead of a second
	 * one (a kmalloc, a memcg charge and an RCU free each). */
	struct mw_sock_owner own;
};

/* mw_sock_state.fb: why a covered connection stays on the TCP path. */
#define MW_FB_NONE 0
#define MW_FB_MODE_NEVER 1 /* the rule's mode is never */
#define MW_FB_READER 2     /* a reader that may block, or not classified yet */
#define MW_FB_COLLISION 3  /* another connection built the same id */
#define MW_FB_NO_SLOT 4    /* no free slot (the data path is full) */
#define MW_FB_INSERT 5     /* the SOCKMAP refused the socket */
#define MW_FB_PEER 6       /* the other end is not accelerated */
#define MW_FB_SYN_DATA 7   /* a Fast Open server end: before the last ACK, or kept out (mw_tgtmap) */
#define MW_FB_NO_TARGET 8  /* neither end may be given redirected bytes */
#define MW_FB_ZEROCOPY 9   /* SO_ZEROCOPY on at connect, with an on_message plugin loaded */

/* mw_sock_state.rd_pid: more than one thread read this socket. */
#define MW_RD_SHARED 0xffffffffu

/* mw_sock_state.learn: the port is kept from the handshake because a socket
 * read after it closed (a server that reads last) has left the port table. */
#define MW_LEARN 0x10000u

/* mw_sock_state.flags */
/* The state of a covered connection's end (init_state). Without it the
 * element holds only its owner (a client's before its handshake, or the
 * marks of mw_setsockopt), which every program takes for no state at all. */
#define MW_SOCK_END 1u
#define MW_SOCK_DEMOTED 2u    /* the policy moved this end's sends to TCP (mirrors mw_dir) */
#define MW_SOCK_TGTMAP 4u     /* in mw_tgtmap: no sk_msg sees its sends (MW_EF_TGTMAP) */
/* A server end made by Fast Open, at its client's SYN: its client end links
 * at the SYN-ACK, so it claims the link at the handshake's last ACK
 * (on_fastopen_established). */
#define MW_SOCK_FASTOPEN 8u
/* A late joiner (Fast Open, or a FIONREAD reader with bytes on their way)
 * asked in mw_joins: its close takes the request back, so user space sees
 * only those of open connections (most close before they are served). */
#define MW_SOCK_JOIN_ASKED 16u
/* Plugin chain position of the message (or connection) being handled: bits 8-15
 * the next chain position, bit 16 the chain generation it started on. Only the
 * programs of one socket's hook touch them, under the socket's lock. */
#define MW_SOCK_CHAIN_POS_SHIFT 8
#define MW_SOCK_CHAIN_GEN_SHIFT 16

/* What the programs saw an executable do (mw_exes, written by BPF only). */
struct mw_exe {
	__u32 flags;
	__u32 tgid; /* a process that ran it */
	char comm[16];
};

/* How user space classified an executable from its ELF (mw_exe_class,
 * written by user space only). */
struct mw_exe_class {
	__u32 flags;
	__u32 pad;
};

/* Flags of both. */
#define MW_EXE_CLASSIFIED 1u     /* its ELF (and libraries) were read */
#define MW_EXE_SPLICE 2u         /* it can call splice(2): imports it, or a Go binary */
#define MW_EXE_OPAQUE 4u         /* unreadable (stripped static): treated as able to splice */
#define MW_EXE_TRUSTED 8u        /* the operator vouches for its readers (no splice, no blocking reads) */
/* Seen at run time by the programs (mw_exes; the flags above are mw_exe_class). */
#define MW_EXE_PENDING 0x10u     /* classification was requested */
#define MW_EXE_SEEN_SPLICE 0x100u
#define MW_EXE_SEEN_BLOCKING 0x200u    /* read a covered socket in blocking mode */
#define MW_EXE_SEEN_NONBLOCKING 0x400u /* read a covered socket without blocking */
#define MW_EXE_SEEN_FIONREAD 0x800u    /* asked FIONREAD/SIOCINQ on a covered socket */
#define MW_EXE_SEEN_URGENT 0x1000u     /* sent urgent data (MSG_OOB) on a covered socket */
#define MW_EXE_SEEN_ZEROCOPY 0x2000u   /* set SO_ZEROCOPY on a covered socket */
#define MW_EXE_SEEN_PEEK_OFF 0x4000u   /* set SO_PEEK_OFF on a covered socket */

/* How one executable reads one service (mw_readers): the blocking judgement
 * is made per executable and service, so a runtime that runs event-driven
 * and blocking programs (every Java program is `java`) keeps its
 * non-blocking services accelerated. `port` is the service's: a server
 * end's local port, a client end's remote port; `end` is MW_END_*. */
/* mw_joins: a TCP Fast Open server end to join mw_sockmap (mw_park), keyed
 * by its socket cookie. Asked without a ring-buffer event, which would wake
 * the guard thread (a CPU's wake-up) for each connection, most of them
 * closed before it would be served: the socket's close takes the request
 * back (MW_SOCK_JOIN_ASKED), and the thread serves what is still here after
 * JOIN_AFTER (2 ms) when it runs (an event, a due request, at most every
 * 50 ms). */
struct mw_join {
	__u64 netns;
	__u32 tid; /* the thread that asked: its namespace is tried first */
	__u32 pad;
};

/* mw_ports (one element): the server ports some rule names, in host order
 * (a pair's server port, a capture rule's destination and listener ports),
 * one bit each. A handshake or connect() whose server port has no bit is
 * not covered: one lookup instead of the rule maps' hashes, the link's
 * slots and a listener lookup, for every TCP socket of the cgroup.
 * Bit 0 (port 0, never a server's) says user space keeps the set; without
 * it (a map an upgrade just created) every port may be covered. */
#define MW_PORT_WORDS 1024
struct mw_ports {
	__u64 bits[MW_PORT_WORDS];
};

/*
 * mw_short, per rule id: whether an adaptive rule's connections are short.
 * A covered connection pays at its handshake and close (the psocks, the
 * link, its state; benches/README.md, short connections) what a few
 * redirected messages win back; one that closes after a request and its
 * answer is slower than TCP. A connection is long once one end redirected
 * MW_SHORT_MSGS messages or MW_SHORT_BYTES bytes (MW_LINK_LONG), which
 * clears its rule's score at once (and again every MW_SHORT_AGAIN
 * messages an end redirects); a connection whose ends both joined and
 * that closed short adds one. While the score is at least MW_SHORT_AFTER,
 * the rule's new connections stay on TCP, uncovered (no stamp at
 * connect(), no link, no psock), but for every MW_SHORT_PROBE-th: a probe,
 * covered, which ends the run once connections grow long again. A run
 * whose last short connection closed MW_SHORT_FOR ago or more is over (the
 * score starts again from 0): the rule's connections are all covered until
 * they prove short again, so a rule never stays judged short on old news
 * (a Fast Open probe cannot tell: its server end, whose state is made at
 * the SYN before its client's decision, is left out with the others).
 */
struct mw_short {
	__u32 score; /* connections in a row that closed short (saturates at MW_SHORT_MAX) */
	__u32 seen;  /* connections met while the score says short: picks the probes */
	__u64 last;  /* when the last short one closed (ns, bpf_ktime_get_ns) */
	/* What the rule's MW_DIR_TIMED directions measured (judge_streamed),
	 * averaged over its connections: a new one whose large writes would
	 * move to TCP starts on the faster path (rule_prefers_fast) instead of
	 * paying each exchange it takes to measure both; `looks` picks which
	 * look tries the other path (every MW_POLICY_PROBE-th of the rule's). */
	__u32 rate_fast;
	__u32 rate_tcp;
	__u32 looks;
	__u32 pad;
};

#define MW_SHORT_MSGS 3
#define MW_SHORT_BYTES (256 * 1024)
#define MW_SHORT_AFTER 16
#define MW_SHORT_PROBE 16
#define MW_SHORT_MAX 1024
#define MW_SHORT_AGAIN 64
#define MW_SHORT_FOR 1000000000ULL

struct mw_reader_key {
	struct mw_exe_key exe;
	__u64 netns;
	__u16 port;
	__u16 end;
	__u32 pad;
};

/* A listening service (mw_services): the program that listens on it,
 * written at listen() (listeners are never stamped: every socket they
 * accept would clone the element), or, for a listener that predates
 * meshwarp, by the reader of its first covered connection. */
struct mw_service_key {
	__u64 netns;
	__u32 port;
	__u32 family;
};

/* What mw_services holds for a service: its program, and the process that
 * listened (MW_SVC_*). */
struct mw_service {
	struct mw_exe_key exe;
	__u32 tgid;  /* who listened; 0 when learned from reads */
	__u32 flags;
};

/* mw_service.flags */
/* Learned from the reads of an end (its listener predates meshwarp). */
#define MW_SVC_LEARNED 1u
/* Two programs listened on the service (addresses, a SO_REUSEPORT group, a
 * new binary): no program is known for its ends, which are not accelerated.
 * Kept until the entry is evicted (nothing overwrites it). */
#define MW_SVC_MIXED 2u

/* Node configuration written by user space (mw_config[0]). */
struct mw_config {
	__u32 flags;
	__u32 pad;
	/* With MW_CFG_LAT_ALL: when the monitor was switched on (CLOCK_MONOTONIC
	 * ns); stamps older than that are dropped, never recorded. */
	__u64 lat_since;
};

/* mw_config.flags */
#define MW_CFG_GUARD 1u             /* the reader guard decides which ends are targets */
#define MW_CFG_SPLICE_BLIND 2u      /* kernel: splice() does not see redirected bytes */
#define MW_CFG_FIONREAD_PSOCK 4u    /* kernel: FIONREAD counts only redirected bytes */
#define MW_CFG_BLOCKING_EAGAIN 8u   /* kernel: a blocked read of a psock can return EAGAIN */
#define MW_CFG_SYSCALL_WATCH 16u    /* sys_enter watches splice() and FIONREAD */
#define MW_CFG_LATENCY 32u          /* the latency monitor runs for the rules mw_lat_rule names */
#define MW_CFG_LAT_ALL 64u          /* ... for every rule (with MW_CFG_LATENCY) */
#define MW_CFG_LAT_EVERY 128u       /* ... measuring every message (else sampled: MW_LAT_SKIP_MAX) */
#define MW_CFG_LAT_CLEAN 256u       /* user space: the monitor never ran on these maps (no histogram to forget) */

/* Sampling, MW_CFG_LAT_EVERY off: a sampled request carries its stamp along
 * its chain (read, the thread's next send, ...); a socket starts a chain of
 * its own after skipping up to MW_LAT_SKIP_MAX sends, the count doubling
 * while its samples come less than MW_LAT_GAP apart (units of 1024 ns) and
 * halving otherwise: sockets that send less than about once per ms are
 * measured on every message. */
#define MW_LAT_SKIP_MAX 63u
#define MW_LAT_GAP 1000u
/* ... and a socket whose last own sample is older than this (units of 1024
 * ns, ~20 ms) measures every send again, found within 8 sends. */
#define MW_LAT_IDLE 20000u

/* Events for user space (mw_events ring buffer). */
#define MW_EV_CLASSIFY 1     /* an executable meshwarp has not read yet */
#define MW_EV_SPLICE_HIT 2   /* a reader spliced with redirected bytes pending */
#define MW_EV_SPLICE_SEEN 3  /* an executable was seen splicing a covered socket */
#define MW_EV_UNLINK 4       /* a parked, drained end streams: delete its SOCKMAP entry (mw_unlink) */
#define MW_EV_RELINK 5       /* the peer of an unlinked end sent: put it back */
#define MW_EV_SLOT_STALE 6   /* a link's slot waits for its SOCKMAP entries to empty */
#define MW_EV_WAKE 7         /* wake the reader of a socket (MW_EF_WAKE) */
#define MW_EV_MOVE 8         /* move a client end to mw_tgtmap (MW_DIR_MOVE): mw_unlink, then mw_park */
#define MW_EV_URGENT_HIT 9   /* urgent data (MSG_OOB) sent into a reader with redirected bytes unread */

/* A request to mw_park (iter/tcp) for one socket, keyed by its cookie in
 * mw_park_req: user space writes op, the iterator writes result. mw_unlink
 * (run by BPF_PROG_TEST_RUN) returns the same results. */
struct mw_park_req {
	__u32 op;
	__u32 result;
};

#define MW_PARK_RELINK 2 /* enter the SOCKMAP again (1 and 3: retired) */
#define MW_PARK_WAKE 4   /* wake the socket's reader (MW_EF_WAKE) */

#define MW_PARK_PENDING 0
#define MW_PARK_DONE 1
#define MW_PARK_BUSY 2   /* not served (the walk failed): ask again later */
#define MW_PARK_MOOT 3   /* nothing to do: promoted meanwhile, closing, or not a target */
#define MW_PARK_FAILED 4 /* the SOCKMAP refused */

struct mw_event {
	__u32 type;
	__u32 pid;
	__u32 tgid;
	__u32 rule_id;
	char comm[16];
	struct mw_exe_key exe;
	__u64 link;
	__u64 cookie;      /* the socket the event is about */
	__u64 peer_cookie;
	__u64 netns;
	__u32 end;
	__u32 pending;     /* redirected bytes unread: splice could not see them, or urgent data would pass them */
	__u32 family;
	__u32 client_port;
	__u32 server_port;
	__u32 slot;        /* MW_EV_SLOT_STALE: the mw_slots index */
	__u32 client_ip[4];
	__u32 server_ip[4];
};

/* Per-rule counters, one slot per rule id in a per-CPU array. */
struct mw_rule_stats {
	__u64 sockets;          /* sockets in the SOCKMAP (a per-CPU slot may wrap: sum them) */
	__u64 msgs;             /* messages redirected */
	__u64 bytes;            /* bytes redirected */
	__u64 fb_no_peer;       /* messages sent on the TCP path: peer absent or not a target */
	__u64 fb_tcp_path;      /* messages sent on the TCP path: this direction already used it */
	__u64 fb_map_full;      /* covered sockets not inserted: a map is full */
	__u64 fb_insert_err;    /* covered sockets not inserted: other error */
	__u64 fb_collision;     /* connections not accelerated: another one built the same key */
	__u64 fb_reader;        /* connections not accelerated: a reader that may block, or not classified yet */
	__u64 fb_splice;        /* ends not made targets: the reader can splice */
	__u64 fb_lowat;         /* ends withdrawn as targets: SO_RCVLOWAT */
	__u64 fb_ulp;           /* ends withdrawn: a ULP (kTLS) was set */
	__u64 ulp_refused;      /* ULP refused: redirected bytes were waiting to be read */
	__u64 splice_hits;      /* readers spliced with redirected bytes pending (connection reset) */
	__u64 demotions;        /* directions moved to TCP: small writes TCP coalesces (Nagle/cork) */
	__u64 promotions;       /* directions moved back: a new exchange, TCP bytes all read */
	__u64 policy_tcp_msgs;  /* messages a demoted direction sent on TCP */
	__u64 fb_mode_never;    /* connections left on TCP: the rule's mode is never */
	__u64 unlinks;          /* demoted ends taken out of the SOCKMAP (plain TCP, no tcp_bpf) */
	__u64 relinks;          /* unlinked ends put back when their peer sent */
	__u64 demotions_behind; /* directions moved to TCP: the reader behind (MW_POLICY_BEHIND, tcp_ahead_max) */
	__u64 fb_reader_busy;   /* messages sent on TCP around a reader copying out, or about to (goes_around), or a nodelay answer or pipelined request around a peer holding its lock (nodelay_around_lock) */
	__u64 reader_wakeups;   /* FIONREAD readers woken for TCP bytes their FIONREAD missed (MW_EF_WAKE) */
	__u64 tgtmap_clients;   /* client ends put in mw_tgtmap at connect: their server end is never a target (rule, mw_srv_hint) */
	__u64 hint_stale;       /* server ends withdrawn as targets: their client went by a stale mw_srv_hint */
	__u64 fb_urgent;        /* ends whose sends left the fast path: urgent data (MSG_OOB), sent or seen from their program */
	__u64 urgent_hits;      /* urgent data sent with redirected bytes unread by the peer (connection reset) */
	__u64 fb_zerocopy;      /* ends whose sends stay on TCP: SO_ZEROCOPY on them, or seen from their program */
	__u64 zc_refused;       /* SO_ZEROCOPY refused (EOPNOTSUPP) on a socket whose sends run sk_msg */
	__u64 fb_peek_off;      /* ends withdrawn as targets: SO_PEEK_OFF on them, or seen from their program */
	__u64 peek_off_refused; /* SO_PEEK_OFF refused (EOPNOTSUPP): redirected bytes were unread */
	__u64 fb_short;         /* connections left on TCP: the rule's last ones were all short (struct mw_short) */
	__u64 demotions_around; /* directions moved to TCP: a run past MW_POLICY_COALESCE going around its reader,
				 * or past MW_POLICY_RUN one of large writes into a reader on another CPU */
};

/*
 * ---- the latency monitor ----
 *
 * Log2 histograms per rule and metric (mw_lat_rows, mw_lat_hist; per CPU), recorded only
 * while mw_config has MW_CFG_LATENCY and the rule is on (MW_CFG_LAT_ALL, or
 * mw_lat_rule[rule id]: when it was switched on, 0 = off); its TCP-path send
 * tracepoint is attached only then, so a monitor that is off costs one flag
 * test per message. A stamp older than the switch is dropped.
 */
#define MW_LAT_FAST 1     /* delivery, fast path: a send to the peer's read that returns it (redirected) */
#define MW_LAT_TCP 2      /* delivery, TCP path: the same for bytes that crossed TCP */
#define MW_LAT_SETUP 3    /* connect() to ESTABLISHED, at the client end */
#define MW_LAT_RESPONSE 4 /* a send to the next read on the same socket: request to response, as the application sees it */
#define MW_LAT_THINK 5    /* a read to the same thread's next send on the same connection: the application's own time */
#define MW_LAT_HOP 6      /* a read of one rule's socket to the same thread's next send on another rule's: a proxy between two hops (from_rule -> rule_id) */
/* An interface route (the tc family): a packet's time from its sender's TCP
 * transmit (the departure time TCP stamps, skb->tstamp, kept across veth
 * and namespaces) to the route that redirects it: the sender's qdisc and
 * device queues. Packets without that stamp (forwarded from elsewhere) are
 * not measured. */
#define MW_LAT_TRANSIT 7
#define MW_LAT_METRICS 7
/* The metrics of one rule's row in mw_lat_rows (every one but MW_LAT_HOP). */
#define MW_LAT_ROW_METRICS 5
/* The tc family's rows: one metric per route, MW_LAT_TRANSIT. */
#define MW_LAT_RT_ROW_METRICS 1
/* Rule ids below this have their rows in mw_lat_rows, found by index (ids are
 * handed out lowest first); the others, and every hop, hash in mw_lat_hist. */
#define MW_LAT_ROWS 256
/* Bucket i counts [2^i, 2^(i+1)) ns; bucket 0 also takes 0, the last everything above. */
#define MW_LAT_BUCKETS 32

struct mw_lat_key {
	__u32 rule_id;
	__u32 metric;
	__u32 from_rule; /* MW_LAT_HOP: the rule whose socket the proxy read; MW_NO_ID otherwise */
	__u32 pad;
};

struct mw_lat_hist {
	__u64 count;
	__u64 sum_ns;
	__u64 bucket[MW_LAT_BUCKETS];
};

/* The oldest unread send of one direction of a connection (mw_lat_pend,
 * value: its time in ns), keyed by the connection and the sending end. */
struct mw_lat_pend_key {
	__u64 conn;
	__u32 end;
	__u32 pad;
};

/* A thread's last read of a covered socket (mw_lat_thr: the thread's task
 * storage; mw_lat_thrh on kernels whose sk_msg cannot use it). */
struct mw_lat_thread {
	__u64 ts;
	__u64 conn;
	__u64 pid_tgid; /* mw_lat_thrh: whose thread id this is */
	__u32 rule_id;
	__u32 end; /* the end it read */
};

/* One socket meshwarp holds, as the mw_conns iterator writes it. */
struct mw_conn {
	__u64 cookie;
	__u64 netns;
	__u64 conn;       /* mw_sock_state.conn */
	__u64 link;       /* mw_sock_state.link: 0 when not accelerated */
	__u32 family;
	__u32 state;      /* TCP state */
	__u32 local_ip[4];
	__u32 remote_ip[4];
	__u32 local_port;
	__u32 remote_port;
	__u32 rule_id;
	__u32 end;
	__u32 fb;         /* MW_FB_* */
	__u32 sock_flags; /* mw_sock_state.flags */
	__u32 owner_tgid; /* who connected or listened (the reader guard's stamp), 0: unknown */
	__u32 reader_tgid;
	struct mw_exe_key exe;
	/* The link, when the socket holds one (link_found). */
	__u32 link_found;
	__u32 link_flags;
	__u32 end_flags;      /* this end's mw_link.end_flags */
	__u32 peer_flags;     /* the other end's */
	__u32 tx_dir_flags;   /* mw_dir.flags of what this end sends */
	__u32 rx_dir_flags;   /* ... and of what it receives */
	__u64 tx_fast_msgs;
	__u64 tx_fast_bytes;
	__u64 rx_fast_bytes;  /* redirected bytes its reader took (one reader: see MW_RD_SHARED) */
	__u64 tx_tcp_bytes;   /* bytes sent on TCP (retransmissions not counted) */
	__u64 rx_tcp_bytes;   /* bytes received on TCP */
	__u32 tx_segs;        /* data segments sent on TCP */
	__u32 rx_segs;
	__u32 unread;         /* redirected bytes waiting in its psock queue */
	__u32 pad;
};

/* Which build loaded the programs (mw_build[0]): the hex id of their
 * objects, written once at load, so that an adopting agent knows whether it
 * runs its own build's programs. Read only by user space. */
#define MW_BUILD_LEN 16
struct mw_build {
	char id[MW_BUILD_LEN];
};

/* Owner of a rule slot: a NUL-padded controller name. */
#define MW_OWNER_LEN 64
struct mw_owner {
	char name[MW_OWNER_LEN];
};

/* Node-wide counters (one slot). */
struct mw_global_stats {
	__u64 established;      /* ESTABLISHED callbacks seen */
	__u64 not_covered;      /* connections no rule covers: left alone */
	__u64 no_state;         /* sk_msg without socket state: passed */
	__u64 no_link;          /* server ends of a covered connection whose client end was not accelerated */
	__u64 no_slot;          /* covered connections left on TCP: no free slot within MW_SLOT_PROBES */
	__u64 slots_stale;      /* slots left to user space to free (an end closed with bytes unread) */
};

/* ---- tc redirection (tcredir.bpf.c) ---- */

/* mw_route.action */
enum mw_route_action {
	MW_ACT_REDIRECT = 1,       /* bpf_redirect to target's egress */
	MW_ACT_REDIRECT_PEER = 2,  /* bpf_redirect_peer into the target veth's peer */
	MW_ACT_REDIRECT_NEIGH = 3, /* bpf_redirect_neigh: kernel fills L2 */
};

/* mw_route.flags */
#define MW_ROUTE_REWRITE_MAC 1u
#define MW_ROUTE_HAS_NEXTHOP 2u
#define MW_ROUTE_HAS_SRC 4u

/* mw_attach_key.dir */
#define MW_DIR_INGRESS 1
#define MW_DIR_EGRESS 2

/* LPM key: attach point first (always fully matched), then the destination.
 * prefixlen = 64 + destination prefix length. */
struct mw_route_key4 {
	__u32 prefixlen;
	__u32 ifindex;
	__u32 dir;
	__u8 dst[4];
};

struct mw_route_key6 {
	__u32 prefixlen;
	__u32 ifindex;
	__u32 dir;
	__u8 dst[16];
};

struct mw_route {
	__u32 id;            /* counter slot */
	__u32 action;
	__u32 target_ifindex;
	__u32 flags;
	__u8 smac[6];
	__u8 dmac[6];
	__u32 src_prefixlen; /* optional source match (MW_ROUTE_HAS_SRC) */
	__u8 src[16];
	__u32 nh_family;     /* MW_AF_INET / MW_AF_INET6 with MW_ROUTE_HAS_NEXTHOP */
	__u8 nh_addr[16];
};

struct mw_route_stats {
	__u64 packets;
	__u64 bytes;
	__u64 redirect_err;  /* helper refused: the packet took the normal path */
};

struct mw_attach_key {
	__u32 ifindex;
	__u32 dir;
};

struct mw_attach_stats {
	__u64 packets;
	__u64 misses;        /* no route matched: TC_ACT_OK */
};

/* ---- plugins (plugin.h for authors, chain.h for the maps) ---- */

/* Plugin ABI offered by this host: a plugin of the same major and an equal or
 * older minor is accepted. */
#define MW_ABI_MAJOR 2
#define MW_ABI_MINOR 0

/* Hooks a plugin attaches to (mw_plugin_abi.hook, chain rows); macros so that
 * plugin.h can select on them with #if. */
#define MW_HOOK_CONNECTION 1 /* sockops: a covered connection is ESTABLISHED */
#define MW_HOOK_MESSAGE 2    /* sk_msg: a message on an accelerated socket */
#define MW_HOOK_PACKET 3     /* tc: a packet on an attached interface */
#define MW_HOOKS 3

/* Verdicts a plugin returns. 1 means, by hook: decline acceleration of the
 * connection / send this message on the normal path / pass the packet
 * unmodified past meshwarp's routes. */
enum mw_verdict {
	MW_CONTINUE = 0,
	MW_DECLINE = 1,
	MW_BYPASS = 1,
	MW_PASS = 1,
	MW_DROP = 2, /* on_message, on_packet only */
};

/* Plugins per hook chain, plugins per node, config bytes per plugin. */
#define MW_CHAIN_MAX 8
#define MW_MAX_PLUGINS 64
#define MW_PLUGIN_CFG_MAX 512
/* Prog-array index of the hook's finisher (the host's own decision), after
 * the two generations of MW_CHAIN_MAX positions. */
#define MW_CHAIN_FIN (2 * MW_CHAIN_MAX)
/* mw_ctx.id when no pair or route matched. */
#define MW_NO_ID 0xffffffffu

/* ELF section ".mw_abi" of a plugin object. */
struct mw_plugin_abi {
	__u16 major;
	__u16 minor;
	__u32 hook;
};

/* One chain position (mw_chain): which plugin runs there, with which config. */
struct mw_chain_pos {
	__u32 plugin_id;  /* 0: empty */
	__u32 cfg_slot;   /* index into mw_plug_cfg */
	__u32 flags;      /* MW_PLUGIN_FAIL_CLOSED */
	__u32 pad;
};

/* mw_chain_pos.flags, mw_plugin_meta.flags */
#define MW_PLUGIN_FAIL_CLOSED 1u

/* A plugin's configuration bytes (mw_plug_cfg, read-only to programs). */
struct mw_plugin_config {
	__u32 len;
	__u8 data[MW_PLUGIN_CFG_MAX];
};

/* Per-plugin counters (one slot per plugin id, per CPU). */
struct mw_plugin_stats {
	__u64 runs;
	__u64 cont;      /* MW_CONTINUE */
	__u64 verdict1;  /* MW_DECLINE / MW_BYPASS / MW_PASS */
	__u64 drop;      /* MW_DROP */
	__u64 invalid;   /* a verdict the hook does not know */
	__u64 missing;   /* its chain slot was empty when reached */
};

/* What user space keeps about a loaded plugin (mw_plug_meta, pinned), so a
 * restarted agent knows its plugins. Programs never read it. */
#define MW_PLUGIN_NAME_LEN 64
#define MW_PLUGIN_VERSION_LEN 32
struct mw_plugin_meta {
	char name[MW_PLUGIN_NAME_LEN];
	char version[MW_PLUGIN_VERSION_LEN];
	__u32 hook;
	__u32 phase;
	__s32 priority;
	__u32 flags;
	__u32 cfg_slot;
	__u32 abi;        /* major << 16 | minor */
	__u8 sha256[32];
	struct mw_owner owner; /* the controller that loaded it */
};

#endif /* MESHWARP_SHARED_H */
