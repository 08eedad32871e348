// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * Socket redirection: sockops pairs the two ends of a covered connection into a
 * link and inserts them into a SOCKMAP, sk_msg moves each message straight
 * into the peer socket's receive queue.
 *
 * Fallback is the law: anything unexpected returns SK_PASS without a redirect,
 * so the message takes the normal TCP path.
 *
 * The reader guard: redirected bytes land in a queue that only recvmsg()
 * reads. On a kernel whose splice() cannot see that queue, whose FIONREAD
 * counts only it, or whose blocked reads of it return EAGAIN when woken
 * without data, redirecting into a socket is only safe if its reader is known
 * not to do those things. Which executable reads a socket is stamped at
 * connect(), and a listener's at listen() by its service (mw_services); user
 * space classifies executables from their ELF (mw_exe_class), and the
 * programs below record what executables are seen doing (mw_exes), and how
 * each reads each service (mw_readers: blocking or not, per executable,
 * network namespace, service port and end):
 *   - sockops decides per end: not accelerated, a sender only, or also a
 *     redirect target; the server end decides for the connection, so both
 *     ends are accelerated or neither;
 *   - tp_btf/sock_recv_length sees blocking and non-blocking reads; an end
 *     whose executable was seen reading its service judged by that record,
 *     one whose service it never read by the executable's;
 *   - tp_btf/sys_enter sees splice(), FIONREAD and sends of urgent data
 *     (MSG_OOB) before the kernel runs them; a splice on a target withdraws
 *     it, and one that finds redirected bytes waiting is a hit: the sender's
 *     next send fails and user space resets the connection (loud, never a
 *     silent truncation); urgent data moves its sender's end to TCP, a hit
 *     alike if its reader has redirected bytes unread;
 *   - cgroup/setsockopt withdraws a target on SO_RCVLOWAT, and both
 *     directions on a ULP (kTLS), refusing the ULP if redirected bytes wait;
 *     it moves an end's sends to TCP on SO_ZEROCOPY, refusing the option on
 *     a socket whose sends run sk_msg (zerocopy_allowed), and withdraws a
 *     target on SO_PEEK_OFF, refusing it if redirected bytes wait;
 *   - iter/tcp (mw_destroy) lets user space reset a hit connection.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "meshwarp/shared.h"
#include "meshwarp/chain.h"
#include "meshwarp/latency.h"

#define TCP_CLOSE_STATE 7 /* enum tcp_state TCP_CLOSE */
#define TCP_ESTABLISHED_STATE 1
#define EPERM 1
#define ENOMEM 12
#define E2BIG 7
#define EEXIST 17
#define EAGAIN 11
#define ENOENT 2
#define EINVAL 22
#define ENOSPC 28
#define O_NONBLOCK 04000
#define MSG_PEEK 0x2
#define MSG_DONTWAIT 0x40
#define MSG_OOB 0x1
#define MSG_ERRQUEUE 0x2000
#define SOL_SOCKET 1
#define SO_RCVLOWAT 18
#define SO_ZEROCOPY 60
#define SO_PEEK_OFF 42
#define EOPNOTSUPP 95
#define SOL_TCP 6
#define TCP_ULP 31
#define FIONREAD 0x541B
#define S_IFMT 00170000
#define S_IFSOCK 0140000
#define PAGE_SIZE 4096
#define SK_USER_DATA_FLAGS 7UL

enum level { LV_NONE = 0, LV_SEND = 1, LV_FULL = 2 };

/* Syscall numbers of this architecture, set by user space before load. */
const volatile __u32 nr_splice = 0;
const volatile __u32 nr_ioctl = 0;
const volatile __u32 nr_sendto = 0;
const volatile __u32 nr_sendmsg = 0;
const volatile __u32 nr_sendmmsg = 0;
/* Never read: keep struct mw_event and mw_conn in the object's BTF, where the layout
 * test of its Rust mirror finds it. */
const volatile struct mw_event mw_event_btf __attribute__((used)) = {};
const volatile struct mw_conn mw_conn_btf __attribute__((used)) = {};

extern void *bpf_rdonly_cast(const void *obj, __u32 btf_id) __ksym __weak;
extern int bpf_sock_destroy(struct sock_common *sk) __ksym __weak;

/* mw_sock_state.slot of an observe-only client end (its link is in mw_observe). */
#define MW_NO_SLOT 0xffffffffu

/* Entries of mw_slots, set by user space before load (mw_sockmap has twice
 * as many: one per end). */
const volatile __u32 nr_slots = 1;

/* Sizes are placeholders: user space sets max_entries before load. */
MW_MAP(mw_sockmap, BPF_MAP_TYPE_SOCKMAP, __u32, __u64, 65536, 0);
/* The same positions for targets whose own sends are never redirected
 * (MW_EF_TGTMAP): no program is attached, so their sends take tcp_prot's
 * path, where a socket in mw_sockmap would run sk_msg on every one only to
 * hear that its peer is no target. */
MW_MAP(mw_tgtmap, BPF_MAP_TYPE_SOCKMAP, __u32, __u64, 65536, 0);

/* Which link owns each pair of SOCKMAP entries (struct mw_slot). */
MW_MAP(mw_slots, BPF_MAP_TYPE_ARRAY, __u32, struct mw_slot, 32768, 0);

MW_MAP(mw_pairs, BPF_MAP_TYPE_HASH, struct mw_pair_key, struct mw_rule, 16384, BPF_F_NO_PREALLOC);

MW_MAP(mw_capture, BPF_MAP_TYPE_HASH, struct mw_capture_key, struct mw_rule, 16384, BPF_F_NO_PREALLOC);

/* Links, indexed by their slot (as many as mw_slots); mw_link.id says which
 * link an element holds (0: none). */
MW_MAP(mw_links, BPF_MAP_TYPE_ARRAY, __u32, struct mw_link, 32768, 0);

/* Socket cookie -> link and end, for programs that only hold a file. */
MW_MAP(mw_cookies, BPF_MAP_TYPE_HASH, __u64, struct mw_cookie_val, 65536, 0);

/* Links whose client end is not accelerated (MW_LINK_OBSERVE): the server
 * end only learns who reads it. Kept apart from the slots, which they would
 * hold for a whole connection whose server is elsewhere; LRU, so such links
 * never fill it for good. */
MW_MAP(mw_observe, BPF_MAP_TYPE_LRU_HASH, __u64, struct mw_link, 65536, 0);

MW_DEFINE_SK_STATE_MAP();
MW_DEFINE_SK_CHAIN_MAP();

MW_MAP(mw_exes, BPF_MAP_TYPE_HASH, struct mw_exe_key, struct mw_exe, 4096, 0);

MW_MAP(mw_exe_class, BPF_MAP_TYPE_HASH, struct mw_exe_key, struct mw_exe_class, 4096, BPF_F_NO_PREALLOC);

/* A listener's program by its service (network namespace, port, family):
 * written at listen() (stamp_listener), and by the reads of a server end
 * whose listener predates meshwarp. LRU: an evicted one is learned again
 * from the reads. */
MW_MAP(mw_services, BPF_MAP_TYPE_LRU_HASH, struct mw_service_key, struct mw_service, 4096, 0);

/* MW_EXE_SEEN_BLOCKING / _NONBLOCKING per executable and service: where an
 * entry exists it judges the blocking reader in place of the executable's
 * own flags (decide_end). LRU: an evicted entry only falls back to them. */
MW_MAP(mw_readers, BPF_MAP_TYPE_LRU_HASH, struct mw_reader_key, __u32, 16384, 0);

/* TCP Fast Open server ends to join mw_sockmap (struct mw_join). LRU: an
 * entry evicted before it was served leaves its end out until its client's
 * next send asks (MW_DIR_QUIET). */
MW_MAP(mw_joins, BPF_MAP_TYPE_LRU_HASH, __u64, struct mw_join, 16384, 0);
MW_MAP(mw_ports, BPF_MAP_TYPE_ARRAY, __u32, struct mw_ports, 1, 0);

MW_MAP(mw_config, BPF_MAP_TYPE_ARRAY, __u32, struct mw_config, 1, 0);

/*
 * Listeners whose last accepted end was no target, as their clients see them
 * (the client's network namespace, the server address of the link): a new
 * client end of such a listener sends nothing that can be redirected, so it
 * joins mw_tgtmap at once and no sk_msg runs on its sends. Only the server
 * end knows, and it comes after the client end is in a SOCKMAP (moving a
 * socket between SOCKMAPs later keeps its sk_msg while any thread holds the
 * psock). Written by server ends: removed when one is a target again, so a
 * stale hint costs one connection its client-to-server redirects. LRU: never
 * full for good.
 */
struct mw_srv_key {
	__u64 netns;
	__u32 ip[4];
	__u32 port;
	__u32 family;
};

/* What decided it (MW_CFG_HINT bits of mw_config): a hint made under other
 * settings is not used. */
struct mw_srv_hint {
	__u32 cfg;
	__u32 reason;
};

#define MW_CFG_HINT (MW_CFG_GUARD | MW_CFG_SPLICE_BLIND | MW_CFG_FIONREAD_PSOCK | MW_CFG_BLOCKING_EAGAIN | MW_CFG_SYSCALL_WATCH)

MW_MAP(mw_srv_hint, BPF_MAP_TYPE_LRU_HASH, struct mw_srv_key, struct mw_srv_hint, 4096, 0);

/* Cookies of sockets user space asked mw_destroy to reset. */
MW_MAP(mw_doomed, BPF_MAP_TYPE_HASH, __u64, __u32, 1024, 0);

/* Sockets user space asked mw_park to put back into the SOCKMAP (keyed by
 * cookie; the iterator writes the result). */
MW_MAP(mw_park_req, BPF_MAP_TYPE_HASH, __u64, struct mw_park_req, 1024, 0);

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 256 * 1024);
} mw_events SEC(".maps");

/* Plugin chains of on_connection (sockops) and on_message (sk_msg). */
MW_DEFINE_CHAIN_PROGS(mw_ch_conn);
MW_DEFINE_CHAIN_PROGS(mw_ch_msg);

/* Plugin metadata and the grace-period map (chain.h). */
MW_DEFINE_HOST_PLUGIN_MAPS();

MW_MAP(mw_stats, BPF_MAP_TYPE_PERCPU_ARRAY, __u32, struct mw_rule_stats, 16384, 0);

MW_MAP(mw_global, BPF_MAP_TYPE_PERCPU_ARRAY, __u32, struct mw_global_stats, 1, 0);

/* Whether each rule's connections are short (struct mw_short; sized as
 * mw_stats). One element per rule shared by every CPU: a connection's
 * close on one CPU judges the next connect() on another. */
MW_MAP(mw_short, BPF_MAP_TYPE_ARRAY, __u32, struct mw_short, 16384, 0);

/* Room to build a link in (too large for the sockops stack with the rest). */
MW_MAP(mw_scratch, BPF_MAP_TYPE_PERCPU_ARRAY, __u32, struct mw_link, 1, 0);

/* Owner (controller name) of each rule slot. Read only by user space; pinned
 * with the data path so a restarted agent keeps ownership. */
MW_MAP(mw_owners, BPF_MAP_TYPE_HASH, __u32, struct mw_owner, 16384, BPF_F_NO_PREALLOC);

/* The build that loaded these programs (struct mw_build, shared.h). */
MW_MAP(mw_build, BPF_MAP_TYPE_ARRAY, __u32, struct mw_build, 1, 0);

/* ---- the latency monitor (shared.h) ---- */

/* Per rule id: when the monitor was switched on for it, 0 while off (sized
 * as mw_stats). */
MW_MAP(mw_lat_rule, BPF_MAP_TYPE_ARRAY, __u32, __u64, 16384, 0);
/* Histograms of rules below MW_LAT_ROWS, at rule_id * MW_LAT_ROW_METRICS +
 * metric - 1: an index, no hashing per sample (sized at load, at most
 * MW_LAT_ROWS rows). */
MW_MAP(mw_lat_rows, BPF_MAP_TYPE_PERCPU_ARRAY, __u32, struct mw_lat_hist, MW_LAT_ROWS * MW_LAT_ROW_METRICS, 0);
/* The other rules' histograms and every hop's; not preallocated: only rules
 * the monitor ran for take room. */
MW_MAP(mw_lat_hist, BPF_MAP_TYPE_PERCPU_HASH, struct mw_lat_key, struct mw_lat_hist, 16384, BPF_F_NO_PREALLOC);
/* Never written: the zeroes a new histogram starts from (too large for the stack). */
MW_MAP(mw_lat_zero, BPF_MAP_TYPE_ARRAY, __u32, struct mw_lat_hist, 1, 0);
/* The oldest unread send of each direction: for accelerated links by
 * SOCKMAP position (2 * slot + sending end, sized as mw_sockmap: an index,
 * no hashing on the fast path), for the others by connection id. */
MW_MAP(mw_lat_slot, BPF_MAP_TYPE_ARRAY, __u32, __u64, 65536, 0);
MW_MAP(mw_lat_pend, BPF_MAP_TYPE_LRU_HASH, struct mw_lat_pend_key, __u64, 65536, 0);

/* Each thread's last read of a covered socket: task storage, found through
 * the task itself (no hashing per message) and gone with the thread, where
 * sk_msg may use it (Linux 6.15 on; probed at load, mw_task_storage); else
 * an LRU hash by thread id (gone threads age out). */
const volatile bool mw_task_storage = false;
struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct mw_lat_thread);
} mw_lat_thr SEC(".maps");
MW_MAP(mw_lat_thrh, BPF_MAP_TYPE_LRU_HASH, __u32, struct mw_lat_thread, 16384, 0);

/* When a client socket called connect() (ns), while the monitor runs. */
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, __u64);
} mw_sk_conn SEC(".maps");

struct tuple {
	__u32 family;
	__u32 local_ip[4];
	__u32 remote_ip[4];
	__u32 local_port;
	__u32 remote_port;
};

static __always_inline struct mw_global_stats *global_stats(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&mw_global, &zero);
}

static __always_inline struct mw_rule_stats *rule_stats(__u32 id)
{
	return bpf_map_lookup_elem(&mw_stats, &id);
}

static __always_inline __u32 config_flags(void)
{
	__u32 zero = 0;
	struct mw_config *c = bpf_map_lookup_elem(&mw_config, &zero);

	return c ? c->flags : 0;
}

/* When the monitor was switched on for `rule_id` (0: it is off); `every`
 * (if not NULL) says whether it measures every message, from the same
 * lookup. */
static __always_inline __u64 lat_since(__u32 rule_id, bool *every)
{
	__u32 zero = 0;
	struct mw_config *c = bpf_map_lookup_elem(&mw_config, &zero);
	__u64 *on;

	if (!c || !(c->flags & MW_CFG_LATENCY))
		return 0;
	if (every)
		*every = c->flags & MW_CFG_LAT_EVERY;
	if (c->flags & MW_CFG_LAT_ALL)
		return c->lat_since;
	on = bpf_map_lookup_elem(&mw_lat_rule, &rule_id);
	return on ? *on : 0;
}

static __always_inline void lat_record(__u32 rule_id, __u32 metric, __u32 from, __u64 ns)
{
	struct mw_lat_key k = { .rule_id = rule_id, .metric = metric, .from_rule = from };
	struct mw_lat_hist *h = NULL;
	__u32 row;

	if (metric != MW_LAT_HOP && rule_id < MW_LAT_ROWS) {
		row = rule_id * MW_LAT_ROW_METRICS + metric - 1;
		h = bpf_map_lookup_elem(&mw_lat_rows, &row);
	}
	if (!h)
		h = mw_hist_of(&mw_lat_hist, &mw_lat_zero, &k);
	if (h)
		mw_hist_add(h, ns);
}

static __always_inline void copy_ip(__u32 *dst, const __u32 *src)
{
	dst[0] = src[0];
	dst[1] = src[1];
	dst[2] = src[2];
	dst[3] = src[3];
}

static __always_inline bool ip_eq(const __u32 *a, const __u32 *b)
{
	return ((a[0] ^ b[0]) | (a[1] ^ b[1]) | (a[2] ^ b[2]) | (a[3] ^ b[3])) == 0;
}

/* Reads the socket's tuple; an IPv4-mapped IPv6 socket is reported as IPv4 so
 * that both ends of a dual-stack connection build the same keys. Every context
 * field is read unconditionally: the verifier rejects loads through a context
 * pointer that clang merged across branches. */
static __always_inline bool load_tuple(struct bpf_sock_ops *skops, struct tuple *t)
{
	__u32 family = skops->family;
	__u32 l4 = skops->local_ip4, r4 = skops->remote_ip4;
	__u32 l0 = skops->local_ip6[0], l1 = skops->local_ip6[1];
	__u32 l2 = skops->local_ip6[2], l3 = skops->local_ip6[3];
	__u32 r0 = skops->remote_ip6[0], r1 = skops->remote_ip6[1];
	__u32 r2 = skops->remote_ip6[2], r3 = skops->remote_ip6[3];

	__builtin_memset(t, 0, sizeof(*t));
	t->local_port = skops->local_port;
	t->remote_port = bpf_ntohl(skops->remote_port);
	if (family == MW_AF_INET) {
		t->family = MW_AF_INET;
		t->local_ip[0] = l4;
		t->remote_ip[0] = r4;
		return true;
	}
	if (family != MW_AF_INET6)
		return false;
	if (l0 == 0 && l1 == 0 && l2 == bpf_htonl(0xffff)) {
		t->family = MW_AF_INET;
		t->local_ip[0] = l3;
		t->remote_ip[0] = r3;
		return true;
	}
	t->family = MW_AF_INET6;
	t->local_ip[0] = l0;
	t->local_ip[1] = l1;
	t->local_ip[2] = l2;
	t->local_ip[3] = l3;
	t->remote_ip[0] = r0;
	t->remote_ip[1] = r1;
	t->remote_ip[2] = r2;
	t->remote_ip[3] = r3;
	return true;
}

/* ---- rules ---- */

/* Covered by a mirror pair: the client is the active end's local address. */
static __always_inline struct mw_rule *match_pair(const struct tuple *t, bool active)
{
	struct mw_pair_key pk = {};

	pk.family = t->family;
	if (active) {
		copy_ip(pk.client_ip, t->local_ip);
		copy_ip(pk.server_ip, t->remote_ip);
		pk.server_port = t->remote_port;
	} else {
		copy_ip(pk.client_ip, t->remote_ip);
		copy_ip(pk.server_ip, t->local_ip);
		pk.server_port = t->local_port;
	}
	return bpf_map_lookup_elem(&mw_pairs, &pk);
}

static __always_inline struct mw_rule *match_capture(const struct tuple *t)
{
	struct mw_capture_key ck = {};
	struct mw_rule *rule;

	ck.family = t->family;
	copy_ip(ck.client_ip, t->local_ip);
	copy_ip(ck.dst_ip, t->remote_ip);
	ck.dst_port = t->remote_port;
	rule = bpf_map_lookup_elem(&mw_capture, &ck);
	if (rule)
		return rule;
	/* Rule for any client of this destination. */
	__builtin_memset(ck.client_ip, 0, sizeof(ck.client_ip));
	return bpf_map_lookup_elem(&mw_capture, &ck);
}

/* The rule covering an active end (pair first, then capture), and its kind. */
static __always_inline struct mw_rule *match_active(const struct tuple *t, __u32 *kind)
{
	struct mw_rule *rule = match_pair(t, true);

	if (rule) {
		*kind = MW_LINK_MIRROR;
		return rule;
	}
	*kind = MW_LINK_CAPTURE;
	return match_capture(t);
}

/* Whether some rule may cover a connection to server port `port` (host
 * order): its bit in mw_ports, or any port while user space keeps no set. */
static __always_inline bool port_maybe_covered(__u32 port)
{
	__u32 zero = 0;
	struct mw_ports *p = bpf_map_lookup_elem(&mw_ports, &zero);

	if (!p || !(p->bits[0] & 1))
		return true;
	port &= 0xffff;
	return (p->bits[port >> 6] >> (port & 63)) & 1;
}

/* ---- short connections (struct mw_short) ---- */

/* Neither mode always nor mode never: the policy decides. */
static __always_inline bool rule_adaptive(const struct mw_rule *rule)
{
	return !(rule->flags & (MW_RULE_MODE_ALWAYS | MW_RULE_MODE_NEVER));
}

/* Whether a run's last short connection closed MW_SHORT_FOR before `now`
 * (`last` may be a moment ahead, written on another CPU). */
static __always_inline bool run_over(const struct mw_short *s, __u64 now)
{
	return now > s->last && now - s->last > MW_SHORT_FOR;
}

/* An adaptive rule's element while its connections are judged short: a
 * run of MW_SHORT_AFTER or more, the last of them closed within
 * MW_SHORT_FOR (an older run is over: its score starts again). */
static __always_inline struct mw_short *rule_short(const struct mw_rule *rule)
{
	struct mw_short *s;

	if (!rule_adaptive(rule))
		return NULL;
	s = bpf_map_lookup_elem(&mw_short, &rule->id);
	if (!s || s->score < MW_SHORT_AFTER)
		return NULL;
	if (run_over(s, bpf_ktime_get_ns())) {
		s->score = 0;
		return NULL;
	}
	return s;
}

/* Whether a new connection of `rule` stays on TCP because the rule's
 * connections are short (counted); every MW_SHORT_PROBE-th is a probe and
 * covered. Asked once per connection: at connect() when the reader guard
 * stamps owners there (a connection left out gets no stamp, which its
 * handshake then sees), else at the client's handshake. */
static __always_inline bool short_skip(const struct mw_rule *rule, bool may_probe)
{
	struct mw_short *s = rule_short(rule);
	struct mw_rule_stats *rs;
	__u32 n;

	if (!s)
		return false;
	n = __sync_fetch_and_add(&s->seen, 1);
	if (may_probe && n % MW_SHORT_PROBE == 0)
		return false;
	rs = rule_stats(rule->id);
	if (rs)
		rs->fb_short++;
	return true;
}

/* An end redirected enough for its connection to pay for its handshake:
 * its rule's run of short connections ends now, not at its close (a long
 * connection may outlive many short ones), and again every
 * MW_SHORT_AGAIN messages, so that a rule with busy long connections never
 * leaves new ones out, whatever short ones it also has. */
static __always_inline void conn_long(struct mw_link *link)
{
	struct mw_short *s;

	if (!(link->flags & MW_LINK_LONG))
		__sync_fetch_and_or(&link->flags, MW_LINK_LONG);
	s = bpf_map_lookup_elem(&mw_short, &link->rule_id);
	if (s && s->score)
		s->score = 0;
}

/* A connection closed (its link dropped, once) without being long: one
 * more short one in a row for its rule, if both ends joined (a connection
 * whose server end never did, or that another one's id poisoned, says
 * nothing of its length). Mode always never skips, so its connections do
 * not count. */
static __always_inline void conn_short(const struct mw_link *link)
{
	struct mw_short *s;
	__u64 now;

	if ((link->flags & (MW_LINK_LONG | MW_LINK_FIXED | MW_LINK_POISONED)) || !(link->flags & MW_LINK_CLAIMED) ||
	    !(link->end_flags[MW_END_SERVER] & MW_EF_PSOCK))
		return;
	s = bpf_map_lookup_elem(&mw_short, &link->rule_id);
	if (!s)
		return;
	/* A run is of short connections closing within MW_SHORT_FOR of
	 * each other. */
	now = bpf_ktime_get_ns();
	if (run_over(s, now))
		s->score = 0;
	s->last = now;
	if (s->score < MW_SHORT_MAX)
		__sync_fetch_and_add(&s->score, 1);
}

/* ---- who reads a socket ---- */

/* The current task's executable (false for kernel threads). */
static __always_inline bool current_exe(struct mw_exe_key *k)
{
	struct task_struct *task = bpf_get_current_task_btf();
	struct mm_struct *mm;
	struct file *exe;
	struct inode *inode;

	mm = task->mm;
	if (!mm)
		return false;
	exe = mm->exe_file;
	if (!exe)
		return false;
	inode = exe->f_inode;
	if (!inode)
		return false;
	k->ino = inode->i_ino;
	k->dev = inode->i_sb->s_dev;
	return true;
}

/* The file flags (O_NONBLOCK...) of the file a socket belongs to; 0 if none. */
static __always_inline __u32 sock_file_flags(struct sock *sk)
{
	struct socket *sock = sk->sk_socket;
	struct file *file;

	if (!sock)
		return 0;
	file = sock->file;
	if (!file)
		return 0;
	return file->f_flags;
}

static __always_inline void emit(struct mw_event *ev)
{
	bpf_ringbuf_output(&mw_events, ev, sizeof(*ev), 0);
}

static __always_inline void fill_event_link(struct mw_event *ev, const struct mw_link *link)
{
	ev->rule_id = link->rule_id;
	ev->family = link->family;
	ev->client_port = link->client_port;
	ev->server_port = link->server_port;
	copy_ip(ev->client_ip, link->client_ip);
	copy_ip(ev->server_ip, link->server_ip);
}

/* Asks user space to unlink (mw_unlink) or relink (mw_park) one end of a
 * link; false if the ring buffer is full (ask again later). */
static __always_inline bool request_park(__u32 type, const struct mw_link *link, __u64 id, __u32 end)
{
	struct mw_event *ev = bpf_ringbuf_reserve(&mw_events, sizeof(*ev), 0);
	__u64 pid_tgid = bpf_get_current_pid_tgid();

	if (!ev)
		return false;
	__builtin_memset(ev, 0, sizeof(*ev));
	ev->type = type;
	ev->pid = (__u32)pid_tgid;
	ev->tgid = pid_tgid >> 32;
	ev->link = id;
	ev->end = end & 1;
	ev->cookie = link->cookie[end & 1];
	ev->peer_cookie = link->cookie[(end ^ 1) & 1];
	ev->netns = link->netns[end & 1];
	fill_event_link(ev, link);
	bpf_ringbuf_submit(ev, 0);
	return true;
}

/* Asks once for end `end` of link `id`, out of the SOCKMAP, to be put back
 * (mw_park, MW_PARK_RELINK): its peer talked again. */
static __always_inline void ask_relink(struct mw_link *link, __u64 id, __u32 end)
{
	end &= 1;
	if (link->dir[end].flags & MW_DIR_STREAMED)
		return;
	if ((link->dir[end].flags & (MW_DIR_UNLINKED | MW_DIR_RELINK_REQ)) == MW_DIR_UNLINKED &&
	    !(__sync_fetch_and_or(&link->dir[end].flags, MW_DIR_RELINK_REQ) & MW_DIR_RELINK_REQ)) {
		if (!request_park(MW_EV_RELINK, link, id, end))
			__sync_fetch_and_and(&link->dir[end].flags, ~MW_DIR_RELINK_REQ);
	} else if ((link->dir[end].flags & MW_DIR_QUIET) &&
		   (__sync_fetch_and_and(&link->dir[end].flags, ~MW_DIR_QUIET) & MW_DIR_QUIET)) {
		/* Asked quietly (mw_joins) and still out: now with a wake-up
		 * (user space folds it into the queued request). The quiet
		 * request stays, served later by a walk of its own: taking it
		 * back here let 2 of 28 runs of the Fast Open compat test need
		 * hundreds of wake-ups (benches/README.md, 2026-12-03). */
		request_park(MW_EV_RELINK, link, id, end);
	}
}

/* A TCP Fast Open server end's first join, asked in mw_joins, not by an
 * event (see struct mw_join). Not asked (the map refused): its client's next
 * send asks. */
static __always_inline void ask_join_quietly(struct mw_link *link, __u32 end)
{
	struct mw_join j = {};
	__u64 cookie;

	end &= 1;
	if (__sync_fetch_and_or(&link->dir[end].flags, MW_DIR_RELINK_REQ) & MW_DIR_RELINK_REQ)
		return;
	__sync_fetch_and_or(&link->dir[end].flags, MW_DIR_QUIET);
	cookie = link->cookie[end];
	j.netns = link->netns[end];
	j.tid = (__u32)bpf_get_current_pid_tgid();
	if (bpf_map_update_elem(&mw_joins, &cookie, &j, BPF_ANY))
		__sync_fetch_and_and(&link->dir[end].flags, ~(MW_DIR_RELINK_REQ | MW_DIR_QUIET));
}

/* A park user space could not be asked to serve (the ring buffer full) is
 * undone under MW_DIR_UNLINKING: a rescan's mw_unlink, which sees
 * MW_DIR_UNLINK_REQ, could otherwise delete the entry between the two
 * clears and leave the end out of the SOCKMAP but not parked, and its peer
 * asks to put back only a parked end. If mw_unlink is at it, its outcome
 * stands (it unparks on anything but a delete or a close; after a delete, a
 * move, MW_DIR_MOVE, goes on). */
static __always_inline void unpark_unserved(struct mw_link *link, __u32 end)
{
	__u32 old;

	end &= 1;
	old = __sync_fetch_and_or(&link->dir[end].flags, MW_DIR_UNLINKING);
	if (old & MW_DIR_UNLINKING)
		return;
	if (!(old & MW_DIR_UNLINKED)) {
		__sync_fetch_and_and(&link->dir[end].flags, ~(MW_DIR_UNLINK_REQ | MW_DIR_MOVE));
		__sync_fetch_and_and(&link->end_flags[end], ~MW_EF_PARKED);
	}
	__sync_fetch_and_and(&link->dir[end].flags, ~MW_DIR_UNLINKING);
}

/* Asks user space to classify an executable: once per process that runs
 * it until one is classified. User space reads the ELF and the libraries
 * through /proc/<tgid>, so a process that exited before the ask was served
 * (curl, one per request) leaves it unanswered, and the next process asks
 * again. An entry made by exe_seen, never asked about, asks too. */
static __always_inline void request_classify(const struct mw_exe_key *k, __u32 tgid)
{
	struct mw_exe e = {};
	struct mw_event ev = {};
	struct mw_exe *old;

	e.flags = MW_EXE_PENDING;
	e.tgid = tgid;
	bpf_get_current_comm(e.comm, sizeof(e.comm));
	if (bpf_map_update_elem(&mw_exes, k, &e, BPF_NOEXIST)) {
		old = bpf_map_lookup_elem(&mw_exes, k);
		if (!old || (old->tgid == tgid && (old->flags & MW_EXE_PENDING)))
			return;
		/* Racing askers of one new process may both ask: harmless. */
		old->tgid = tgid;
		__sync_fetch_and_or(&old->flags, MW_EXE_PENDING);
	}
	ev.type = MW_EV_CLASSIFY;
	ev.tgid = tgid;
	ev.exe = *k;
	emit(&ev);
}

/* Records that an executable did something (MW_EXE_SEEN_*). */
static __always_inline void exe_seen(const struct mw_exe_key *k, __u32 bit)
{
	struct mw_exe *e = bpf_map_lookup_elem(&mw_exes, k);
	struct mw_exe fresh = {};

	if (e) {
		if (!(e->flags & bit))
			__sync_fetch_and_or(&e->flags, bit);
		return;
	}
	fresh.flags = bit;
	fresh.tgid = bpf_get_current_pid_tgid() >> 32;
	bpf_get_current_comm(fresh.comm, sizeof(fresh.comm));
	bpf_map_update_elem(&mw_exes, k, &fresh, BPF_NOEXIST);
	e = bpf_map_lookup_elem(&mw_exes, k);
	if (e && !(e->flags & bit))
		__sync_fetch_and_or(&e->flags, bit);
}

/* Stamps the socket with the executable of the task calling connect(), and
 * asks for its classification. */
static __always_inline void stamp_owner(struct bpf_sock_ops *skops)
{
	struct bpf_sock *sk = skops->sk;
	struct mw_sock_state *st;
	struct mw_sock_owner *o;
	struct mw_exe_key k = {};

	if (!sk || !current_exe(&k))
		return;
	st = bpf_sk_storage_get(&mw_sk_state, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!st)
		return;
	o = &st->own;
	o->exe = k;
	o->tgid = bpf_get_current_pid_tgid() >> 32;
	o->flags = MW_OWN_KNOWN | (o->flags & (MW_OWN_ZEROCOPY | MW_OWN_PEEK_OFF));
	if (!bpf_map_lookup_elem(&mw_exe_class, &k))
		request_classify(&k, o->tgid);
}

/* The service (mw_services key) a sockops socket listens on or was
 * accepted on: its network namespace, local port and family. */
static __always_inline void service_of(struct bpf_sock_ops *skops, struct mw_service_key *svc)
{
	svc->netns = bpf_get_netns_cookie(skops);
	svc->port = skops->local_port;
	svc->family = skops->family;
}

/* Another listen() on a service (tgid), or the reads of one of its ends
 * (tgid 0): the same program keeps the entry (a listener's process
 * replaces a reader's), another marks it mixed, for good. */
static __always_inline void service_heard(struct mw_service *had, const struct mw_exe_key *exe, __u32 tgid)
{
	if (had->flags & MW_SVC_MIXED)
		return;
	if (had->exe.dev != exe->dev || had->exe.ino != exe->ino) {
		__sync_fetch_and_or(&had->flags, MW_SVC_MIXED);
		return;
	}
	if (tgid) {
		had->tgid = tgid;
		if (had->flags & MW_SVC_LEARNED)
			__sync_fetch_and_and(&had->flags, ~MW_SVC_LEARNED);
	}
}

/* listen(): the listener's program goes to mw_services, where its
 * accepted ends find it at their handshake (decide_end, which copies it
 * into a covered end's element) and connect() its hint (listener_hint).
 * A listener carries no element (listen() deletes one, drop_sock_state), and
 * mw_sk_state is not BPF_F_CLONE: every socket a stamped listener accepted
 * cloned its element, an allocation, a memcg charge and an RCU free (3-4%
 * of a short connection's time, benches/README.md), whether its
 * connection was covered or not (a port no rule names, a connection its
 * rule leaves out as short). The key has no address:
 * another program listening on the port (another address, a SO_REUSEPORT
 * group, or a new binary after a restart) marks it mixed, and no end of
 * it is accelerated (MW_SVC_MIXED): a wrong program is never guessed. */
static __always_inline void stamp_listener(struct bpf_sock_ops *skops)
{
	struct mw_service_key svc = {};
	struct mw_service v = {};
	struct mw_service *had;

	if (!current_exe(&v.exe))
		return;
	v.tgid = bpf_get_current_pid_tgid() >> 32;
	service_of(skops, &svc);
	if (!bpf_map_lookup_elem(&mw_exe_class, &v.exe))
		request_classify(&v.exe, v.tgid);
	had = bpf_map_lookup_elem(&mw_services, &svc);
	/* Two listen()s at once: the one that lost the insert compares. */
	if (!had && !bpf_map_update_elem(&mw_services, &svc, &v, BPF_NOEXIST))
		return;
	had = had ?: bpf_map_lookup_elem(&mw_services, &svc);
	if (had)
		service_heard(had, &v.exe, v.tgid);
}

/* Clears a socket's element down to its owner (no MW_SOCK_END). */
static __always_inline void state_clear(struct mw_sock_state *st)
{
	struct mw_sock_owner own = st->own;

	__builtin_memset(st, 0, sizeof(*st));
	st->own = own;
}

/* listen(): listeners carry no element (their program is kept by their
 * service), so one made before (setsockopt marks, a connect() of the
 * socket before connect(AF_UNSPEC) disconnected it) goes. */
static __always_inline void drop_sock_state(struct bpf_sock *sk)
{
	if (sk)
		bpf_sk_storage_delete(&mw_sk_state, sk);
}

/* Whether a reader of executable class `cls` (flags seen `sflags`) may
 * splice: seen splicing, or able to (its ELF) and not trusted. */
static __always_inline bool exe_may_splice(__u32 cls, __u32 sflags)
{
	return (sflags & MW_EXE_SEEN_SPLICE) || ((cls & (MW_EXE_SPLICE | MW_EXE_OPAQUE)) && !(cls & MW_EXE_TRUSTED));
}

/* No on_message plugin is loaded: an end may sit where no sk_msg runs
 * (mw_tgtmap). With plugins, every end's sends keep running the chain, as
 * the hook promises; ends placed before a plugin is loaded are not moved. */
static __always_inline bool no_msg_chain(void)
{
	__u32 gen;

	return !mw_active_chain(MW_HOOK_MESSAGE, &gen);
}

/* How far one end may be accelerated. *why gets the mw_rule_stats reason
 * bit for what held it back (MW_EF_R_* for a refused target). */
struct end_decision {
	int level;
	__u32 reason;       /* MW_EF_R_* when not a target */
	bool reader;        /* NONE because of the reader (unknown, blocking) */
	bool fionread;      /* a target whose reader FIONREAD would miscount (MW_EF_FIONREAD) */
	__u32 nosend;       /* why its sends stay on TCP (MW_EF_NOSEND): MW_EXE_SEEN_URGENT, _ZEROCOPY */
	bool zc_none;       /* NONE: SO_ZEROCOPY with an on_message plugin (zerocopy_decided) */
	bool chain;         /* an on_message plugin is loaded: no end joins mw_tgtmap (read once) */
	struct mw_exe_key exe;
};

/* An end with SO_ZEROCOPY on must send by plain tcp_sendmsg: tcp_bpf
 * copies a send into sk_msg pages and pushes it one page run at a time, and
 * each push would count as a zero-copy send of its own (the completions'
 * ids run ahead of the application's count). Out of mw_sockmap it is, in
 * mw_tgtmap (a target only) or not accelerated; with an on_message plugin,
 * whose chain must see every send of an accelerated end, not accelerated. */
static __always_inline void zerocopy_decided(struct end_decision *d)
{
	if ((d->nosend & MW_EXE_SEEN_ZEROCOPY) && d->chain && d->level != LV_NONE) {
		d->level = LV_NONE;
		d->zc_none = true;
	}
}

static __always_inline void decide_end(struct bpf_sock_ops *skops, struct tcp_sock *tp, bool active,
				       __u32 rule_flags, __u32 cfg, struct mw_sock_state *st,
				       struct end_decision *d)
{
	struct sock *s = &tp->inet_conn.icsk_inet.sk;
	struct mw_sock_owner *o;
	struct mw_exe_class *cls;
	struct mw_exe *seen;
	struct mw_service *learned;
	struct mw_service_key svc = {};
	__u32 sflags = 0, eflags;
	bool trusted, target = true;

	d->level = LV_NONE;
	d->reason = 0;
	d->reader = false;
	d->fionread = false;
	d->nosend = 0;
	d->zc_none = false;
	d->chain = !no_msg_chain();
	/* st's element: made at connect() or at the handshake. */
	o = &st->own;
	/* Set before connect() or accept() (the listener's), or set while
	 * connect() was in progress (MW_OWN_ZEROCOPY). */
	if ((s->__sk_common.skc_flags & (1UL << SOCK_ZEROCOPY)) || (active && (o->flags & MW_OWN_ZEROCOPY)))
		d->nosend = MW_EXE_SEEN_ZEROCOPY;
	if (s->sk_rcvlowat > 1) {
		target = false;
		d->reason = MW_EF_R_LOWAT;
	}
	/* The same for a peek offset (see peek_off_allowed). */
	if (s->sk_peek_off >= 0 || (active && (o->flags & MW_OWN_PEEK_OFF))) {
		target = false;
		d->reason = MW_EF_R_PEEKOFF;
	}
	if (rule_flags & (active ? MW_RULE_NO_TARGET_CLIENT : MW_RULE_NO_TARGET_SERVER)) {
		target = false;
		d->reason = MW_EF_R_RULE;
	}
	if (!(cfg & MW_CFG_GUARD)) {
		d->level = target ? LV_FULL : LV_SEND;
		zerocopy_decided(d);
		return;
	}

	if (o->flags & MW_OWN_KNOWN) {
		d->exe = o->exe;
	} else if (!active) {
		/* Its listener's program (stamp_listener), or, for one that
		 * predates meshwarp, what its readers were: this end's owner
		 * from now on (the connection list names it). */
		service_of(skops, &svc);
		learned = bpf_map_lookup_elem(&mw_services, &svc);
		if (!learned || (learned->flags & MW_SVC_MIXED)) {
			if (!learned)
				st->learn = MW_LEARN | svc.port;
			d->reader = true;
			return;
		}
		d->exe = learned->exe;
		/* A listener's program and process: this end's owner (the
		 * connection list names it). One learned from reads names no
		 * process: its reads will. */
		if (!(learned->flags & MW_SVC_LEARNED)) {
			o->exe = learned->exe;
			o->tgid = learned->tgid;
			o->flags |= MW_OWN_KNOWN;
		}
	} else {
		d->reader = true;
		return;
	}
	cls = bpf_map_lookup_elem(&mw_exe_class, &d->exe);
	if (!cls || !(cls->flags & MW_EXE_CLASSIFIED)) {
		if (o->flags & MW_OWN_KNOWN)
			request_classify(&d->exe, o->tgid);
		d->reader = true;
		return;
	}
	seen = bpf_map_lookup_elem(&mw_exes, &d->exe);
	if (seen)
		sflags = seen->flags;
	eflags = cls->flags | sflags;
	/* Urgent data exists only on the TCP path (see on_urgent_send), and
	 * zero-copy completions only on plain tcp_sendmsg (mw_setsockopt). */
	d->nosend |= sflags & (MW_EXE_SEEN_URGENT | MW_EXE_SEEN_ZEROCOPY);

	trusted = cls->flags & MW_EXE_TRUSTED;
	if ((cfg & MW_CFG_BLOCKING_EAGAIN) && !trusted) {
		/* A blocked read of a psock socket can return EAGAIN. How a
		 * socket will be read is only known from its program's reads
		 * (O_NONBLOCK at connect() is not: connect-with-timeout helpers
		 * switch back to blocking): a psock only for programs seen
		 * reading without blocking, and never blocking — on this
		 * service where they were seen reading it, else anywhere. */
		__u32 rflags = sflags;
		__u32 *per_service;
		struct mw_reader_key rk = {};

		rk.exe = d->exe;
		rk.netns = bpf_get_netns_cookie(skops);
		rk.port = active ? bpf_ntohl(skops->remote_port) : skops->local_port;
		rk.end = active ? MW_END_CLIENT : MW_END_SERVER;
		per_service = bpf_map_lookup_elem(&mw_readers, &rk);
		if (per_service)
			rflags = *per_service;
		if (!(rflags & MW_EXE_SEEN_NONBLOCKING) || (rflags & MW_EXE_SEEN_BLOCKING)) {
			d->reader = true;
			return;
		}
	}
	if ((cfg & MW_CFG_SPLICE_BLIND) && exe_may_splice(cls->flags, sflags)) {
		target = false;
		d->reason = MW_EF_R_SPLICE;
	} else if ((sflags & MW_EXE_SEEN_PEEK_OFF) && target) {
		/* It sets SO_PEEK_OFF after connect()/accept(): bytes
		 * redirected before would make that a refusal. */
		target = false;
		d->reason = MW_EF_R_PEEKOFF;
	}
	/* A sender whose own incoming bytes come on TCP: FIONREAD would miss
	 * them. Without the syscall watch, FIONREAD readers are not known. */
	if ((cfg & MW_CFG_FIONREAD_PSOCK) && ((eflags & MW_EXE_SEEN_FIONREAD) || !(cfg & MW_CFG_SYSCALL_WATCH))) {
		if (!target) {
			d->reader = true;
			return;
		}
		d->fionread = true;
	}
	d->level = target ? LV_FULL : LV_SEND;
	zerocopy_decided(d);
}

/* MW_EF_FIONREAD for an end decided `d`. */
static __always_inline __u32 fionread_flag(const struct end_decision *d)
{
	return d->fionread ? MW_EF_FIONREAD : 0;
}

/* MW_EF_NOSEND (and why) for an accelerated end decided `d`. */
static __always_inline __u32 nosend_flag(const struct end_decision *d)
{
	if (!d->nosend || d->level == LV_NONE)
		return 0;
	return MW_EF_NOSEND | ((d->nosend & MW_EXE_SEEN_ZEROCOPY) ? MW_EF_ZEROCOPY : 0);
}

static __always_inline void count_reason(struct mw_rule_stats *rs, const struct end_decision *d)
{
	if (!rs)
		return;
	if (d->reader)
		rs->fb_reader++;
	else if (d->level == LV_SEND && d->reason == MW_EF_R_SPLICE)
		rs->fb_splice++;
	else if (d->level == LV_SEND && d->reason == MW_EF_R_LOWAT)
		rs->fb_lowat++;
	else if (d->level == LV_SEND && d->reason == MW_EF_R_PEEKOFF)
		rs->fb_peek_off++;
	if (nosend_flag(d) && (d->nosend & MW_EXE_SEEN_URGENT))
		rs->fb_urgent++;
	if ((nosend_flag(d) && (d->nosend & MW_EXE_SEEN_ZEROCOPY)) || d->zc_none)
		rs->fb_zerocopy++;
}

static __always_inline void count_insert_failure(struct mw_rule_stats *rs, long err)
{
	if (!rs)
		return;
	if (err == -E2BIG || err == -ENOMEM)
		rs->fb_map_full++;
	else if (err == -EEXIST)
		rs->fb_collision++;
	else
		rs->fb_insert_err++;
}

/* Bytes redirected into a socket and not read yet (psock queue). The low
 * bits of sk_user_data are flags (SK_USER_DATA_NOCOPY/BPF/PSOCK). */
static __always_inline __u32 psock_pending(struct sock *sk)
{
	unsigned long ud = (unsigned long)sk->sk_user_data & ~SK_USER_DATA_FLAGS;
	struct sk_psock *psock;

	psock = bpf_rdonly_cast((void *)ud, bpf_core_type_id_kernel(struct sk_psock));
	if (!psock)
		return 0;
	return psock->msg_tot_len;
}

/* ---- slots: where a link's ends sit in the SOCKMAP ---- */

/* Position `i` of the MW_SLOT_PROBES window link `id` claims its slot in. */
static __always_inline __u32 slot_probe(__u64 id, __u32 i)
{
	__u32 h = (__u32)(id ^ (id >> 32)) * 2654435761u;

	return nr_slots ? (h + i) % nr_slots : 0;
}

/* Claims a free slot for link `id` in its window; -ENOSPC when every
 * position is taken, -EEXIST when `id` owns one of them too (another
 * connection built the same id, earlier or at this very moment; *slot says
 * which): the claim is given back. */
static __always_inline long slot_claim(__u64 id, __u32 *slot)
{
	struct mw_slot *s, *mine = NULL;
	__u32 i, idx, at = 0;

	for (i = 0; i < MW_SLOT_PROBES && !mine; i++) {
		idx = slot_probe(id, i);
		s = bpf_map_lookup_elem(&mw_slots, &idx);
		if (!s)
			return -ENOENT;
		if (!s->owner && __sync_val_compare_and_swap(&s->owner, 0, id) == 0) {
			mine = s;
			at = idx;
		}
	}
	if (!mine)
		return -ENOSPC;
	for (i = 0; i < MW_SLOT_PROBES; i++) {
		idx = slot_probe(id, i);
		s = bpf_map_lookup_elem(&mw_slots, &idx);
		if (s && idx != at && s->owner == id) {
			__sync_val_compare_and_swap(&mine->owner, id, 0);
			*slot = idx;
			return -EEXIST;
		}
	}
	*slot = at;
	return 0;
}

/* Gives a slot back: neither end of link `id` is in the SOCKMAP. */
static __always_inline void slot_free(__u32 slot, __u64 id)
{
	struct mw_slot *s = bpf_map_lookup_elem(&mw_slots, &slot);

	if (s)
		__sync_val_compare_and_swap(&s->owner, id, 0);
}

/* Whether an end can no longer be in the SOCKMAP: never entered, left for
 * good at close, or unlinked by the policy. */
static __always_inline bool end_out(const struct mw_link *link, __u32 end)
{
	__u32 ef = link->end_flags[end & 1], df = link->dir[end & 1].flags;

	if (df & MW_DIR_UNLINKING)
		return false;
	return !(ef & MW_EF_PSOCK) || (ef & MW_EF_GONE) || (df & MW_DIR_UNLINKED);
}

/* The link in slot `slot`, if it is still link `id`. */
static __always_inline struct mw_link *link_at(__u32 slot, __u64 id)
{
	struct mw_link *link = bpf_map_lookup_elem(&mw_links, &slot);

	return (link && id && link->id == id) ? link : NULL;
}

/* The link `st` names (mw_sk_state is the host's alone: plugins reach only
 * mw_sk_chain). */
static __always_inline struct mw_link *link_of_sk(const struct mw_sock_state *st, const struct sock *sk)
{
	return link_at(st->slot, st->link);
}

/* Link `id` from its id alone: the slot it claimed is one of the
 * MW_SLOT_PROBES its hash starts from (slot_claim). */
static __always_inline struct mw_link *link_find(__u64 id, __u32 *slot)
{
	struct mw_link *link;
	struct mw_slot *s;
	__u32 i, idx;

	if (!id)
		return NULL;
	for (i = 0; i < MW_SLOT_PROBES; i++) {
		idx = slot_probe(id, i);
		s = bpf_map_lookup_elem(&mw_slots, &idx);
		if (!s || s->owner != id)
			continue;
		/* A stale slot (element cleared) or one still being filled
		 * does not hold it: look on. */
		link = link_at(idx, id);
		if (link) {
			*slot = idx;
			return link;
		}
	}
	return NULL;
}

/* Link `id` wherever it is: in its slot, or observe-only (mw_observe, no
 * slot). What a server end looks for at ESTABLISHED. */
static __always_inline struct mw_link *link_any(__u64 id, __u32 *slot)
{
	struct mw_link *link = link_find(id, slot);

	return link ? link : bpf_map_lookup_elem(&mw_observe, &id);
}

/* A link is going away: its element is cleared first (readers check the
 * id), then its slot freed, or, if an end may still be in the SOCKMAP
 * (closed with redirected bytes unread, its file open), left to user space,
 * which frees it once both entries are empty. */
static __always_inline void link_drop(struct mw_link *link, __u64 id)
{
	struct mw_global_stats *gs;
	struct mw_event *ev;
	struct mw_slot *s;
	__u32 slot = link->slot;
	bool out;

	out = end_out(link, MW_END_CLIENT) && end_out(link, MW_END_SERVER);
	/* Once: both ends may drop it at the same time. */
	if (__sync_val_compare_and_swap(&link->id, id, 0) != id)
		return;
	conn_short(link);
	if (out) {
		slot_free(slot, id);
		return;
	}
	s = bpf_map_lookup_elem(&mw_slots, &slot);
	if (!s || s->owner != id)
		return;
	s->stale = 1;
	gs = global_stats();
	if (gs)
		gs->slots_stale++;
	/* Lost if the ring buffer is full: user space also scans at start. The
	 * element's other fields stay until the slot is freed. */
	ev = bpf_ringbuf_reserve(&mw_events, sizeof(*ev), 0);
	if (!ev)
		return;
	__builtin_memset(ev, 0, sizeof(*ev));
	ev->type = MW_EV_SLOT_STALE;
	ev->link = id;
	ev->slot = slot;
	fill_event_link(ev, link);
	bpf_ringbuf_submit(ev, 0);
}

/* A socket's state at ESTABLISHED: not accelerated yet (link 0), its reads
 * published from rcv_nxt (nothing read). */
static __always_inline void init_state(struct mw_sock_state *st, __u32 rule_id, __u32 end, __u32 rcv_nxt,
				      __u64 conn)
{
	state_clear(st);
	st->flags = MW_SOCK_END;
	st->rule_id = rule_id;
	st->end = end;
	st->rd_pub = rcv_nxt;
	st->conn = conn;
}

static __always_inline void watch_close(struct bpf_sock_ops *skops)
{
	bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
}

/* Where the oldest unread send of direction `end` (its sending end) is kept;
 * `create`: make room for it (a send) rather than only look (a read). */
static __always_inline __u64 *lat_pending(struct mw_sock_state *st, __u32 end, bool create)
{
	struct mw_lat_pend_key k = { .conn = st->conn, .end = end & 1 };
	__u32 pos;
	__u64 *ts;

	/* Both ends agree: an accelerated link's ends both see it; once the
	 * server end released it, neither does. */
	if (st->link && st->slot != MW_NO_SLOT && link_at(st->slot, st->link)) {
		pos = st->slot * 2 + (end & 1);
		return bpf_map_lookup_elem(&mw_lat_slot, &pos);
	}
	ts = bpf_map_lookup_elem(&mw_lat_pend, &k);
	if (!ts && create) {
		__u64 zero = 0;

		bpf_map_update_elem(&mw_lat_pend, &k, &zero, BPF_NOEXIST);
		ts = bpf_map_lookup_elem(&mw_lat_pend, &k);
	}
	return ts;
}

/* This thread's record of its last read (`create`: make one if missing). */
static __always_inline struct mw_lat_thread *lat_thread(bool create)
{
	struct mw_lat_thread *th;
	__u64 id;
	__u32 tid;

	if (mw_task_storage)
		return bpf_task_storage_get(&mw_lat_thr, bpf_get_current_task_btf(), 0,
					    create ? BPF_LOCAL_STORAGE_GET_F_CREATE : 0);
	id = bpf_get_current_pid_tgid();
	tid = (__u32)id;
	th = bpf_map_lookup_elem(&mw_lat_thrh, &tid);
	if (th && th->pid_tgid != id) {
		/* A thread id reused by another process: not its reads. */
		if (!create)
			return NULL;
		th->ts = 0;
		th->pid_tgid = id;
	}
	if (!th && create) {
		struct mw_lat_thread fresh = { .pid_tgid = id };

		bpf_map_update_elem(&mw_lat_thrh, &tid, &fresh, BPF_NOEXIST);
		th = bpf_map_lookup_elem(&mw_lat_thrh, &tid);
	}
	return th;
}

/* A send begins on a covered socket (sk_msg, or tcp_sendmsg_locked for the
 * TCP path): before any of its bytes can reach the peer. The oldest unread
 * send of each direction and of each socket is what a read answers.
 *
 * Sampled (not MW_CFG_LAT_EVERY): a send is measured when this thread's last
 * read carried a sample (a request's chain through its hops), or when this
 * socket's own count of sends to skip runs out. Other sends read no clock. */
static __always_inline void lat_send(struct mw_sock_state *st, __u64 since, bool every)
{
	__u32 end = st->end & 1, metric = 0, from = MW_NO_ID, gap, cap;
	__u64 now, *ts, then = 0;
	struct mw_lat_thread *th;
	bool own;

	if (!st->conn)
		return;
	/* The time since this thread's last read: a server's own (it read its
	 * end of this connection: think time) or a proxy's between two hops (it
	 * read one connection's server end and writes another's client end, or
	 * the way back). One sample per read. Plain loads and stores: only this
	 * end's sends (under its socket lock) set a stamp, only its peer's
	 * reads clear one; a race loses one sample, never makes one up. */
	th = lat_thread(false);
	if (th && th->ts) {
		if (th->conn != st->conn && th->end != end) {
			metric = MW_LAT_HOP;
			from = th->rule_id;
		} else if (th->conn == st->conn && end == MW_END_SERVER && th->end == MW_END_SERVER) {
			metric = MW_LAT_THINK;
		}
		then = th->ts;
		th->ts = 0;
	}
	own = every || !st->lat_skip;
	if (!own && !metric) {
		/* A socket busy once and quiet now is measured again: its first
		 * skipped send after an own sample, and every 8th after that,
		 * look whether that sample is older than MW_LAT_IDLE (a clock
		 * read on one send in eight at most). */
		if (st->lat_skip == st->lat_cap || !(st->lat_skip & 7)) {
			if ((__u32)(bpf_ktime_get_ns() >> 10) - st->lat_last > MW_LAT_IDLE) {
				st->lat_skip = 0;
				st->lat_cap = 0;
				own = true;
			}
		}
		if (!own) {
			st->lat_skip--;
			return;
		}
	}
	now = bpf_ktime_get_ns();
	if (own && !every) {
		/* Skip twice as many sends while this end's own samples come
		 * closer than MW_LAT_GAP, half as many once they do not, none
		 * after a quiet MW_LAT_IDLE. */
		gap = (__u32)(now >> 10) - st->lat_last;
		st->lat_last = (__u32)(now >> 10);
		cap = st->lat_cap;
		cap = gap < MW_LAT_GAP ? cap * 2 + 1 : gap > MW_LAT_IDLE ? 0 : cap / 2;
		if (cap > MW_LAT_SKIP_MAX)
			cap = MW_LAT_SKIP_MAX;
		st->lat_cap = cap;
		st->lat_skip = cap;
	}
	if (metric && now > then && then >= since)
		lat_record(st->rule_id, metric, from, now - then);
	ts = lat_pending(st, end, true);
	if (ts && !*ts)
		*ts = now;
	if (end == MW_END_CLIENT && !st->req_ts)
		st->req_ts = now;
}

/* A read returned bytes: the peer's oldest unread send was delivered (on the
 * path the read took them from), a client's request was answered, and this
 * thread's next send measures its own time (lat_send). Sampled, a read that
 * carries no stamp reads no clock, and leaves this thread nothing to carry. */
static __always_inline void lat_recv(struct mw_sock_state *st, bool fast, __u64 since, bool every)
{
	struct mw_lat_thread *th;
	__u64 now, *ts, t, pend;

	if (!st->conn)
		return;
	ts = lat_pending(st, st->end ^ 1, false);
	pend = ts ? *ts : 0;
	if (!pend && !st->req_ts && !every) {
		/* Nothing sampled arrives: this thread's next send starts no
		 * chain, unless this is the rest of the very message whose
		 * first read carried the stamp (read in pieces). */
		th = lat_thread(false);
		if (th && (th->conn != st->conn || th->end != (st->end & 1)))
			th->ts = 0;
		return;
	}
	now = bpf_ktime_get_ns();
	if (ts && pend) {
		*ts = 0;
		if (now > pend && pend >= since)
			lat_record(st->rule_id, fast ? MW_LAT_FAST : MW_LAT_TCP, MW_NO_ID, now - pend);
	}
	if (st->req_ts) {
		t = st->req_ts;
		st->req_ts = 0;
		if (now > t && t >= since)
			lat_record(st->rule_id, MW_LAT_RESPONSE, MW_NO_ID, now - t);
	}
	th = lat_thread(true);
	if (th) {
		th->ts = now;
		th->conn = st->conn;
		th->rule_id = st->rule_id;
		th->end = st->end & 1;
	}
}

/* A new link's slot: no send of the connection that held it before is pending. */
static __always_inline void lat_slot_clear(__u32 slot)
{
	__u32 pos = slot * 2;
	__u64 *ts = bpf_map_lookup_elem(&mw_lat_slot, &pos);

	if (ts)
		*ts = 0;
	pos++;
	ts = bpf_map_lookup_elem(&mw_lat_slot, &pos);
	if (ts)
		*ts = 0;
}

/* ---- ESTABLISHED ---- */

/* The hint at `k`: `reason` (MW_EF_R_*) why its accepted ends are no
 * targets, or 0: they are (no hint). Written only when it changes. */
static __always_inline void srv_hint_put(struct mw_srv_key *k, __u32 reason, __u32 cfg)
{
	struct mw_srv_hint hint = { .cfg = cfg & MW_CFG_HINT, .reason = reason };
	struct mw_srv_hint *h = bpf_map_lookup_elem(&mw_srv_hint, k);

	if (!reason) {
		if (h)
			bpf_map_delete_elem(&mw_srv_hint, k);
		return;
	}
	if (!h || h->cfg != hint.cfg || h->reason != hint.reason)
		bpf_map_update_elem(&mw_srv_hint, k, &hint, BPF_ANY);
}

/* Where `link`'s server end leaves its hint for the link's clients. */
static __always_inline void srv_key(struct mw_srv_key *k, const struct mw_link *link)
{
	__builtin_memset(k, 0, sizeof(*k));
	k->netns = link->netns[MW_END_CLIENT];
	copy_ip(k->ip, link->server_ip);
	k->port = link->server_port;
	k->family = link->family;
}

/* Whether the server end of `link` (being built by its client end) is known
 * never to be a target: what that listener's last accepted end decided. */
static __always_inline bool srv_no_target(const struct mw_link *link, __u32 cfg)
{
	struct mw_srv_hint *h;
	struct mw_srv_key k;

	srv_key(&k, link);
	h = bpf_map_lookup_elem(&mw_srv_hint, &k);
	return h && h->cfg == (cfg & MW_CFG_HINT);
}

/* A server end decided `d` for itself (before its client's choices): the
 * hint its listener's next clients go by. Not for the rule's own flag (the
 * client reads that from the rule) or an undecided reader. */
static __always_inline void srv_hint_set(const struct mw_link *link, const struct end_decision *d, __u32 cfg)
{
	struct mw_srv_key k;

	if (d->level == LV_NONE || (d->level == LV_SEND && d->reason == MW_EF_R_RULE))
		return;
	srv_key(&k, link);
	srv_hint_put(&k, d->level == LV_FULL ? 0 : d->reason, cfg);
}

/* The client end: creates the link (if it may be accelerated at all) and
 * enters the SOCKMAP. The server end decides the rest. */
static __always_inline void on_active_established(struct bpf_sock_ops *skops, struct bpf_sock *sk,
						  const struct tuple *t)
{
	struct mw_global_stats *gs;
	struct mw_rule_stats *rs;
	struct mw_sock_state *st;
	struct mw_cookie_val cv = {};
	struct end_decision d = {};
	struct mw_link *link;
	struct mw_link *existing;
	struct tcp_sock *tp;
	struct mw_rule *rule;
	__u32 kind = 0, zero = 0, slot = 0, pos, cfg;
	__u64 id, cookie, since;
	bool tgtmap;
	long err;

	rule = port_maybe_covered(t->remote_port) ? match_active(t, &kind) : NULL;
	if (!rule) {
		gs = global_stats();
		if (gs)
			gs->not_covered++;
		return;
	}
	if (!sk)
		return;
	tp = bpf_skc_to_tcp_sock(sk);
	if (!tp)
		return;
	cfg = config_flags();
	st = bpf_sk_storage_get(&mw_sk_state, sk, 0, 0);
	/* No owner stamped at connect(): with the reader guard on, an
	 * adaptive rule's client was left on TCP there (short_skip, counted
	 * then; the score may have changed since, and an end without an owner
	 * would not be accelerated anyway), else it is decided now. A probe
	 * was stamped. */
	if ((!st || !(st->own.flags & MW_OWN_KNOWN)) &&
	    ((cfg & MW_CFG_GUARD) ? rule_adaptive(rule) : short_skip(rule, true))) {
		/* A reused socket's state of an earlier connection must not
		 * stay on a connection left out. */
		if (st && (st->flags & MW_SOCK_END))
			state_clear(st);
		return;
	}
	rs = rule_stats(rule->id);
	if (!st)
		st = bpf_sk_storage_get(&mw_sk_state, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!st) {
		count_insert_failure(rs, -ENOMEM);
		return;
	}
	id = ((__u64)skops->snd_una << 32) | skops->rcv_nxt;
	init_state(st, rule->id, MW_END_CLIENT, skops->rcv_nxt, id);
	since = lat_since(rule->id, NULL);
	if (since) {
		__u64 *at = bpf_sk_storage_get(&mw_sk_conn, sk, 0, 0);
		__u64 now = bpf_ktime_get_ns();

		if (at && *at >= since && now > *at)
			lat_record(rule->id, MW_LAT_SETUP, MW_NO_ID, now - *at);
	}
	/* Data in the SYN (Fast Open) took the TCP path: the server end sets,
	 * when it claims the link, how much of it its reader has read
	 * (on_passive_established); until it read all, this direction stays on
	 * TCP, as for any byte sent before the link. */
	if (rule->flags & MW_RULE_MODE_NEVER) {
		d.level = LV_NONE;
		st->fb = MW_FB_MODE_NEVER;
		if (rs)
			rs->fb_mode_never++;
		/* A mirror pair's server end finds its rule (and this mode) by
		 * itself (never_server_end): no observe-only link, no close
		 * watch, so a connection kept on TCP pays little more than an
		 * uncovered one (the latency monitor pairs the ends' samples by
		 * the id both compute). A captured connection's server end
		 * knows no rule: its client still leaves the link. */
		if (kind == MW_LINK_MIRROR)
			return;
	} else {
		decide_end(skops, tp, true, rule->flags, cfg, st, &d);
		count_reason(rs, &d);
		if (d.level == LV_NONE)
			st->fb = d.zc_none ? MW_FB_ZEROCOPY : MW_FB_READER;
	}

	cookie = bpf_get_socket_cookie(skops);
	link = bpf_map_lookup_elem(&mw_scratch, &zero);
	if (!link)
		return;
	__builtin_memset(link, 0, sizeof(*link));
	link->family = t->family;
	link->kind = kind;
	copy_ip(link->client_ip, t->local_ip);
	link->client_port = t->local_port;
	if (kind == MW_LINK_CAPTURE) {
		copy_ip(link->server_ip, rule->listener_ip);
		link->server_port = rule->listener_port;
	} else {
		copy_ip(link->server_ip, t->remote_ip);
		link->server_port = t->remote_port;
	}
	link->rule_id = rule->id;
	link->flags = (rule->flags & MW_RULE_MODE_ALWAYS) ? MW_LINK_FIXED : 0;
	/* Nothing read yet: each direction's reader is at its sender's ISN + 1. */
	link->dir[MW_END_CLIENT].tcp_read = skops->snd_una;
	link->dir[MW_END_SERVER].tcp_read = skops->rcv_nxt;
	/* Until the server end claims the link, nothing is redirected into it. */
	link->end_flags[MW_END_SERVER] = (rule->flags & MW_RULE_NO_TARGET_SERVER) ? MW_EF_R_RULE : 0;
	link->cookie[MW_END_CLIENT] = cookie;
	link->sk[MW_END_CLIENT] = (__u64)skops->sk;
	link->exe[MW_END_CLIENT] = d.exe;
	link->netns[MW_END_CLIENT] = bpf_get_netns_cookie(skops);
	/* A server end known never to be a target (the rule, or its listener's
	 * last accepted end): nothing this end sends can be redirected, so it
	 * is a target only, in mw_tgtmap, where no sk_msg runs on its sends;
	 * or, not a target either, not accelerated at all. */
	tgtmap = d.level != LV_NONE && !d.chain &&
		 ((rule->flags & MW_RULE_NO_TARGET_SERVER) || srv_no_target(link, cfg) || d.nosend);
	if (tgtmap && d.level != LV_FULL) {
		d.level = LV_NONE;
		st->fb = MW_FB_NO_TARGET;
	}
	link->end_flags[MW_END_CLIENT] = MW_EF_PSOCK | (tgtmap ? MW_EF_TGTMAP : 0) | nosend_flag(&d) |
					 (d.level == LV_FULL ? MW_EF_TARGET | fionread_flag(&d) : d.reason);
	if (d.level == LV_NONE) {
		/* Not accelerated; the server end still learns who reads it
		 * (its listener may predate meshwarp), then drops the link. */
		link->flags = MW_LINK_OBSERVE;
		link->end_flags[MW_END_CLIENT] = 0;
		link->id = id;
		link->pad = st->fb; /* why, for the server end's connection list */
		if (!bpf_map_update_elem(&mw_observe, &id, link, BPF_NOEXIST)) {
			st->link = id;
			st->slot = MW_NO_SLOT;
			watch_close(skops);
		}
		return;
	}
	err = slot_claim(id, &slot);
	if (err == -EEXIST) {
		/* Another connection built this id: neither may redirect. */
		existing = link_at(slot, id);
		if (existing)
			__sync_fetch_and_or(&existing->flags, MW_LINK_POISONED);
		if (rs)
			rs->fb_collision++;
		st->fb = MW_FB_COLLISION;
		return;
	}
	if (err) {
		gs = global_stats();
		if (gs)
			gs->no_slot++;
		count_insert_failure(rs, -E2BIG);
		st->fb = MW_FB_NO_SLOT;
		return;
	}
	link->slot = slot;
	link->flags |= MW_LINK_SLOT;
	link->id = id;
	lat_slot_clear(slot);
	err = bpf_map_update_elem(&mw_links, &slot, link, BPF_ANY);
	if (err) {
		slot_free(slot, id);
		count_insert_failure(rs, err);
		st->fb = MW_FB_INSERT;
		return;
	}
	pos = slot * 2 + MW_END_CLIENT;
	err = bpf_sock_map_update(skops, tgtmap ? (void *)&mw_tgtmap : (void *)&mw_sockmap, &pos, BPF_NOEXIST);
	if (err) {
		existing = link_at(slot, id);
		if (existing && __sync_val_compare_and_swap(&existing->id, id, 0) == id)
			slot_free(slot, id);
		count_insert_failure(rs, err);
		st->fb = MW_FB_INSERT;
		return;
	}
	cv.link = id;
	cv.end = MW_END_CLIENT;
	cv.rule_id = rule->id;
	cv.slot = slot;
	bpf_map_update_elem(&mw_cookies, &cookie, &cv, BPF_ANY);
	st->link = id;
	st->slot = slot;
	if (tgtmap)
		st->flags |= MW_SOCK_TGTMAP;
	if (rs) {
		rs->sockets++;
		if (tgtmap && !d.nosend)
			rs->tgtmap_clients++;
	}
	watch_close(skops);
}

/* Takes the client end back out of the SOCKMAP: the connection stays on TCP
 * at both ends (nothing was redirected into the client yet, since the server
 * end was never in the map). */
static __always_inline void release_client(__u64 id, struct mw_link *link)
{
	struct mw_rule_stats *rs = rule_stats(link->rule_id);
	__u32 pos = link->slot * 2 + MW_END_CLIENT;

	if (!(link->flags & MW_LINK_SLOT)) {
		bpf_map_delete_elem(&mw_observe, &id); /* observe-only: nothing else to undo */
		return;
	}
	if (__sync_val_compare_and_swap(&link->id, id, 0) != id)
		return;
	if (link->end_flags[MW_END_CLIENT] & MW_EF_TGTMAP)
		bpf_map_delete_elem(&mw_tgtmap, &pos);
	else
		bpf_map_delete_elem(&mw_sockmap, &pos);
	bpf_map_delete_elem(&mw_cookies, &link->cookie[MW_END_CLIENT]);
	slot_free(link->slot, id);
	if (rs)
		rs->sockets--;
}

/* Defined with the reads' programs below. */
static __always_inline __u32 tcp_unread(struct tcp_sock *tp);
static __always_inline bool peer_bytes_unread(struct tcp_sock *tp, const struct mw_link *link, __u32 end);

/* The server end of a mirror pair in mode never (its client end built no
 * link): state for the connection list, its reads and the latency monitor
 * (`id`, as the client end computed it, pairs their samples: a Fast Open
 * end's only at its SYN_RECV -> ESTABLISHED change, once its SYN's data
 * counts in rcv_nxt), and nothing to clean up at its close. Unlike an
 * observe-only link's server end, it decides nothing about its reader (no
 * listener learned, no hint refreshed): a rule switched from never later
 * finds them as they were. */
static __always_inline void never_server_end(struct bpf_sock *sk, __u32 rule_id, __u64 id, __u32 rcv_nxt)
{
	struct mw_sock_state *st;

	if (!sk)
		return;
	st = bpf_sk_storage_get(&mw_sk_state, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!st)
		return;
	init_state(st, rule_id, MW_END_SERVER, rcv_nxt, id);
	st->fb = MW_FB_MODE_NEVER;
}

static __always_inline void on_passive_established(struct bpf_sock_ops *skops, struct bpf_sock *sk,
						   const struct tuple *t, bool fastopen)
{
	struct mw_global_stats *gs;
	struct mw_rule_stats *rs;
	struct mw_sock_state *st;
	struct mw_cookie_val cv = {};
	struct end_decision d = {};
	struct tcp_sock *tp;
	struct mw_link *link;
	struct mw_rule *rule;
	__u32 old, client_flags, rule_flags, cfg, pos, slot = 0;
	__u64 id, cookie;
	bool to_server, to_client, tgtmap, move, late;
	long err;

	/* No rule names this server port: no client end built a link for it
	 * either (one removed since leaves its client end to fall back). */
	if (!port_maybe_covered(t->local_port)) {
		gs = global_stats();
		if (gs)
			gs->not_covered++;
		return;
	}
	id = ((__u64)skops->rcv_nxt << 32) | skops->snd_una;
	link = link_any(id, &slot);
	if (!link) {
		/* Covered, but its client end is not accelerated (not covered
		 * there, not a classified reader, on another node, ...). */
		rule = match_pair(t, false);
		/* Or made by Fast Open at the client's SYN: its client end links
		 * at the SYN-ACK, and this end claims the link at the last ACK
		 * of the handshake (its SYN_RECV -> ESTABLISHED change). In mode
		 * never too: only then is the SYN's data in rcv_nxt, as in the
		 * id its client end computed. */
		tp = sk ? bpf_skc_to_tcp_sock(sk) : NULL;
		/* Not while the rule's connections are short: its client is
		 * left out at connect() (but for a probe, which this end cannot
		 * tell apart: the run ends by itself, MW_SHORT_FOR). */
		if (rule && tp && !fastopen && tp->fastopen_rsk && !rule_short(rule)) {
			st = bpf_sk_storage_get(&mw_sk_state, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
			if (st) {
				init_state(st, rule->id, MW_END_SERVER, skops->rcv_nxt, 0);
				st->flags |= MW_SOCK_FASTOPEN;
				st->fb = MW_FB_SYN_DATA;
				watch_close(skops);
				return;
			}
		}
		if (rule && (rule->flags & MW_RULE_MODE_NEVER)) {
			/* Read up to rcv_nxt (id's upper half: no second context
			 * load the verifier would see through a moved pointer),
			 * a Fast Open end up to copied_seq (its SYN's data). */
			never_server_end(sk, rule->id, id, fastopen && tp ? tp->copied_seq : (__u32)(id >> 32));
			return;
		}
		/* A Fast Open end whose client end never linked: as any covered
		 * end whose client is not accelerated. */
		st = fastopen && sk ? bpf_sk_storage_get(&mw_sk_state, sk, 0, 0) : NULL;
		if (st && (st->flags & MW_SOCK_END))
			st->fb = MW_FB_PEER;
		gs = global_stats();
		if (gs) {
			if (rule)
				gs->no_link++;
			else
				gs->not_covered++;
		}
		return;
	}
	rs = rule_stats(link->rule_id);
	/* The link must describe this very connection. */
	if (link->family != t->family || link->client_port != t->remote_port ||
	    link->server_port != t->local_port || !ip_eq(link->client_ip, t->remote_ip) ||
	    !ip_eq(link->server_ip, t->local_ip)) {
		if (rs)
			rs->fb_collision++;
		return;
	}
	old = __sync_fetch_and_or(&link->flags, MW_LINK_CLAIMED);
	if (old & (MW_LINK_CLAIMED | MW_LINK_POISONED)) {
		__sync_fetch_and_or(&link->flags, MW_LINK_POISONED);
		if (rs)
			rs->fb_collision++;
		return;
	}
	if (!sk)
		return;
	tp = bpf_skc_to_tcp_sock(sk);
	if (!tp)
		return;
	st = bpf_sk_storage_get(&mw_sk_state, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!st) {
		count_insert_failure(rs, -ENOMEM);
		release_client(id, link);
		return;
	}
	if (fastopen) {
		/* Its reader may not have read the SYN's data yet: its client's
		 * bytes are read up to copied_seq, not rcv_nxt (set before this
		 * end is published; its client redirects only after). */
		__u32 copied = tp->copied_seq;

		init_state(st, link->rule_id, MW_END_SERVER, copied, id);
		link->dir[MW_END_CLIENT].tcp_read = copied;
	} else {
		init_state(st, link->rule_id, MW_END_SERVER, skops->rcv_nxt, id);
	}
	rule_flags = (link->end_flags[MW_END_SERVER] & MW_EF_R_RULE) ? MW_RULE_NO_TARGET_SERVER : 0;
	cfg = config_flags();
	decide_end(skops, tp, false, rule_flags, cfg, st, &d);
	srv_hint_set(link, &d, cfg);
	if (old & MW_LINK_OBSERVE) {
		/* Its reader is observed (st); nothing is accelerated. A client
		 * that is no target left out because this end never is one: this
		 * end's reason counts, and a stale hint shows (it is one). */
		if (link->pad == MW_FB_NO_TARGET) {
			count_reason(rs, &d);
			if (d.level == LV_FULL && rs)
				rs->hint_stale++;
		}
		st->fb = link->pad ? link->pad : MW_FB_PEER;
		bpf_map_delete_elem(&mw_observe, &id);
		return;
	}
	count_reason(rs, &d);

	/* Both ends accelerated, or neither: a socket with a psock whose
	 * incoming bytes all come on TCP gains nothing and loses FIONREAD. */
	client_flags = link->end_flags[MW_END_CLIENT];
	if ((client_flags & (MW_EF_TGTMAP | MW_EF_NOSEND)) && d.level == LV_FULL) {
		/* Its client sends nothing that can be redirected (it went by a
		 * stale hint, or its program sends urgent data): no target, as
		 * decide_end has it for one. */
		if (rs && !(client_flags & MW_EF_NOSEND))
			rs->hint_stale++;
		if (d.fionread) {
			d.level = LV_NONE;
			d.reader = true;
			if (rs)
				rs->fb_reader++;
		} else {
			d.level = LV_SEND;
			d.reason = 0;
		}
	}
	/* Nor is its client, if this end's program sends urgent data; a
	 * client that asks FIONREAD would miss every byte then (all on TCP
	 * behind its psock): neither end is accelerated. */
	to_client = (client_flags & MW_EF_TARGET) && !d.nosend;
	to_server = d.level == LV_FULL && !(d.nosend && (client_flags & MW_EF_FIONREAD));
	if (d.level == LV_NONE || (!to_client && !to_server)) {
		st->fb = d.level == LV_NONE ? (d.zc_none ? MW_FB_ZEROCOPY : MW_FB_READER) : MW_FB_NO_TARGET;
		release_client(id, link);
		return;
	}
	pos = link->slot * 2 + MW_END_SERVER;
	/* Nothing this end sends can be redirected: a target only. */
	tgtmap = !to_client && !d.chain;
	/* Nor can anything its client sends, which joined mw_sockmap before
	 * this end decided (no hint at its connect: a listener's first client
	 * from another namespace), and would run sk_msg on every send only to
	 * hear that this end is no target. It moves to mw_tgtmap
	 * (MW_DIR_MOVE), parked from now until it is in: nothing is redirected
	 * into it meanwhile (this end's bytes take TCP), so its psock holds
	 * nothing when its entry is deleted. A FIONREAD reader moves in only
	 * once it read what this end sent meanwhile (move_in). */
	move = to_client && !to_server && !(client_flags & MW_EF_TGTMAP) && !d.chain;
	/* sockops may insert a socket only at an established callback: a Fast
	 * Open end, claiming at a state change, joins mw_sockmap through a
	 * relink (mw_park), out and parked until then (its client's bytes
	 * take TCP meanwhile). Not into mw_tgtmap, nor moving its client. */
	if (fastopen && (tgtmap || move)) {
		st->fb = MW_FB_SYN_DATA;
		release_client(id, link);
		return;
	}
	/* A FIONREAD reader whose client's bytes are unread here or still on
	 * their way (sent before this end linked, so on TCP) would not count
	 * them behind a psock, and its client's later sends stay on TCP until
	 * it read them, each read waiting for a wake-up (937 in one connection
	 * of `nginx_and_curl_with_tcp_fast_open`, 1 run in 70): it joins late,
	 * as a Fast Open end does, by a relink once it read them. */
	late = fastopen || (to_server && d.fionread && !tgtmap && !move && (cfg & MW_CFG_FIONREAD_PSOCK) &&
			    (tcp_unread(tp) || peer_bytes_unread(tp, link, MW_END_SERVER)));
	err = late ? 0
		   : bpf_sock_map_update(skops, tgtmap ? (void *)&mw_tgtmap : (void *)&mw_sockmap, &pos, BPF_NOEXIST);
	if (err) {
		count_insert_failure(rs, err);
		st->fb = MW_FB_INSERT;
		release_client(id, link);
		return;
	}
	/* Parked before this end is published, and after its insert could
	 * fail (release_client frees the slot without MW_DIR_UNLINKING). This
	 * end's own sends, which could redirect into the client, come only
	 * after its accept. */
	if (move) {
		__sync_fetch_and_or(&link->end_flags[MW_END_CLIENT], MW_EF_PARKED);
		__sync_fetch_and_or(&link->dir[MW_END_CLIENT].flags, MW_DIR_MOVE | MW_DIR_UNLINK_REQ);
	}
	cookie = bpf_get_socket_cookie(skops);
	cv.link = id;
	cv.end = MW_END_SERVER;
	cv.rule_id = link->rule_id;
	cv.slot = slot;
	bpf_map_update_elem(&mw_cookies, &cookie, &cv, BPF_ANY);
	link->cookie[MW_END_SERVER] = cookie;
	link->sk[MW_END_SERVER] = (__u64)skops->sk;
	link->exe[MW_END_SERVER] = d.exe;
	link->netns[MW_END_SERVER] = bpf_get_netns_cookie(skops);
	if (tgtmap)
		st->flags |= MW_SOCK_TGTMAP;
	if (late) {
		__sync_fetch_and_or(&link->dir[MW_END_SERVER].flags, MW_DIR_UNLINKED);
		__sync_fetch_and_or(&link->end_flags[MW_END_SERVER], MW_EF_PARKED);
	}
	/* Published last: the client redirects only once this end is in the map. */
	__sync_fetch_and_or(&link->end_flags[MW_END_SERVER], MW_EF_PSOCK | (tgtmap ? MW_EF_TGTMAP : 0) | nosend_flag(&d) |
								     (to_server ? MW_EF_TARGET | fionread_flag(&d) : d.reason));
	st->link = id;
	st->slot = slot;
	if (rs)
		rs->sockets++;
	watch_close(skops);
	if (late) {
		st->flags |= MW_SOCK_JOIN_ASKED;
		ask_join_quietly(link, MW_END_SERVER);
	}
	/* Not asked (ring buffer full): it stays where it is, a target. */
	if (move && !request_park(MW_EV_MOVE, link, id, MW_END_CLIENT))
		unpark_unserved(link, MW_END_CLIENT);
}

/* A socket closed: forget its cookie; the last end (or a client whose server
 * end never came) removes the link and retires its slot. */
static __always_inline void on_state_change(struct bpf_sock_ops *skops)
{
	struct bpf_sock *sk = skops->sk;
	struct mw_sock_state *st;
	struct mw_link *link;
	struct tcp_sock *tp;
	__u64 cookie, id;
	__u32 end, old, other, pos;

	if (skops->args[1] != TCP_CLOSE_STATE || !sk)
		return;
	st = bpf_sk_storage_get(&mw_sk_state, sk, 0, 0);
	if (!st || !st->link)
		return;
	id = st->link;
	end = st->end & 1;
	cookie = bpf_get_socket_cookie(skops);
	bpf_map_delete_elem(&mw_cookies, &cookie);
	if (st->flags & MW_SOCK_JOIN_ASKED)
		bpf_map_delete_elem(&mw_joins, &cookie);
	if (st->slot == MW_NO_SLOT) {
		/* An observe-only client end whose server end never came. */
		bpf_map_delete_elem(&mw_observe, &id);
		return;
	}
	link = link_at(st->slot, id);
	if (!link || link->cookie[end] != cookie)
		return;
	/* Its entry can go unless the reader has redirected bytes left to
	 * read (the file is still open then; closing it empties the entry).
	 * A closed socket takes no more bytes, on TCP or redirected. */
	tp = bpf_skc_to_tcp_sock(sk);
	pos = link->slot * 2 + end;
	if ((link->flags & MW_LINK_SLOT) && tp && !psock_pending((struct sock *)tp)) {
		long err = (link->end_flags[end] & MW_EF_TGTMAP) ? bpf_map_delete_elem(&mw_tgtmap, &pos)
								 : bpf_map_delete_elem(&mw_sockmap, &pos);

		/* -EINVAL: the entry was empty already (closing its file took
		 * it out before the socket reached CLOSE). */
		if (!err || err == -EINVAL || err == -ENOENT)
			__sync_fetch_and_or(&link->end_flags[end], MW_EF_GONE);
	}
	old = __sync_fetch_and_or(&link->end_flags[end], MW_EF_CLOSED);
	other = link->end_flags[end ^ 1];
	if ((other & MW_EF_CLOSED) || !(link->flags & MW_LINK_CLAIMED) || !(other & MW_EF_PSOCK)) {
		link_drop(link, id);
	}
	(void)old;
}

/* The rule id covering a connection, without changing anything; MW_NO_ID if
 * none does. What on_connection plugins are told before the host decides. */
static __always_inline __u32 covering_rule(struct bpf_sock_ops *skops, const struct tuple *t, bool active)
{
	struct mw_rule *rule;
	struct mw_link *link;
	__u32 kind, slot;
	__u64 id;

	if (!port_maybe_covered(active ? t->remote_port : t->local_port))
		return MW_NO_ID;
	if (active) {
		rule = match_active(t, &kind);
		return rule ? rule->id : MW_NO_ID;
	}
	id = ((__u64)skops->rcv_nxt << 32) | skops->snd_una;
	link = link_any(id, &slot);
	if (link)
		return link->rule_id;
	rule = match_pair(t, false);
	return rule ? rule->id : MW_NO_ID;
}

static __always_inline void on_established(struct bpf_sock_ops *skops, const struct tuple *t, __u32 op)
{
	/* One load of skops->sk for both: clang would otherwise hoist the
	 * context address and the verifier refuses a modified context pointer. */
	struct bpf_sock *sk = skops->sk;

	if (op == BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB)
		on_active_established(skops, sk, t);
	else
		on_passive_established(skops, sk, t, false);
}

/* A Fast Open server end reached ESTABLISHED (MW_SOCK_FASTOPEN): its client
 * end linked at the SYN-ACK, so it claims the link now; its on_connection
 * chain ran at its established callback. Other ends seeing this change (an
 * accelerated server end is watched from its established callback on,
 * which comes just before it) are left alone. */
static __always_inline void on_fastopen_established(struct bpf_sock_ops *skops)
{
	struct bpf_sock *sk = skops->sk;
	struct mw_sock_state *st;
	struct tuple t;

	if (!sk)
		return;
	st = bpf_sk_storage_get(&mw_sk_state, sk, 0, 0);
	if (!st || !(st->flags & MW_SOCK_FASTOPEN) || st->link)
		return;
	st->flags &= ~MW_SOCK_FASTOPEN;
	if (load_tuple(skops, &t))
		on_passive_established(skops, sk, &t, true);
}

/* Runs the on_connection chain for a covered connection. Returns only when
 * the chain is empty or its first program is absent (fail-open); *declined
 * is set when that plugin asked to fail closed. */
static __always_inline void run_conn_chain(struct bpf_sock_ops *skops, const struct tuple *t, __u32 op,
					   bool *declined)
{
	struct bpf_sock *sk = skops->sk;
	struct mw_sk_chain *ch;
	__u32 gen, id;

	if (!mw_active_chain(MW_HOOK_CONNECTION, &gen) || !sk)
		return;
	id = covering_rule(skops, t, op == BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB);
	if (id == MW_NO_ID)
		return;
	ch = bpf_sk_storage_get(&mw_sk_chain, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!ch)
		return;
	ch->rule_id = id;
	ch->flags = mw_sock_chain_set(0, gen, 0);
	bpf_tail_call(skops, &mw_ch_conn, gen * MW_CHAIN_MAX);
	*declined = mw_chain_fails_closed(gen, MW_HOOK_CONNECTION, 0);
}

/* connect() of a covered connection: stamp the owner (listen(): see
 * stamp_listener). */
static __always_inline void on_connect(struct bpf_sock_ops *skops)
{
	struct bpf_sock *sk = skops->sk;
	struct tcp_sock *tp;
	__u32 kind, cfg = config_flags();
	struct mw_rule *rule;
	struct tuple t;

	if (!(cfg & (MW_CFG_GUARD | MW_CFG_LATENCY)) || !load_tuple(skops, &t) || !port_maybe_covered(t.remote_port))
		return;
	rule = match_active(&t, &kind);
	if (!rule)
		return;
	/* Left on TCP: no stamp, which its handshake sees (a reused socket's
	 * stamp of an earlier connect() is taken back). Not a probe if its SYN
	 * carries data (Fast Open): its server end, made at the SYN, makes no
	 * state while the rule's connections are short, so it could not be
	 * claimed (the run ends by itself, MW_SHORT_FOR). */
	tp = sk ? bpf_skc_to_tcp_sock(sk) : NULL;
	if ((cfg & MW_CFG_GUARD) && short_skip(rule, !(tp && tp->fastopen_req))) {
		struct mw_sock_state *st = sk ? bpf_sk_storage_get(&mw_sk_state, sk, 0, 0) : NULL;

		if (st)
			st->own.flags &= ~MW_OWN_KNOWN;
		return;
	}
	/* Covered connections only, and only rules the monitor runs for. */
	if (sk && lat_since(rule->id, NULL)) {
		__u64 *at = bpf_sk_storage_get(&mw_sk_conn, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);

		if (at)
			*at = bpf_ktime_get_ns();
	}
	if (cfg & MW_CFG_GUARD)
		stamp_owner(skops);
}

SEC("sockops")
int mw_sockops(struct bpf_sock_ops *skops)
{
	struct mw_global_stats *gs;
	bool declined = false;
	struct tuple t;
	__u32 op = skops->op;

	if (op == BPF_SOCK_OPS_STATE_CB) {
		if (skops->args[0] == BPF_TCP_SYN_RECV && skops->args[1] == BPF_TCP_ESTABLISHED)
			on_fastopen_established(skops);
		else
			on_state_change(skops);
		return 1;
	}
	if (op == BPF_SOCK_OPS_TCP_CONNECT_CB) {
		on_connect(skops);
		return 1;
	}
	if (op == BPF_SOCK_OPS_TCP_LISTEN_CB) {
		drop_sock_state(skops->sk);
		if (config_flags() & MW_CFG_GUARD)
			stamp_listener(skops);
		return 1;
	}
	if (op != BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB && op != BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB)
		return 1;
	if (!load_tuple(skops, &t))
		return 1;
	gs = global_stats();
	if (gs)
		gs->established++;
	run_conn_chain(skops, &t, op, &declined);
	if (!declined)
		on_established(skops, &t, op);
	return 1;
}

/* End of the on_connection chain: every plugin continued. */
SEC("sockops")
int mw_conn_fin(struct bpf_sock_ops *skops)
{
	struct tuple t;
	__u32 op = skops->op;

	if (op != BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB && op != BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB)
		return 1;
	if (load_tuple(skops, &t))
		on_established(skops, &t, op);
	return 1;
}

/* ---- sk_msg ---- */

/*
 * Redirected bytes land in the peer's psock queue, which a reader drains before
 * its TCP receive queue. So a direction that carried payload on the TCP path
 * (written before the peer was in the map, while it was absent, or demoted by
 * the policy) may be redirected again only once the peer's reader consumed all
 * of it: the peer's reads publish its copied_seq (mw_dir.tcp_read, see
 * mw_recv_len), compared with this end's write_seq. Reads that bypass
 * recvmsg (splice, zero-copy receive) publish nothing: that direction then
 * stays on TCP.
 */

/* include/net/tcp.h */
#define TCP_NAGLE_OFF 1
#define TCP_NAGLE_CORK 2

/* Whether the sender lets TCP coalesce its small writes (Nagle, or cork). */
static __always_inline bool coalescing(struct tcp_sock *tp)
{
	__u8 nonagle = BPF_CORE_READ_BITFIELD(tp, nonagle);

	return !(nonagle & TCP_NAGLE_OFF) || (nonagle & TCP_NAGLE_CORK);
}

/* Whether this end writes with Nagle on and uncorked: on TCP, the tail of a
 * run of small writes leaves only once the peer acknowledged what went
 * before it (an uncork pushes a corked tail at once). */
static __always_inline bool nagle_only(struct tcp_sock *tp)
{
	__u8 nonagle = BPF_CORE_READ_BITFIELD(tp, nonagle);

	return !(nonagle & (TCP_NAGLE_OFF | TCP_NAGLE_CORK));
}

/* Whether the peer has sent to this end on the fast path (its requests, in
 * a request/response connection). While this end stays in the SOCKMAP, it
 * goes on doing so; out of it, its next request goes on TCP. */
static __always_inline bool peer_redirects(const struct mw_link *link, __u32 peer)
{
	return link->dir[peer & 1].redir;
}

/*
 * Whether TCP would hold the tail of this end's Nagle run for the peer's
 * delayed ACK, while the run (`run` messages so far) is short enough that
 * staying redirected costs less than that wait (MW_POLICY_DELACK). On plain TCP, a peer whose TCP answers
 * soon after it received (a request after a response) is in pingpong mode
 * (icsk_ack.pingpong, TCP_PINGPONG_THRESH 1), and acknowledges a small
 * segment only when its delayed-ACK timer fires, not at the read
 * (tcp_cleanup_rbuf). A peer that redirects its requests never enters it
 * (they pass no TCP), but TCP through this end's psock sends segments the
 * peer's ACK logic takes for full ones: in 1 MiB downloads in 1 KiB Nagle
 * writes, the client's delayed-ACK timer fired about every third download
 * that way (bpftrace, 2026-12-05). The peer's address is the hint
 * reader_busy reads, through the same untrusted cast: a wrong one could only
 * keep one run redirected longer, or move it sooner.
 */
static __always_inline bool tail_waits_ack(struct mw_link *link, __u32 peer, __u32 run, struct tcp_sock *tp)
{
	struct inet_connection_sock *icsk;

	if (run >= MW_POLICY_DELACK || !nagle_only(tp))
		return false;
	if (peer_redirects(link, peer))
		return true;
	icsk = bpf_core_cast((void *)link->sk[peer & 1], struct inet_connection_sock);
	return icsk && icsk->icsk_ack.pingpong;
}

/*
 * A demoted end that keeps streaming asks to leave the SOCKMAP. Its sk_msg
 * runs under its socket's lock, as does every redirect that queues into it
 * (bpf_tcp_ingress), so its psock queue cannot grow under this check. Park it
 * first (senders claim their bytes in mw_dir.redir, then keep off a parked
 * end; both sides use fetch-form atomics, so either the claim shows here or
 * the sender sees the flag); if every byte its peer claimed for it was read
 * (psock_rd) and its queue is empty, no redirected byte can reach its psock
 * any more and user space may delete its entry (mw_unlink), which sk_msg
 * itself may not. Otherwise unpark: a later check tries again.
 */
static __always_inline void park_self(struct mw_link *link, struct mw_sock_state *st, struct tcp_sock *tp)
{
	__u32 end = st->end & 1, peer = end ^ 1, redir;

	redir = __sync_fetch_and_or(&link->end_flags[end], MW_EF_PARKED);
	barrier_var(redir);
	redir = __sync_fetch_and_add(&link->dir[peer].redir, 0);
	if (!psock_pending((struct sock *)tp) && redir == st->psock_rd) {
		__sync_fetch_and_or(&link->dir[end].flags, MW_DIR_UNLINK_REQ);
		if (!request_park(MW_EV_UNLINK, link, st->link, end))
			unpark_unserved(link, end);
		return;
	}
	__sync_fetch_and_and(&link->end_flags[end], ~MW_EF_PARKED);
}

/*
 * Whether the peer's reader holds its socket lock (it is copying redirected
 * bytes out): a redirect now would sleep on that lock in bpf_tcp_ingress until
 * the copy ends, and on a VM the sender's vCPU may halt meanwhile, where TCP
 * hands the segment to the socket's backlog and goes on, and Nagle holds the
 * next writes back into one large segment while the reader is busy. The
 * address (mw_link.sk) is a hint read through an untrusted cast, which the
 * verifier guards against faults: it is set when the end joins the link and
 * the socket lives while the peer may redirect into it; a wrong value could
 * only send one message down the TCP path, which is always safe.
 */
static __always_inline bool reader_busy(struct mw_link *link, __u32 peer)
{
	struct sock *sk = bpf_core_cast((void *)link->sk[peer & 1], struct sock);

	return sk && sk->sk_lock.owned;
}

/* Whether direction `d`'s reader last read on another CPU than this
 * sender (mw_dir.rd_cpu, a hint: 0 before its first read). */
static __always_inline bool reader_elsewhere(const struct mw_dir *d)
{
	__u32 cpu = d->rd_cpu;

	return cpu && cpu != bpf_get_smp_processor_id() + 1;
}

/* Whether end `st` may leave the SOCKMAP (park_self): its reads are
 * counted exactly (one reader thread) and its reader does not ask
 * FIONREAD (which misses TCP bytes behind a psock while it leaves). */
static __always_inline bool may_leave(const struct mw_link *link, const struct mw_sock_state *st)
{
	return st->rd_pid != MW_RD_SHARED && !(link->end_flags[st->end & 1] & MW_EF_FIONREAD);
}

/*
 * Whether a stream of large writes (Nagle or not) should go around its
 * reader for this message: the reader holds its lock (reader_busy), or it runs on
 * another CPU than this sender and has redirected bytes still to read, so
 * it is copying them out or about to (woken by the last redirect). A
 * redirect then sleeps on that lock in bpf_tcp_ingress, and the wake-up
 * after it costs more than the redirect saves: TCP lets a sender and a
 * reader on two CPUs copy at once (the sender's segments wait in the
 * socket's backlog meanwhile). A reader on the sender's CPU (rd_cpu) cannot
 * copy while the sender runs (unless preempted holding its lock, which
 * reader_busy sees, as it sees the peer's own sender holding it): there
 * the redirect keeps its gain. A reader
 * of several threads publishes no psock reads: its bytes look unread, so
 * it counts as busy (TCP is always safe).
 */
static __always_inline bool reader_concurrent(struct mw_link *link, __u32 end)
{
	const struct mw_dir *d = &link->dir[end & 1];
	__u32 unread = d->redir - d->psock_read;

	/* Read before the untrusted cast: clang would otherwise merge these
	 * loads with the cast's, which the verifier refuses. */
	barrier_var(unread);
	if (reader_busy(link, end ^ 1))
		return true;
	return unread && reader_elsewhere(d);
}

/* sk_userlocks: a buffer size the program fixed (include/net/sock.h). */
#define MW_SOCK_SNDBUF_LOCK 1
#define MW_SOCK_RCVBUF_LOCK 2

/*
 * How far TCP would let this end's sender run ahead of the peer's reader at
 * most: the peer's receive buffer and this end's send buffer, each at the
 * size its program fixed (SO_RCVBUF, SO_SNDBUF: a program that bounds what
 * a connection may hold), else at the largest autotuning grows it to
 * (tcp_rmem[2], tcp_wmem[2] of their namespaces). Read through untrusted
 * casts (fault-guarded; the peer's address, see reader_busy, is live while
 * this end redirects into it: a wrong one could at worst demote this
 * direction, and TCP is always safe); nothing read: no bound.
 */
static __always_inline __u32 tcp_ahead_max(struct tcp_sock *tp, struct mw_link *link, __u32 peer)
{
	struct sock *psk = bpf_core_cast((void *)link->sk[peer & 1], struct sock);
	struct sock *sk = &tp->inet_conn.icsk_inet.sk;
	struct net *own = sk->__sk_common.skc_net.net;
	struct net *pnet = psk ? psk->__sk_common.skc_net.net : NULL;
	__u64 rmem, wmem;

	if (!own || !pnet)
		return ~0u;
	rmem = (psk->sk_userlocks & MW_SOCK_RCVBUF_LOCK) ? (__u32)psk->sk_rcvbuf
							 : (__u32)pnet->ipv4.sysctl_tcp_rmem[2];
	wmem = (sk->sk_userlocks & MW_SOCK_SNDBUF_LOCK) ? (__u32)sk->sk_sndbuf : (__u32)own->ipv4.sysctl_tcp_wmem[2];
	if (!rmem || !wmem || rmem + wmem > ~0u)
		return ~0u;
	return rmem + wmem;
}

/* Whether this message (`size`, of direction `d`'s run) is one of a write
 * so large that sk_msg passes it in chunks of MW_POLICY_HUGE or more, or
 * continues such writes: the run's earlier messages (run_bytes holds its
 * first MW_POLICY_RUN, this one included) averaged that much, as before
 * the tail chunk of a 600 KiB write; past MW_POLICY_RUN (goes_around, size
 * 0), its first MW_POLICY_RUN did. Its reader copies one chunk out while
 * the writer copies the next in, as on TCP (the redirect holds the
 * reader's lock only to queue it). */
static __always_inline bool huge_chunks(const struct mw_dir *d, __u32 size)
{
	__u32 run = d->run;

	if (size >= MW_POLICY_HUGE)
		return true;
	if (run > MW_POLICY_RUN)
		return d->run_bytes >= MW_POLICY_RUN * MW_POLICY_HUGE;
	return run > 1 && d->run_bytes - size >= (run - 1) * MW_POLICY_HUGE;
}

/* A stream that takes TCP for this message rather than wait for its
 * reader's lock: one of large writes (past MW_POLICY_RUN, averaging
 * MW_POLICY_SMALL or more, not huge_chunks) into a reader on another CPU
 * (reader_concurrent), or one TCP would coalesce (past MW_POLICY_COALESCE,
 * writes under a segment) into a reader busy copying out (reader_busy), but
 * not one whose tail TCP would hold for a delayed ACK before
 * MW_POLICY_DELACK (tail_waits_ack: going around would demote it). */
static __always_inline bool goes_around(struct mw_link *link, __u32 end, struct tcp_sock *tp)
{
	const struct mw_dir *d = &link->dir[end & 1];

	if (d->run <= MW_POLICY_RUN || huge_chunks(d, 0))
		return false;
	if (d->run_bytes >= MW_POLICY_RUN * MW_POLICY_SMALL)
		return !(d->flags & MW_DIR_KEEP) && reader_concurrent(link, end);
	return coalescing(tp) && d->run > MW_POLICY_COALESCE && d->run_bytes < MW_POLICY_RUN * tp->mss_cache &&
	       reader_busy(link, end ^ 1) && !tail_waits_ack(link, end ^ 1, d->run, tp);
}

/*
 * A write of MW_POLICY_LARGE or more in a run's first MW_POLICY_RUN messages
 * (goes_around judges the later ones) into a reader on another CPU that
 * still has this direction's redirected bytes to read: it is copying them
 * out, or about to, so the redirect waits for its lock, and sk_msg copies
 * the whole write in before the reader may copy any of it out, where TCP
 * lets both copy at once. Such a direction moves to TCP for good
 * (MW_DIR_STREAMED) at once, timed from then on (judge_streamed: where the
 * host's wake-ups cost more than the wait, the fast path comes back; and
 * where the rule's other connections found it faster, it stays,
 * keep_by_rule, in finish_msg): HTTP/2 responses of 64 KiB multiplexed over
 * 10 connections (h2load against nghttpd) come in runs of one to three
 * writes between the client's frames, so a run rarely passed
 * MW_POLICY_RUN, and each connection's responses stayed redirected at
 * 1.15-1.40x TCP's time. Only an end that may leave the SOCKMAP (one that
 * stays would send on TCP through its psock), not a reader of several
 * threads (its reads are not counted: its bytes always look unread), not
 * a reader that only holds its lock (nodelay_around_lock sends one
 * message around it), and not a Nagle writer (nagle_only): once its peer
 * answers on the fast path it stays in the SOCKMAP (policy_allows), so one
 * moved here at its first requests, before any answer, would send every
 * later one on TCP through its psock (memcached's 1 MiB sets from a Nagle
 * client took 1.5-1.7x TCP's time so, mode always 0.94-1.02x); after an
 * answer, TCP would hold its runs' tails for a delayed ACK (tail_waits_ack).
 * Nor the chunks of a write of MW_POLICY_HUGE or more (huge_chunks):
 * moved, such a direction paid the move (TCP through its psock until it
 * left the SOCKMAP) for nothing: 1 MiB requests in one nodelay write took
 * 395-410 us so, 310-361 us redirected (mode always as long).
 */
static __always_inline bool large_into_copying_reader(struct mw_link *link, const struct mw_sock_state *st,
						      __u32 size, struct tcp_sock *tp)
{
	const struct mw_dir *d = &link->dir[st->end & 1];
	__u32 unread;

	if (size < MW_POLICY_LARGE || d->run > MW_POLICY_RUN || (d->flags & (MW_DIR_RD_SHARED | MW_DIR_KEEP)) ||
	    huge_chunks(d, size))
		return false;
	unread = d->redir - d->psock_read;
	/* Both counters read once, here (as in reader_concurrent). */
	barrier_var(unread);
	return unread && reader_elsewhere(d) && may_leave(link, st) && !nagle_only(tp);
}

/*
 * A nodelay message that takes TCP rather than sleep on its peer's lock
 * (bpf_tcp_ingress takes it; TCP queues the segment to the peer's backlog
 * and goes on; the messages after it take TCP until the peer read it):
 * - a run's first message (an answer, or the next request after one) into
 *   a peer whose lock is held (reader_busy: its reader copying out, or its
 *   own sender in the middle of a write);
 * - a pipelined request: a later message of MW_POLICY_SMALL or more, sent
 *   before this end read what its peer answered (bytes redirected to it
 *   still unread; not known for a reader of several threads, which counts
 *   no psock reads), into a peer whose lock is held. A stream without
 *   answers keeps the fast path until reader_concurrent may judge it past
 *   MW_POLICY_RUN (large writes going around in a stream's first messages
 *   made a 64 KiB stream on two CPUs 0.3-0.5x TCP: TCP through the psock).
 * Both sides of a burst of 16 KiB uploads answered with 64 B slept there
 * (about four times per burst each): 1.6x TCP's time, 1.3x with this.
 * Counted as fallback_reader_busy; past MW_POLICY_COALESCE, as for
 * goes_around, the message demotes the rest of its run instead
 * (demotions_around).
 */
static __always_inline bool nodelay_around_lock(struct mw_link *link, __u32 end, __u32 size, struct tcp_sock *tp)
{
	const struct mw_dir *in = &link->dir[(end ^ 1) & 1];
	__u32 unread;

	if (coalescing(tp))
		return false;
	/* Past a run's first message: only a pipelined request (its counters
	 * read only then, on the per-message path). */
	if (link->dir[end & 1].run != 1) {
		if (size < MW_POLICY_SMALL || (in->flags & MW_DIR_RD_SHARED) ||
		    (link->dir[end & 1].flags & MW_DIR_KEEP))
			return false;
		unread = in->redir - in->psock_read;
		/* Read before the untrusted cast (see reader_concurrent). */
		barrier_var(unread);
		if (!unread)
			return false;
	}
	return reader_busy(link, end ^ 1);
}

/* A run TCP would gather into fewer, larger segments than its writes:
 * Nagle or cork on, the first MW_POLICY_RUN writes averaging under
 * MW_POLICY_BATCH bytes. */
static __always_inline bool batched(const struct mw_dir *d, struct tcp_sock *tp)
{
	return d->run_bytes < MW_POLICY_RUN * MW_POLICY_BATCH && coalescing(tp);
}

/* Moves direction `d` (this end's) to the TCP path for the rest of its
 * run; the caller counts the reason. Its messages then skip the link but
 * at checks (finish_msg), where it may leave the SOCKMAP or be promoted. */
static __always_inline void demote(struct mw_dir *d, struct mw_sock_state *st)
{
	/* Moved for another reason (its reader behind, coalescing, ...): the
	 * measured verdict holds no more; the end may leave the SOCKMAP as
	 * before, and the next look judges again. */
	if (d->flags & MW_DIR_KEEP)
		__sync_fetch_and_and(&d->flags, ~MW_DIR_KEEP);
	__sync_fetch_and_or(&d->flags, MW_DIR_TCP);
	st->flags |= MW_SOCK_DEMOTED;
	st->skipped = 0;
}

/* demote() for a message that would have gone around its reader
 * (demotions_around); `streamed`: for good (MW_DIR_STREAMED). */
static __always_inline void demote_around(struct mw_dir *d, struct mw_sock_state *st, struct mw_rule_stats *rs,
					  bool streamed)
{
	if (streamed)
		__sync_fetch_and_or(&d->flags, MW_DIR_STREAMED | MW_DIR_TIMED);
	demote(d, st);
	if (rs) {
		rs->demotions_around++;
		rs->policy_tcp_msgs++;
	}
}

/* An average that moves a quarter of the way to each new sample
 * (`avg` 0: none yet). */
static __always_inline __u32 rate_avg(__u32 avg, __u32 rate)
{
	return avg ? (avg / 4) * 3 + rate / 4 : rate;
}

/*
 * A look at direction `o` (the one this end reads), timed (MW_DIR_TIMED:
 * its large writes moved it to TCP for good once, or its rule's rates kept
 * it redirected), from this end's send: once this end's reader read
 * MW_POLICY_HUGE bytes of it since the last look,
 * the rate over that span is the path's the direction took (TCP or not, at
 * this moment), and the faster path takes its next exchanges: TCP lets a
 * writer and a reader on two CPUs copy at once where a redirect waits for
 * the reader's lock, but where the host's wake-ups cost more than that
 * wait the fast path still wins (1 MiB downloads in 16 KiB nodelay writes:
 * 1.05x TCP's time with STREAMED alone, 0.79x in mode always, on one host;
 * nginx's 1 MiB responses 1.3-1.4x redirected on another). Every
 * MW_POLICY_PROBE looks of the connection, or of its rule, the other path
 * is tried (a switch costs the untimed span after it, MW_DIR_SWITCHED). Only
 * this end writes the timing fields (its sends hold its socket lock);
 * the flags change by atomic operations. The fast path again means
 * clearing MW_DIR_STREAMED (the peer may promote at its next exchange and
 * be asked back into the SOCKMAP, ask_relink); TCP again, clearing
 * MW_DIR_KEEP (its next large writes into a reader copying out demote it).
 */
static __always_inline void judge_streamed(struct mw_dir *o, __u32 rule_id)
{
	__u32 read = o->tcp_read + o->psock_read, now, dt, rate, fast_rate, tcp_rate, looks = 0;
	struct mw_short *r;
	bool fast, want_fast;
	__u64 per;

	if (o->t0 && read - o->r0 < MW_POLICY_HUGE)
		return;
	now = (__u32)(bpf_ktime_get_ns() >> 10) | 1;
	dt = now - o->t0;
	fast = !(o->flags & MW_DIR_TCP);
	if (o->flags & MW_DIR_SWITCHED) {
		/* The first exchange after a switch may have run on both
		 * paths (a relink lands mid-response): not timed. */
		__sync_fetch_and_and(&o->flags, ~MW_DIR_SWITCHED);
	} else if (!fast && (o->flags & MW_DIR_KEEP)) {
		/* Tried, but still on TCP a whole span later (its end never
		 * came back, or its reader never caught up): TCP for good
		 * again, untimed; the next look tries once more. */
		__sync_fetch_and_or(&o->flags, MW_DIR_STREAMED);
		__sync_fetch_and_and(&o->flags, ~MW_DIR_KEEP);
	} else if (o->t0 && dt && dt <= MW_POLICY_SPAN) {
		/* Spans longer than MW_POLICY_SPAN (idle connections, or a
		 * clock that wrapped its 32 bits) time the application. */
		per = ((__u64)(read - o->r0) << 10) / dt;
		rate = per > 0xffffffffULL ? 0xffffffffU : (__u32)per ?: 1;
		r = bpf_map_lookup_elem(&mw_short, &rule_id);
		if (fast)
			o->rate_fast = rate_avg(o->rate_fast, rate);
		else
			o->rate_tcp = rate_avg(o->rate_tcp, rate);
		fast_rate = o->rate_fast;
		tcp_rate = o->rate_tcp;
		/* The rule's connections share what they measured (a hint: racy
		 * updates only blur it); a path this connection has not timed
		 * yet is judged by the rule's rate. */
		if (r) {
			if (fast)
				r->rate_fast = rate_avg(r->rate_fast, rate);
			else
				r->rate_tcp = rate_avg(r->rate_tcp, rate);
			looks = ++r->looks;
			if (!fast_rate)
				fast_rate = r->rate_fast;
			if (!tcp_rate)
				tcp_rate = r->rate_tcp;
		}
		o->timed++;
		/* Not measured yet: tried (TCP always is, first). The rule's
		 * looks probe too: its connections may each be short. */
		want_fast = !fast_rate || (tcp_rate && fast_rate > tcp_rate);
		if (!(o->timed % MW_POLICY_PROBE) || (looks && !(looks % MW_POLICY_PROBE)))
			want_fast = !fast;
		if (want_fast != fast)
			__sync_fetch_and_or(&o->flags, MW_DIR_SWITCHED);
		if (want_fast && !(o->flags & MW_DIR_KEEP))
			__sync_fetch_and_or(&o->flags, MW_DIR_KEEP);
		if (want_fast && (o->flags & MW_DIR_STREAMED))
			__sync_fetch_and_and(&o->flags, ~MW_DIR_STREAMED);
		if (!want_fast && (o->flags & MW_DIR_KEEP))
			__sync_fetch_and_and(&o->flags, ~MW_DIR_KEEP);
	}
	o->t0 = now;
	o->r0 = read;
}

/* Whether rule `rule_id`'s timed directions found the fast path faster for
 * large writes into a reader copying out (both paths measured): a new
 * direction that would move to TCP for good (MW_DIR_STREAMED) stays
 * redirected instead, timed (MW_DIR_TIMED | MW_DIR_KEEP), so its own looks
 * correct the rule's verdict. */
static __always_inline bool rule_prefers_fast(__u32 rule_id)
{
	struct mw_short *r = bpf_map_lookup_elem(&mw_short, &rule_id);

	return r && r->rate_tcp && r->rate_fast > r->rate_tcp;
}

/* A direction about to move to TCP for good (MW_DIR_STREAMED), never timed
 * yet, of a rule that found the fast path faster: it stays redirected,
 * timed. */
static __always_inline bool keep_by_rule(struct mw_link *link, struct mw_dir *d, const struct mw_sock_state *st)
{
	/* Only a direction judge_streamed can look at (one reader thread)
	 * and whose end may leave the SOCKMAP, as for MW_DIR_STREAMED. */
	if ((d->flags & (MW_DIR_TIMED | MW_DIR_RD_SHARED)) || !may_leave(link, st) ||
	    !rule_prefers_fast(st->rule_id))
		return false;
	__sync_fetch_and_or(&d->flags, MW_DIR_TIMED | MW_DIR_KEEP);
	return true;
}

/* The adaptive policy for one message of a direction that may be redirected
 * (mw_dir). Returns false when the message takes the TCP path. This end's
 * sk_msg (under its socket lock) decides its own mw_dir; the peer resets
 * `run` (a race that at worst delays one decision; mw_recv_len does, at this
 * end's read, for a peer whose sends pass no sk_msg), and mw_unlink and
 * mw_park change flags too, so flags change only by atomic operations. */
static __always_inline bool policy_allows(struct sk_msg_md *msg, struct mw_link *link, struct mw_sock_state *st,
					  struct tcp_sock *tp, struct mw_rule_stats *rs)
{
	__u32 size = msg->size;
	struct mw_dir *d = &link->dir[st->end & 1];
	struct mw_dir *o = &link->dir[(st->end ^ 1) & 1];
	__u32 run, skipped, unread = 0;
	bool behind = false, delack = false, coalesce, small;

	if ((o->flags & (MW_DIR_TIMED | MW_DIR_RD_SHARED)) == MW_DIR_TIMED)
		judge_streamed(o, st->rule_id);
	if (o->run)
		o->run = 0; /* this message answers the peer's */
	run = d->run + 1;
	d->run = run;
	if (d->flags & MW_DIR_TCP) {
		/* Messages sent on TCP without a check (this one may be in the count). */
		skipped = st->skipped % MW_POLICY_CHECK ? st->skipped : st->skipped - 1;
		if (st->skipped == 0)
			skipped = 0;
		st->skipped = 0;
		/* The peer sent since the last check (a new exchange), and read
		 * every TCP byte: promote; not a direction that streamed large
		 * writes into a reader copying out (MW_DIR_STREAMED). */
		if ((run == 1 || (d->flags & MW_DIR_KEEP)) && d->tcp_read == tp->write_seq &&
		    !(d->flags & MW_DIR_STREAMED)) {
			/* A direction judge_streamed wants back (MW_DIR_KEEP)
			 * at any look once every TCP byte was read: a stream
			 * whose reader seldom answers has few run starts. */
			__sync_fetch_and_and(&d->flags, ~MW_DIR_TCP);
			st->flags &= ~MW_SOCK_DEMOTED;
			if (run == 1)
				d->run_bytes = size; /* this message starts the new run */
			if (rs) {
				rs->promotions++;
				rs->policy_tcp_msgs += skipped;
			}
			return true;
		}
		st->flags |= MW_SOCK_DEMOTED;
		if (rs)
			rs->policy_tcp_msgs += skipped + 1;
		/* Still streaming: leave the SOCKMAP, so that TCP is plain
		 * TCP again (not an end whose reader asks FIONREAD: while it
		 * leaves, its peer's bytes come on TCP into a socket that
		 * still has a psock, which FIONREAD does not count, and each
		 * such read would wait for a wake-up, MW_EF_WAKE);
		 * MW_POLICY_UNLINK checks after a demotion at
		 * MW_POLICY_COALESCE, at the first one after a demotion at a
		 * later check (a reader-behind one, or a batched run whose
		 * reader caught up: both streamed long before). Not a Nagle
		 * end whose peer redirects to it (its answers) while its run
		 * is under MW_POLICY_ANSWER: out of the SOCKMAP, the peer's
		 * next request would go on TCP right after an answer came on
		 * TCP, which puts the peer's TCP in pingpong mode, and the
		 * next answer's tail would wait for its delayed ACK
		 * (tail_waits_ack); TCP through the psock keeps those
		 * requests redirected. That holds for a MW_DIR_STREAMED one
		 * too: its answers stay on TCP through its psock (a 16 MiB
		 * download in 16 KiB Nagle writes took 0.22x TCP's time so,
		 * 0.90x out of the SOCKMAP). */
		if (((d->flags & MW_DIR_STREAMED) ||
		     (run >= MW_POLICY_RUN + MW_POLICY_UNLINK &&
		      (run < MW_POLICY_COALESCE || run >= MW_POLICY_COALESCE + MW_POLICY_UNLINK))) &&
		    !(d->flags & (MW_DIR_UNLINK_REQ | MW_DIR_UNLINKED | MW_DIR_KEEP)) && may_leave(link, st) &&
		    !(run < MW_POLICY_ANSWER && nagle_only(tp) && peer_redirects(link, st->end ^ 1)))
			park_self(link, st, tp);
		return false;
	}
	if (run == 1)
		d->run_bytes = 0;
	/* Mode always, or a reader whose FIONREAD would miss TCP bytes. */
	if ((link->flags & MW_LINK_FIXED) || (link->end_flags[(st->end ^ 1) & 1] & MW_EF_FIONREAD))
		return true;
	/* run_bytes holds the run's first MW_POLICY_RUN messages. */
	if (run <= MW_POLICY_RUN)
		d->run_bytes += size;
	small = d->run_bytes < MW_POLICY_RUN * MW_POLICY_SMALL;
	if (run > MW_POLICY_RUN) {
		/* A stream: look now and then whether its reader keeps up.
		 * Small writes may be MW_POLICY_BEHIND messages behind (runs
		 * TCP would batch are judged at MW_POLICY_COALESCE: a burst
		 * until then); large ones as many bytes as TCP would let the
		 * sender run ahead (the psock queue has no bound). */
		unread = d->redir - d->psock_read;
		if (run != MW_POLICY_COALESCE && (run % MW_POLICY_CHECK))
			return true;
	}
	/* A batched run of small writes moves to TCP; one of larger writes
	 * once its reader keeps up, at MW_POLICY_COALESCE or any check after
	 * it (a reader behind at one moment may catch up). Whether a reader
	 * of several threads keeps up is not known (its reads are not
	 * counted): TCP, which costs such a run at most the fast path's gain,
	 * never a loss. Counted as coalescing even when its reader is behind
	 * too (the reason that would have moved it anyway). */
	coalesce = run >= MW_POLICY_COALESCE && batched(d, tp) &&
		   (small || (((d->flags & MW_DIR_RD_SHARED) || unread <= MW_POLICY_KEEPUP) &&
			      !(d->flags & MW_DIR_KEEP)));
	/* Not while TCP would hold the run's tail for a delayed ACK: such a
	 * run may then fall as far behind as TCP would let it, no further. A
	 * reader of several threads, whose reads are not counted, is never
	 * taken for behind (as for nodelay streams): its queue is bounded by
	 * the MW_POLICY_DELACK messages alone. Most programs read a socket
	 * from more than one thread over its life (a pool, a runtime's
	 * scheduler): without them this would reach few. */
	if (coalesce && tail_waits_ack(link, st->end ^ 1, run, tp)) {
		coalesce = false;
		delack = true;
	}
	if (!coalesce && run > MW_POLICY_RUN && !(run % MW_POLICY_CHECK) && !(d->flags & MW_DIR_RD_SHARED) &&
	    !(run < MW_POLICY_COALESCE && batched(d, tp)))
		behind = (!small || delack) ? unread > tcp_ahead_max(tp, link, st->end ^ 1)
					    : (__u64)unread * MW_POLICY_RUN >= (__u64)MW_POLICY_BEHIND * d->run_bytes;
	if (behind || coalesce) {
		demote(d, st);
		if (rs) {
			if (behind)
				rs->demotions_behind++;
			else
				rs->demotions++;
			rs->policy_tcp_msgs++;
		}
		return false;
	}
	return true;
}

/* The host's decision for a message every plugin continued. */
static __always_inline int finish_msg(struct sk_msg_md *msg, struct bpf_sock *sk, struct mw_sock_state *st)
{
	struct mw_rule_stats *rs;
	struct tcp_sock *tp;
	struct mw_link *link;
	__u32 end = st->end & 1, peer = end ^ 1, size = msg->size, claimed, pos, peer_flags;
	__u64 id = st->link;
	bool may_go_around;

	/* A demoted direction: TCP, and only now and then a look at the link. */
	if ((st->flags & MW_SOCK_DEMOTED) && !st->read && (++st->skipped % MW_POLICY_CHECK))
		return SK_PASS;
	st->read = 0;
	rs = rule_stats(st->rule_id);
	link = link_at(st->slot, id);
	if (link && (link->flags & MW_LINK_HIT))
		return SK_DROP; /* being reset: more bytes would only be lost */
	if (!link || (link->flags & MW_LINK_POISONED) || !(link->end_flags[peer] & MW_EF_TARGET) ||
	    (link->end_flags[end] & MW_EF_NOSEND)) {
		if (rs)
			rs->fb_no_peer++;
		return SK_PASS;
	}
	/* Only TCP sockets have mw_sk_state: a cast the verifier inlines
	 * rather than a helper call on every message. */
	tp = bpf_core_cast(sk, struct tcp_sock);
	if (!tp)
		return SK_PASS;
	if (!policy_allows(msg, link, st, tp, rs))
		return SK_PASS;
	/* The peer is leaving the SOCKMAP or out of it: this message is
	 * its cue to come back (the other end talks again). */
	if (*(volatile __u32 *)&link->end_flags[peer] & MW_EF_PARKED) {
		ask_relink(link, id, peer);
		if (rs)
			rs->fb_no_peer++;
		return SK_PASS;
	}
	/* Whatever sent this direction's bytes on TCP (the peer not ready yet,
	 * the policy, a plugin's MW_BYPASS): redirect again only once the peer
	 * read all of them. */
	if (link->dir[end].tcp_read != tp->write_seq) {
		if (rs)
			rs->fb_tcp_path++;
		return SK_PASS;
	}
	/* Mode always, and a reader whose FIONREAD would miss TCP bytes, wait
	 * for the reader's lock: none of the below. */
	may_go_around = !(link->flags & MW_LINK_FIXED) && !(link->end_flags[peer] & MW_EF_FIONREAD);
	/* A large write early in a run into a reader copying out on another
	 * CPU: the rest of the direction on TCP, as past MW_POLICY_RUN; but
	 * where its rule measured the fast path faster, redirected, timed
	 * (keep_by_rule). */
	if (may_go_around && large_into_copying_reader(link, st, size, tp)) {
		if (keep_by_rule(link, &link->dir[end], st))
			goto redirect;
		demote_around(&link->dir[end], st, rs, true);
		return SK_PASS;
	}
	/* A stream into a reader copying out, or about to (goes_around), or a
	 * nodelay answer or pipelined request into a peer holding its lock
	 * (nodelay_around_lock): TCP for this message rather than wait for
	 * that lock. */
	if (may_go_around && (goes_around(link, end, tp) || nodelay_around_lock(link, end, size, tp))) {
		/* Past MW_POLICY_COALESCE without a reply, a stream whose reader
		 * copies at its own pace, or past MW_POLICY_RUN one of large
		 * writes into a reader on another CPU (one on this CPU cannot
		 * copy while this end writes, unless preempted holding its
		 * lock: there only this message goes around, and the fast
		 * path keeps its 2x): the rest of the run on TCP, out of the SOCKMAP
		 * (park_self at a later check; a Nagle end whose peer
		 * redirects to it stays in, see policy_allows). Going around now and then
		 * while in it would be TCP through a psock, which
		 * (tcp_bpf_push) sends each page fragment as its own segment:
		 * half the size of plain TCP's on loopback, twice the packets,
		 * and under BBR's pacing, segments reordered across CPUs.
		 * Large writes into a reader on another CPU stay on TCP for
		 * good (MW_DIR_STREAMED): sk_msg copies a whole write in
		 * before the reader may copy any of it out, where TCP lets
		 * both copy at once; coming back at each exchange cost nginx's
		 * 1 MiB responses (32 KiB writes) 1.3-1.4x TCP's time, 1.0x
		 * without. On a host where the redirect wins even so, the
		 * timed exchanges bring it back (judge_streamed), or the
		 * rule's verdict keeps it (keep_by_rule). */
		struct mw_dir *d = &link->dir[end];
		bool large = d->run > MW_POLICY_RUN && d->run_bytes >= MW_POLICY_RUN * MW_POLICY_SMALL &&
			     !(d->flags & MW_DIR_KEEP) && reader_elsewhere(d);

		if (large && keep_by_rule(link, d, st))
			goto redirect;
		if (d->run > MW_POLICY_COALESCE || large) {
			/* Only an end that may leave the SOCKMAP: one that
			 * stays in would be TCP through its psock for good
			 * (but for a Nagle end whose peer redirects to it,
			 * which is marked and stays in by choice: its
			 * answers then keep their peer's requests off TCP). */
			demote_around(d, st, rs, large && may_leave(link, st));
			return SK_PASS;
		}
		if (rs)
			rs->fb_reader_busy++;
		return SK_PASS;
	}
redirect:
	/* Claim the bytes, then look again whether the peer is leaving: its
	 * park_self sets MW_EF_PARKED, then reads `redir`, both with fetch-form
	 * atomics; so either it sees this claim and waits, or this sees the flag. The
	 * claim is a fetch form too (barrier_var keeps its result used, so
	 * clang does not emit the plain BPF_ADD, unordered on arm64): fully
	 * ordered on every JIT, so the plain load of the flags after it cannot
	 * be satisfied before the claim is visible. */
	claimed = __sync_fetch_and_add(&link->dir[end].redir, size);
	barrier_var(claimed);
	pos = link->slot * 2 + peer;
	peer_flags = *(volatile __u32 *)&link->end_flags[peer];
	if ((peer_flags & MW_EF_PARKED) ||
	    ((peer_flags & MW_EF_TGTMAP) ? bpf_msg_redirect_map(msg, &mw_tgtmap, pos, BPF_F_INGRESS)
					  : bpf_msg_redirect_map(msg, &mw_sockmap, pos, BPF_F_INGRESS)) != SK_PASS) {
		/* Peer absent or leaving: this message takes the TCP path. */
		__sync_fetch_and_sub(&link->dir[end].redir, size);
		if (rs)
			rs->fb_no_peer++;
		return SK_PASS;
	}
	if (rs) {
		rs->msgs++;
		rs->bytes += size;
	}
	st->tx_msgs++;
	st->tx_bytes += size;
	if ((!(link->flags & MW_LINK_LONG) && (st->tx_msgs >= MW_SHORT_MSGS || st->tx_bytes >= MW_SHORT_BYTES)) ||
	    !(st->tx_msgs % MW_SHORT_AGAIN))
		conn_long(link);
	return SK_PASS;
}

static __always_inline struct mw_sock_state *msg_state(struct bpf_sock *sk)
{
	struct mw_global_stats *gs;
	struct mw_sock_state *st;

	if (!sk)
		return NULL;
	st = bpf_sk_storage_get(&mw_sk_state, sk, 0, 0);
	if (!st || !st->link) {
		gs = global_stats();
		if (gs)
			gs->no_state++;
		return NULL;
	}
	return st;
}

SEC("sk_msg")
int mw_sk_msg(struct sk_msg_md *msg)
{
	struct bpf_sock *sk = msg->sk;
	struct mw_sock_state *st;
	bool every = false;
	__u64 since;
	__u32 gen;

	st = msg_state(sk);
	if (!st || !sk)
		return SK_PASS;
	since = lat_since(st->rule_id, &every);
	if (since)
		lat_send(st, since, every);
	if (mw_active_chain(MW_HOOK_MESSAGE, &gen)) {
		struct mw_sk_chain *ch = bpf_sk_storage_get(&mw_sk_chain, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);

		if (!ch)
			return finish_msg(msg, sk, st);
		ch->rule_id = st->rule_id;
		ch->flags = mw_sock_chain_set(0, gen, 0);
		bpf_tail_call(msg, &mw_ch_msg, gen * MW_CHAIN_MAX);
		if (mw_chain_fails_closed(gen, MW_HOOK_MESSAGE, 0))
			return SK_DROP;
	}
	return finish_msg(msg, sk, st);
}

/* End of the on_message chain: every plugin continued. */
SEC("sk_msg")
int mw_msg_fin(struct sk_msg_md *msg)
{
	struct bpf_sock *sk = msg->sk;
	struct mw_sock_state *st = msg_state(sk);

	if (!st || !sk)
		return SK_PASS;
	return finish_msg(msg, sk, st);
}

/* ---- the reader guard at run time ---- */

/* Withdraws an end as a redirect target (atomically: senders read the flags
 * without locks); returns the end's flags before. */
static __always_inline __u32 withdraw(struct mw_link *link, __u32 end, __u32 reason)
{
	__u32 old = __sync_fetch_and_and(&link->end_flags[end & 1], ~MW_EF_TARGET);

	__sync_fetch_and_or(&link->end_flags[end & 1], reason);
	return old;
}

/* This end read bytes its peer sent on TCP without passing the policy: the
 * exchange is new. This end's run ends, and if the policy took it out of the
 * SOCKMAP it goes back (the relink the peer's sk_msg asks for otherwise). */
static __always_inline void answered_on_tcp(struct mw_link *link, struct mw_sock_state *st)
{
	__u32 end = st->end & 1;

	if (link->dir[end].run)
		link->dir[end].run = 0;
	ask_relink(link, st->link, end);
}

/* Records how executable `exe` reads the service of covered socket `sk`
 * (struct mw_reader_key). */
static __always_inline void reader_seen(struct sock *sk, const struct mw_sock_state *st,
					const struct mw_exe_key *exe, __u32 bit)
{
	struct inet_sock *inet = bpf_core_cast(sk, struct inet_sock);
	struct mw_reader_key rk = {};
	__u32 *flags;

	rk.exe = *exe;
	rk.netns = sk->__sk_common.skc_net.net->net_cookie;
	rk.end = st->end & 1;
	/* Not skc_num: a closed socket's (TCP_CLOSE) is 0, and the first read
	 * of a short exchange can come after both FINs. */
	rk.port = bpf_ntohs(rk.end == MW_END_CLIENT ? sk->__sk_common.skc_dport : inet->inet_sport);
	flags = bpf_map_lookup_elem(&mw_readers, &rk);
	if (!flags) {
		bpf_map_update_elem(&mw_readers, &rk, &bit, BPF_NOEXIST);
		flags = bpf_map_lookup_elem(&mw_readers, &rk);
	}
	if (flags && !(*flags & bit))
		__sync_fetch_and_or(flags, bit);
}

/* Every read of a covered socket: blocking or not, and by which executable. */
SEC("tp_btf/sock_recv_length")
int BPF_PROG(mw_recv_len, struct sock *sk, int ret, int flags)
{
	struct mw_service_key svc = {};
	struct mw_sock_state *st;
	struct mw_exe_key exe = {};
	struct tcp_sock *tp;
	struct mw_link *link;
	__u32 bit, tgid, seq, pid, old, peer_dir, cpu;
	__u64 id;
	bool fast = false;

	st = bpf_sk_storage_get(&mw_sk_state, sk, 0, 0);
	if (!st || !(st->flags & MW_SOCK_END))
		return 0;
	id = bpf_get_current_pid_tgid();
	if (ret < 0 && ret != -EAGAIN)
		return 0;
	/* How far this end's reader consumed its TCP queue: the peer's policy
	 * promotes its direction only once it is all read. Reads of redirected
	 * bytes do not move copied_seq, so the fast path publishes nothing. */
	if (st->link && ret > 0 && !(flags & MSG_PEEK)) {
		/* Only TCP sockets have mw_sk_state: a cast the verifier inlines
		 * (no helper call on every read). */
		tp = bpf_core_cast(sk, struct tcp_sock);
		pid = (__u32)id;
		/* Counting psock reads needs one reader at a time (below); out of
		 * band and error-queue reads move no copied_seq either: ambiguous. */
		peer_dir = (st->end ^ 1) & 1;
		if (st->rd_pid != MW_RD_SHARED) {
			if (flags & (MSG_OOB | MSG_ERRQUEUE)) {
				old = MW_RD_SHARED;
			} else if (st->rd_pid != pid) {
				old = __sync_val_compare_and_swap(&st->rd_pid, 0, pid);
				old = old && old != pid ? MW_RD_SHARED : pid;
			} else {
				old = pid;
			}
			if (old == MW_RD_SHARED) {
				st->rd_pid = MW_RD_SHARED;
				link = link_of_sk(st, sk);
				if (link)
					__sync_fetch_and_or(&link->dir[peer_dir].flags, MW_DIR_RD_SHARED);
			}
		}
		if (tp) {
			seq = tp->copied_seq;
			barrier_var(seq);
			fast = seq == st->rd_pub && st->slot != MW_NO_SLOT;
			/* Where this reader runs, for the peer's policy
			 * (reader_concurrent): written only when it moved. */
			link = link_of_sk(st, sk);
			cpu = bpf_get_smp_processor_id() + 1;
			if (link && link->dir[peer_dir].rd_cpu != cpu)
				link->dir[peer_dir].rd_cpu = cpu;
			/* tcp_bpf_recvmsg reads either the psock queue or the TCP
			 * queue: a read that left copied_seq alone took redirected
			 * bytes. Two concurrent readers could miscount; such a
			 * socket (MW_RD_SHARED) never leaves the SOCKMAP. */
			if (seq == st->rd_pub && st->rd_pid != MW_RD_SHARED) {
				st->psock_rd += ret;
				if (link)
					link->dir[peer_dir].psock_read = st->psock_rd;
			}
			if (seq != st->rd_pub) {
				if (link) {
					link->dir[peer_dir].tcp_read = seq;
					/* A peer whose messages never reach the policy
					 * (no sk_msg in mw_tgtmap, or this end no
					 * target) answered on TCP: what the peer's
					 * sk_msg would do happens here. */
					if ((link->end_flags[peer_dir] & MW_EF_TGTMAP) ||
					    !(link->end_flags[st->end & 1] & MW_EF_TARGET))
						answered_on_tcp(link, st);
				}
				st->rd_pub = seq;
			}
		}
	}
	if (ret > 0 && !(flags & MSG_PEEK)) {
		bool every = false;
		__u64 since = lat_since(st->rule_id, &every);

		if (since)
			lat_recv(st, fast, since, every);
	}
	if ((st->flags & MW_SOCK_DEMOTED) && ret > 0 && !st->read)
		st->read = 1;
	/* Who reads, and how: once per process and way of reading. */
	bit = (!(flags & MSG_DONTWAIT) && !(sock_file_flags(sk) & O_NONBLOCK)) ? MW_EXE_SEEN_BLOCKING
										  : MW_EXE_SEEN_NONBLOCKING;
	tgid = id >> 32;
	if (st->rd_tgid == tgid && (st->rd_seen & bit) && !st->learn)
		return 0;
	if (!(config_flags() & MW_CFG_GUARD) || !current_exe(&exe))
		return 0;
	if (st->rd_tgid != tgid) {
		st->rd_tgid = tgid;
		st->rd_seen = 0;
	}
	st->rd_seen |= bit;
	exe_seen(&exe, bit);
	reader_seen(sk, st, &exe, bit);
	if (!bpf_map_lookup_elem(&mw_exe_class, &exe))
		request_classify(&exe, tgid);
	if (st->learn) {
		struct mw_service v = { .exe = exe, .flags = MW_SVC_LEARNED };
		struct mw_service *had;

		svc.netns = sk->__sk_common.skc_net.net->net_cookie;
		svc.port = st->learn & 0xffff;
		svc.family = sk->__sk_common.skc_family;
		/* Never over another's: a program differing from the entry's
		 * marks it mixed. */
		if (bpf_map_update_elem(&mw_services, &svc, &v, BPF_NOEXIST)) {
			had = bpf_map_lookup_elem(&mw_services, &svc);
			if (had)
				service_heard(had, &exe, 0);
		}
		st->learn = 0;
	}
	return 0;
}

/* The socket behind a file descriptor of the current task (read-only view),
 * or NULL if the descriptor is not a socket. */
static __always_inline struct sock *fd_sock(__u32 fd)
{
	struct task_struct *task = bpf_get_current_task_btf();
	struct files_struct *files = task->files;
	struct fdtable *fdt;
	struct file **fds;
	struct file *f = NULL;
	struct inode *inode;
	struct socket *sock;

	if (!files)
		return NULL;
	fdt = files->fdt;
	if (!fdt || fd >= fdt->max_fds)
		return NULL;
	fds = fdt->fd;
	if (bpf_probe_read_kernel(&f, sizeof(f), &fds[fd]) || !f)
		return NULL;
	f = bpf_rdonly_cast(f, bpf_core_type_id_kernel(struct file));
	inode = f->f_inode;
	if (!inode || (inode->i_mode & S_IFMT) != S_IFSOCK)
		return NULL;
	sock = bpf_rdonly_cast(f->private_data, bpf_core_type_id_kernel(struct socket));
	if (!sock)
		return NULL;
	return sock->sk;
}

/* The covered socket behind a file descriptor of the current task (its
 * mw_cookies entry, or NULL), with its address and cookie. */
static __always_inline struct mw_cookie_val *covered_fd(__u32 fd, struct sock **skp, __u64 *cookie)
{
	struct sock *sk = fd_sock(fd);

	if (!sk)
		return NULL;
	*skp = sk;
	*cookie = sk->__sk_common.skc_cookie.counter;
	return bpf_map_lookup_elem(&mw_cookies, cookie);
}

/* Tells user space to reset a hit connection (MW_EV_SPLICE_HIT,
 * MW_EV_URGENT_HIT): the socket `sk` (cookie `cookie`, end `end` of link
 * `id`) of the calling thread, with `pending` redirected bytes unread. */
static __always_inline void emit_hit(__u32 type, struct sock *sk, __u64 cookie, struct mw_link *link, __u64 id,
				     __u32 end, const struct mw_exe_key *exe, __u32 pending)
{
	struct mw_event ev = {};

	ev.type = type;
	ev.pid = (__u32)bpf_get_current_pid_tgid();
	ev.tgid = bpf_get_current_pid_tgid() >> 32;
	bpf_get_current_comm(ev.comm, sizeof(ev.comm));
	ev.exe = *exe;
	ev.link = id;
	ev.end = end;
	ev.cookie = cookie;
	ev.peer_cookie = link->cookie[end ^ 1];
	ev.netns = sk->__sk_common.skc_net.net->net_cookie;
	ev.pending = pending;
	fill_event_link(&ev, link);
	emit(&ev);
}

/* splice(fd_in = a socket): the executable splices. If fd_in is a covered
 * socket, it stops being a target before the kernel reads it; redirected
 * bytes already waiting there are invisible to splice: a hit. */
static __always_inline void on_splice(__u32 fd)
{
	struct mw_cookie_val *cv;
	struct mw_exe_key exe = {};
	struct mw_rule_stats *rs;
	struct mw_event ev = {};
	struct mw_link *link;
	struct sock *sk;
	__u64 cookie, id;
	__u32 pending, old, end, hit;

	sk = fd_sock(fd);
	if (!sk)
		return;
	if (current_exe(&exe)) {
		struct mw_exe *e = bpf_map_lookup_elem(&mw_exes, &exe);

		if (!e || !(e->flags & MW_EXE_SEEN_SPLICE)) {
			exe_seen(&exe, MW_EXE_SEEN_SPLICE);
			ev.type = MW_EV_SPLICE_SEEN;
			ev.exe = exe;
			ev.pid = (__u32)bpf_get_current_pid_tgid();
			ev.tgid = bpf_get_current_pid_tgid() >> 32;
			bpf_get_current_comm(ev.comm, sizeof(ev.comm));
			emit(&ev);
		}
	}
	cookie = sk->__sk_common.skc_cookie.counter;
	cv = bpf_map_lookup_elem(&mw_cookies, &cookie);
	if (!cv)
		return;
	id = cv->link;
	end = cv->end & 1;
	link = link_at(cv->slot, id);
	if (!link)
		return;
	/* With bytes waiting, senders must stop before the target is
	 * withdrawn: in between they would send on TCP, and splice would
	 * return those later bytes first. */
	pending = psock_pending(sk);
	hit = pending ? __sync_fetch_and_or(&link->flags, MW_LINK_HIT) : MW_LINK_HIT;
	old = withdraw(link, end, MW_EF_R_SPLICE);
	if (hit & MW_LINK_HIT)
		return; /* no bytes waiting, or this hit is already reported */
	rs = rule_stats(link->rule_id);
	if (rs)
		rs->splice_hits++;
	emit_hit(MW_EV_SPLICE_HIT, sk, cookie, link, id, end, &exe, pending);
	(void)old;
}

/* Unread TCP bytes, as tcp_inq counts them (a FIN takes a sequence number
 * but is no byte). */
static __always_inline __u32 tcp_unread(struct tcp_sock *tp)
{
	__u32 inq = tp->rcv_nxt - tp->copied_seq;

	if (inq && (tp->inet_conn.icsk_inet.sk.__sk_common.skc_flags & (1UL << SOCK_DONE)))
		inq--;
	return inq;
}

/* ioctl(FIONREAD) on a socket: remembered per executable, and on the
 * socket's end of its link where FIONREAD misses TCP bytes of a psock
 * socket (MW_EF_FIONREAD: the policy keeps bytes into it redirected).
 * TCP bytes may be queued behind the psock all the same (sent before the
 * flag, before the link was whole, while the peer left the SOCKMAP): this
 * FIONREAD does not count them, and an edge-triggered reader told 0 waits
 * for an event they will not bring. Its reader is then woken (MW_EF_WAKE):
 * any wake-up after this call reaches the reader's next wait. */
static __always_inline void on_fionread(__u32 fd)
{
	struct mw_exe_key exe = {};
	struct mw_cookie_val *cv;
	struct mw_link *link;
	struct sock *sk;
	__u64 cookie;
	__u32 end;

	cv = covered_fd(fd, &sk, &cookie);
	if (!cv)
		return;
	if (current_exe(&exe))
		exe_seen(&exe, MW_EXE_SEEN_FIONREAD);
	if (!(config_flags() & MW_CFG_FIONREAD_PSOCK))
		return;
	link = link_at(cv->slot, cv->link);
	end = cv->end & 1;
	if (!link || link->cookie[end] != cookie)
		return;
	if (!(link->end_flags[end] & MW_EF_FIONREAD))
		__sync_fetch_and_or(&link->end_flags[end], MW_EF_FIONREAD);
	if (!((unsigned long)sk->sk_user_data & ~SK_USER_DATA_FLAGS))
		return;
	if (!tcp_unread(bpf_core_cast(sk, struct tcp_sock)))
		return;
	if (!(__sync_fetch_and_or(&link->end_flags[end], MW_EF_WAKE) & MW_EF_WAKE) &&
	    !request_park(MW_EV_WAKE, link, cv->link, end))
		__sync_fetch_and_and(&link->end_flags[end], ~MW_EF_WAKE); /* the next FIONREAD asks again */
}

/*
 * send(MSG_OOB) on a covered socket, before the kernel sends it. Urgent data
 * exists only on the TCP path (the urgent pointer): a redirect would put the
 * byte in-band, and the reader's recv(MSG_OOB) would never find it. So this
 * end's sends take TCP from now on (MW_EF_NOSEND; the bytes it redirected
 * before are read first, as after any move to TCP), and its program's later
 * ends never redirect what they send (MW_EXE_SEEN_URGENT, decide_end). One
 * thing TCP's meaning needs that the fast path cannot give: a recv(MSG_OOB) on
 * a socket with redirected bytes unread reads those in-band bytes instead
 * (tcp_bpf_recvmsg ignores the flag while its psock queue holds any), and a
 * reader that reads it in-band (SO_OOBINLINE) would find the mark (sockatmark
 * counts TCP bytes only) before those bytes. So bytes unread make this a hit:
 * the connection is reset, loudly, as for splice. The peer's address
 * (mw_link.sk) is read as reader_busy does.
 */
static __always_inline void on_urgent_send(__u32 fd)
{
	struct mw_exe_key exe = {};
	struct mw_cookie_val *cv;
	struct mw_rule_stats *rs;
	struct mw_link *link;
	struct sock *sk, *psk;
	__u32 end, pending;
	__u64 cookie;

	cv = covered_fd(fd, &sk, &cookie);
	if (!cv)
		return;
	if (current_exe(&exe))
		exe_seen(&exe, MW_EXE_SEEN_URGENT);
	link = link_at(cv->slot, cv->link);
	end = cv->end & 1;
	if (!link || link->cookie[end] != cookie)
		return;
	/* Already on TCP: nothing redirected after its first urgent send. */
	if (__sync_fetch_and_or(&link->end_flags[end], MW_EF_NOSEND) & MW_EF_NOSEND)
		return;
	rs = rule_stats(link->rule_id);
	if (rs)
		rs->fb_urgent++;
	psk = bpf_core_cast((void *)link->sk[end ^ 1], struct sock);
	if (!psk || (link->end_flags[end ^ 1] & MW_EF_CLOSED))
		return;
	pending = psock_pending(psk);
	if (!pending || (__sync_fetch_and_or(&link->flags, MW_LINK_HIT) & MW_LINK_HIT))
		return;
	if (rs)
		rs->urgent_hits++;
	emit_hit(MW_EV_URGENT_HIT, sk, cookie, link, cv->link, end, &exe, pending);
}

/* Runs on every system call of the node. `regs` is a BTF pointer here: its
 * fields are read with plain (fault-guarded) loads, where the _CORE_ macros
 * would call bpf_probe_read_kernel (about 60 ns on each send). */
SEC("tp_btf/sys_enter")
int BPF_PROG(mw_sys_enter, struct pt_regs *regs, long id)
{
	if (id == nr_splice)
		on_splice((__u32)PT_REGS_PARM1_SYSCALL(regs));
	else if (id == nr_ioctl && (__u32)PT_REGS_PARM2_SYSCALL(regs) == FIONREAD)
		on_fionread((__u32)PT_REGS_PARM1_SYSCALL(regs));
	else if ((id == nr_sendto || id == nr_sendmmsg) && (PT_REGS_PARM4_SYSCALL(regs) & MSG_OOB))
		on_urgent_send((__u32)PT_REGS_PARM1_SYSCALL(regs));
	else if (id == nr_sendmsg && (PT_REGS_PARM3_SYSCALL(regs) & MSG_OOB))
		on_urgent_send((__u32)PT_REGS_PARM1_SYSCALL(regs));
	return 0;
}

/* setsockopt() on a covered socket, before the kernel applies it. */
/*
 * connect() to a listener of the caller's own network namespace (a sidecar
 * on loopback): whether that listener's accepted ends will be targets can be
 * read from the listener now, before the client end joins a SOCKMAP at
 * ESTABLISHED and before any connection of the listener was accepted, so the
 * hint (mw_srv_hint) serves a listener's first client too: a connection
 * pool opened at start-up would otherwise keep running sk_msg for nothing.
 * What decide_end would say of an accepted end, as far as the listener
 * shows it: SO_RCVLOWAT (inherited), and with the guard a reader that can
 * splice where splice() misses redirected bytes. An owner not classified
 * yet leaves the hint as it is; nothing else changes, and connect() always
 * goes on.
 */
static __always_inline void listener_hint(struct bpf_sock_addr *ctx, struct bpf_sock *lsk, struct mw_srv_key *k)
{
	struct sock *s = bpf_core_cast(lsk, struct sock);
	struct mw_service_key svc = {};
	struct mw_service *listens;
	struct mw_exe_class *cls;
	struct mw_exe_key *exe;
	struct mw_exe *seen;
	__u32 cfg = config_flags(), reason = 0, sflags = 0;

	if (!s || lsk->state != BPF_TCP_LISTEN)
		return;
	k->netns = bpf_get_netns_cookie(ctx);
	if (s->sk_rcvlowat > 1) {
		reason = MW_EF_R_LOWAT;
	} else if (s->sk_peek_off >= 0) {
		reason = MW_EF_R_PEEKOFF;
	} else if (cfg & MW_CFG_GUARD) {
		/* Its program (stamp_listener; listeners have no element). */
		svc.netns = k->netns;
		svc.port = lsk->src_port;
		svc.family = lsk->family;
		listens = bpf_map_lookup_elem(&mw_services, &svc);
		if (!listens || (listens->flags & MW_SVC_MIXED))
			return;
		exe = &listens->exe;
		cls = bpf_map_lookup_elem(&mw_exe_class, exe);
		if (!cls || !(cls->flags & MW_EXE_CLASSIFIED))
			return;
		seen = bpf_map_lookup_elem(&mw_exes, exe);
		if (seen)
			sflags = seen->flags;
		if ((cfg & MW_CFG_SPLICE_BLIND) && exe_may_splice(cls->flags, sflags))
			reason = MW_EF_R_SPLICE;
		else if (sflags & MW_EXE_SEEN_PEEK_OFF)
			reason = MW_EF_R_PEEKOFF;
		else if (!(cfg & MW_CFG_SPLICE_BLIND))
			return; /* the reader decides, at accept */
	}
	srv_hint_put(k, reason, cfg);
}

/* The listener at `tup`'s destination in the caller's namespace, if any,
 * gives the hint at `k` (its network namespace filled in here). */
static __always_inline void connect_hint(struct bpf_sock_addr *ctx, struct bpf_sock_tuple *tup, __u32 len,
					 struct mw_srv_key *k)
{
	struct bpf_sock *lsk;

	/* No rule names the port: no hint to give (and no listener lookup). */
	if (!port_maybe_covered(k->port))
		return;
	lsk = bpf_sk_lookup_tcp(ctx, tup, len, BPF_F_CURRENT_NETNS, 0);
	if (!lsk)
		return;
	listener_hint(ctx, lsk, k);
	bpf_sk_release(lsk);
}

SEC("cgroup/connect4")
int mw_connect4(struct bpf_sock_addr *ctx)
{
	struct bpf_sock_tuple tup = {};
	struct mw_srv_key k = {};

	if (ctx->type != SOCK_STREAM)
		return 1;
	tup.ipv4.daddr = ctx->user_ip4;
	tup.ipv4.dport = (__u16)ctx->user_port;
	k.family = MW_AF_INET;
	k.ip[0] = tup.ipv4.daddr;
	k.port = bpf_ntohs(tup.ipv4.dport);
	connect_hint(ctx, &tup, sizeof(tup.ipv4), &k);
	return 1;
}

SEC("cgroup/connect6")
int mw_connect6(struct bpf_sock_addr *ctx)
{
	struct bpf_sock_tuple tup = {};
	struct mw_srv_key k = {};
	__u32 a0 = ctx->user_ip6[0], a1 = ctx->user_ip6[1], a2 = ctx->user_ip6[2], a3 = ctx->user_ip6[3];

	if (ctx->type != SOCK_STREAM)
		return 1;
	tup.ipv6.daddr[0] = a0;
	tup.ipv6.daddr[1] = a1;
	tup.ipv6.daddr[2] = a2;
	tup.ipv6.daddr[3] = a3;
	tup.ipv6.dport = (__u16)ctx->user_port;
	/* The keys a dual-stack connection's ends build (load_tuple). */
	if (a0 == 0 && a1 == 0 && a2 == bpf_htonl(0xffff)) {
		k.family = MW_AF_INET;
		k.ip[0] = a3;
	} else {
		k.family = MW_AF_INET6;
		k.ip[0] = a0;
		k.ip[1] = a1;
		k.ip[2] = a2;
		k.ip[3] = a3;
	}
	k.port = bpf_ntohs(tup.ipv6.dport);
	connect_hint(ctx, &tup, sizeof(tup.ipv6), &k);
	return 1;
}

/* Whether sk_msg runs on this socket's sends (a psock with a msg program:
 * mw_sockmap, not mw_tgtmap). */
static __always_inline bool sends_run_sk_msg(struct sock *sk)
{
	unsigned long ud = (unsigned long)sk->sk_user_data & ~SK_USER_DATA_FLAGS;
	struct sk_psock *psock;

	psock = bpf_rdonly_cast((void *)ud, bpf_core_type_id_kernel(struct sk_psock));
	return psock && psock->progs.msg_parser;
}

/*
 * setsockopt(SO_ZEROCOPY, 1) on a covered socket. A zero-copy send owes its
 * caller a completion on the error queue, numbered by the socket's count of
 * zero-copy tcp_sendmsg calls. Redirected, a send gets none; passed to TCP
 * by tcp_bpf, it is pushed one page run at a time and counts once per run,
 * so the numbers run ahead of the caller's. Only plain tcp_sendmsg keeps
 * them right: on a socket whose sends run sk_msg the option is refused with
 * EOPNOTSUPP, as on sockets without zero-copy support (its sends stay
 * copies, and redirected). Elsewhere (mw_tgtmap, or out of the maps) it is
 * taken, and the end's sends stay on TCP for good: MW_EF_NOSEND, and
 * MW_EF_ZEROCOPY keeps it from rejoining mw_sockmap (mw_park). Either way
 * its program is remembered (remember_opt): its later ends start with their
 * sends on TCP, outside mw_sockmap, where the option is taken (decide_end).
 */
static __always_inline bool zerocopy_allowed(struct bpf_sock *sk, struct mw_link *link, __u32 end,
					     struct mw_rule_stats *rs)
{
	struct sock *s = bpf_rdonly_cast(sk, bpf_core_type_id_kernel(struct sock));
	__u32 old;

	end &= 1;
	/* Under the socket's lock, as mw_park's relink: either the relink
	 * came first (refused here) or it sees MW_EF_ZEROCOPY. */
	if (sends_run_sk_msg(s)) {
		if (rs)
			rs->zc_refused++;
		bpf_set_retval(-EOPNOTSUPP);
		return false;
	}
	old = __sync_fetch_and_or(&link->end_flags[end], MW_EF_NOSEND | MW_EF_ZEROCOPY);
	if (rs && !(old & MW_EF_ZEROCOPY))
		rs->fb_zerocopy++;
	return true;
}

/* SO_ZEROCOPY or SO_PEEK_OFF turned on (`on`) or off on a socket. The
 * socket is marked (MW_OWN_*, cleared when turned off) for a client end's
 * decision still to come: one set while connect() is in progress may be
 * applied only after the handshake (an accepted end has the kernel's own
 * flags from its listener). On a covered socket (`covered`: it has a link,
 * or an observed one) its executable is remembered (MW_EXE_SEEN_*) for its
 * later ends: the owner's, or else the link's (`link`, `end`: a listener
 * that predates meshwarp has no owner, its link the learned executable). */
static __always_inline void remember_opt(struct bpf_sock *sk, bool covered, struct mw_link *link, __u32 end,
					 __u32 own, __u32 seen, bool on)
{
	struct mw_sock_state *st;
	struct mw_sock_owner *o;
	struct mw_exe_key exe;

	/* Not made for a listener: the marks serve a client end's decision
	 * (an accepted socket has the kernel's flags), and listeners carry no
	 * element. */
	st = bpf_sk_storage_get(&mw_sk_state, sk, 0,
				on && sk->state != BPF_TCP_LISTEN ? BPF_SK_STORAGE_GET_F_CREATE : 0);
	o = st ? &st->own : NULL;
	if (o && on && !(o->flags & own))
		__sync_fetch_and_or(&o->flags, own);
	else if (o && !on && (o->flags & own))
		__sync_fetch_and_and(&o->flags, ~own);
	if (!on || !covered)
		return;
	if (o && (o->flags & MW_OWN_KNOWN)) {
		exe_seen(&o->exe, seen);
	} else if (link) {
		exe = link->exe[end & 1];
		if (exe.dev || exe.ino)
			exe_seen(&exe, seen);
	}
}

/*
 * setsockopt(SO_PEEK_OFF, n >= 0) on a covered socket: MSG_PEEK then reads at
 * an offset that TCP moves with every peek and read, where a psock's peeks
 * ignore it. The end stops being a target (its peer's next bytes take TCP,
 * read through tcp_recvmsg, which keeps the offset), and its program is
 * remembered: its later ends are no targets from the start. Redirected bytes
 * still unread would be peeked at the wrong place: then the option is
 * refused with EOPNOTSUPP, what kernels without peek offsets for TCP answer
 * (the program peeks without one).
 */
static __always_inline bool peek_off_allowed(struct bpf_sock *sk, struct mw_link *link, __u32 end,
					     struct mw_rule_stats *rs)
{
	struct sock *s;

	end &= 1;
	if ((withdraw(link, end, MW_EF_R_PEEKOFF) & MW_EF_TARGET) && rs)
		rs->fb_peek_off++;
	s = bpf_rdonly_cast(sk, bpf_core_type_id_kernel(struct sock));
	if (!psock_pending(s))
		return true;
	if (rs)
		rs->peek_off_refused++;
	bpf_set_retval(-EOPNOTSUPP);
	return false;
}

SEC("cgroup/setsockopt")
int mw_setsockopt(struct bpf_sockopt *ctx)
{
	struct bpf_sock *sk = ctx->sk;
	struct mw_rule_stats *rs;
	struct mw_sock_state *st;
	struct mw_link *link = NULL;
	struct sock *s;
	__u64 id = 0;
	__u32 end = 0;
	bool zc, on;
	int *val;

	if (!sk)
		goto pass;
	st = bpf_sk_storage_get(&mw_sk_state, sk, 0, 0);
	if (st && st->link) {
		id = st->link;
		end = st->end & 1;
		link = link_at(st->slot, id);
		if (link && (link->flags & MW_LINK_OBSERVE))
			link = NULL;
	}
	/* TCP only: no owner record on a UDP socket for nothing. Turned on
	 * means 1 for SO_ZEROCOPY (other values: EINVAL from the kernel) and
	 * >= 0 for SO_PEEK_OFF. */
	if (ctx->level == SOL_SOCKET && (ctx->optname == SO_ZEROCOPY || ctx->optname == SO_PEEK_OFF) &&
	    sk->protocol == IPPROTO_TCP) {
		val = ctx->optval;
		if ((void *)(val + 1) > ctx->optval_end)
			goto pass;
		zc = ctx->optname == SO_ZEROCOPY;
		on = zc ? *val == 1 : *val >= 0;
		remember_opt(sk, id, link, end, zc ? MW_OWN_ZEROCOPY : MW_OWN_PEEK_OFF,
			     zc ? MW_EXE_SEEN_ZEROCOPY : MW_EXE_SEEN_PEEK_OFF, on);
		if (!link || !on)
			goto pass;
		rs = rule_stats(link->rule_id);
		if (zc ? !zerocopy_allowed(sk, link, end, rs) : !peek_off_allowed(sk, link, end, rs))
			return 0;
		goto pass;
	}
	if (!link)
		goto pass;
	rs = rule_stats(link->rule_id);
	if (ctx->level == SOL_SOCKET && ctx->optname == SO_RCVLOWAT) {
		val = ctx->optval;
		if ((void *)(val + 1) > ctx->optval_end)
			goto pass;
		if (*val > 1 && (withdraw(link, end, MW_EF_R_LOWAT) & MW_EF_TARGET) && rs)
			rs->fb_lowat++;
	} else if (ctx->level == SOL_TCP && ctx->optname == TCP_ULP) {
		/* A ULP (kTLS) reads and writes the stream itself: both
		 * directions of this socket go back to TCP. */
		withdraw(link, end, MW_EF_R_ULP);
		__sync_fetch_and_or(&link->end_flags[end], MW_EF_NOSEND);
		if (rs)
			rs->fb_ulp++;
		s = bpf_rdonly_cast(sk, bpf_core_type_id_kernel(struct sock));
		if (psock_pending(s)) {
			/* kTLS would read them as records: refuse; the
			 * application keeps its user-space TLS. */
			if (rs)
				rs->ulp_refused++;
			return 0;
		}
	}
pass:
	/* Larger options: let the kernel use the caller's buffer. */
	if (ctx->optlen > PAGE_SIZE)
		ctx->optlen = 0;
	return 1;
}

/* Resets the sockets user space put in mw_doomed (a hit connection). */
SEC("iter/tcp")
int mw_destroy(struct bpf_iter__tcp *ctx)
{
	struct sock_common *skc = ctx->sk_common;
	__u64 cookie;

	if (!skc)
		return 0;
	cookie = bpf_get_socket_cookie(skc);
	if (!bpf_map_lookup_elem(&mw_doomed, &cookie))
		return 0;
	bpf_sock_destroy(skc);
	bpf_map_delete_elem(&mw_doomed, &cookie);
	return 0;
}

/* An unlink that cannot happen: the end is a target again and counts a new
 * run before it asks again (a move stays in mw_sockmap). */
static __always_inline void unpark(struct mw_link *link, __u32 end)
{
	link->dir[end & 1].run = 0;
	__sync_fetch_and_and(&link->dir[end & 1].flags, ~(MW_DIR_UNLINK_REQ | MW_DIR_MOVE));
	__sync_fetch_and_and(&link->end_flags[end & 1], ~MW_EF_PARKED);
}

/*
 * Deletes a parked end's SOCKMAP entry (MW_EV_UNLINK): user space runs this
 * with BPF_PROG_TEST_RUN, the socket's cookie in cb[0] (low) and cb[1]
 * (high); it is never attached. The end's own sk_msg parked it and found it
 * drained (park_self), so nothing redirected can reach its psock while it
 * stays parked (or its server end parked it for a move, MW_DIR_MOVE, before
 * anything could be redirected into it). MW_DIR_UNLINKING first: from then on its slot cannot be
 * freed (end_out), so the entry at 2 * slot + end stays this socket's while
 * the link still names it (cookie, slot owner) and it has not closed.
 * Returns MW_PARK_*.
 */
SEC("tc")
int mw_unlink(struct __sk_buff *skb)
{
	__u64 cookie = ((__u64)skb->cb[1] << 32) | skb->cb[0];
	struct mw_cookie_val *cv;
	struct mw_rule_stats *rs;
	struct mw_link *link;
	struct mw_slot *sl;
	__u32 end, pos, slot, old;
	int res;
	__u64 id;

	cv = bpf_map_lookup_elem(&mw_cookies, &cookie);
	if (!cv)
		return MW_PARK_MOOT;
	id = cv->link;
	end = cv->end & 1;
	link = link_at(cv->slot, id);
	if (!link)
		return MW_PARK_MOOT;
	old = __sync_fetch_and_or(&link->dir[end].flags, MW_DIR_UNLINKING);
	if (old & MW_DIR_UNLINKING)
		return MW_PARK_MOOT; /* another run is at it */
	slot = link->slot;
	sl = bpf_map_lookup_elem(&mw_slots, &slot);
	pos = slot * 2 + end;
	/* Checked after the flag: a link element reused meanwhile, or a slot
	 * freed before it, shows here. */
	if (link->cookie[end] != cookie || !(link->flags & MW_LINK_SLOT) || !sl || sl->owner != id ||
	    (old & (MW_DIR_UNLINK_REQ | MW_DIR_UNLINKED)) != MW_DIR_UNLINK_REQ) {
		res = MW_PARK_MOOT;
	} else if (link->end_flags[end] & (MW_EF_CLOSED | MW_EF_GONE)) {
		/* Closing: its close takes the entry out. */
		__sync_fetch_and_and(&link->dir[end].flags, ~MW_DIR_UNLINK_REQ);
		res = MW_PARK_MOOT;
	} else if (!(old & (MW_DIR_TCP | MW_DIR_MOVE)) || !(link->end_flags[end] & MW_EF_PARKED)) {
		/* Promoted meanwhile: it stays, a target again. */
		unpark(link, end);
		res = MW_PARK_MOOT;
	} else if (bpf_map_delete_elem(&mw_sockmap, &pos)) {
		unpark(link, end);
		res = MW_PARK_FAILED;
	} else {
		/* Out before UNLINKING goes: end_out must never see neither. */
		__sync_fetch_and_or(&link->dir[end].flags, MW_DIR_UNLINKED);
		__sync_fetch_and_and(&link->dir[end].flags, ~MW_DIR_UNLINK_REQ);
		rs = rule_stats(link->rule_id);
		if (rs && !(old & MW_DIR_MOVE))
			rs->unlinks++;
		res = MW_PARK_DONE;
	}
	__sync_fetch_and_and(&link->dir[end].flags, ~MW_DIR_UNLINKING);
	return res;
}

/* Wakes the reader of `tp`, end `end` of `link` (MW_PARK_WAKE): setting
 * SO_RCVLOWAT to its own value runs tcp_data_ready, which, with bytes
 * queued, wakes the socket's waiters (EPOLLIN); bpf_setsockopt runs no
 * cgroup hook, so mw_setsockopt does not take it for the application's. */
static __always_inline __u32 wake_reader(struct tcp_sock *tp, struct mw_link *link, __u32 end)
{
	struct mw_rule_stats *rs;
	int lowat;

	/* Cleared first: a FIONREAD from here on asks again. */
	__sync_fetch_and_and(&link->end_flags[end & 1], ~MW_EF_WAKE);
	lowat = tp->inet_conn.icsk_inet.sk.sk_rcvlowat;
	if (bpf_setsockopt(tp, SOL_SOCKET, SO_RCVLOWAT, &lowat, sizeof(lowat)))
		return MW_PARK_FAILED;
	rs = rule_stats(link->rule_id);
	if (rs)
		rs->reader_wakeups++;
	return MW_PARK_DONE;
}

/* An end back in a SOCKMAP (relinked, or moved into mw_tgtmap): no request
 * pending, a new run, and its peer may redirect into it again. */
static __always_inline void rejoined(struct mw_link *link, __u32 end)
{
	end &= 1;
	__sync_fetch_and_and(&link->dir[end].flags,
			     ~(MW_DIR_UNLINKED | MW_DIR_RELINK_REQ | MW_DIR_UNLINK_REQ | MW_DIR_MOVE | MW_DIR_QUIET));
	link->dir[end].run = 0;
	__sync_fetch_and_and(&link->end_flags[end], ~MW_EF_PARKED);
}

/* Whether the peer of end `end` (socket `tp`) wrote TCP bytes this end has
 * not read: queued here, or still on their way (in the peer's send queue,
 * or between namespaces in a backlog a softirq has not run yet), which
 * tcp_unread does not see. Read through the peer's untrusted hint
 * (link->sk): a stale one only lets the join go as if nothing were on its
 * way. A peer past ESTABLISHED (its FIN counts in write_seq) sends no more. */
static __always_inline bool peer_bytes_unread(struct tcp_sock *tp, const struct mw_link *link, __u32 end)
{
	__u64 p = link->sk[(end ^ 1) & 1];
	struct tcp_sock *peer;

	if (!p)
		return false;
	peer = bpf_core_cast((void *)p, struct tcp_sock);
	if (peer->inet_conn.icsk_inet.sk.__sk_common.skc_state != TCP_ESTABLISHED_STATE)
		return false;
	return peer->write_seq != tp->copied_seq;
}

/* Whether end `end` reads by FIONREAD on a kernel whose FIONREAD counts
 * only a psock's bytes, not TCP's. */
static __always_inline bool fionread_blind(const struct mw_link *link, __u32 end)
{
	return (link->end_flags[end & 1] & MW_EF_FIONREAD) && (config_flags() & MW_CFG_FIONREAD_PSOCK);
}

/* Whether end `end` (socket `tp`) reads by FIONREAD, which on a psock would
 * not count the TCP bytes it has not read yet: such an end joins a SOCKMAP
 * only once it read them (each read would otherwise wait for a wake-up),
 * those on their way too (a Fast Open server end joining while its client
 * uploads on TCP: 1 692 wake-ups in one run of compat.rs
 * `nginx_and_curl_with_tcp_fast_open`, which then failed). */
static __always_inline bool fionread_would_miss(struct tcp_sock *tp, const struct mw_link *link, __u32 end)
{
	return fionread_blind(link, end) && (tcp_unread(tp) || peer_bytes_unread(tp, link, end));
}

/* A FIONREAD reader just inserted into `map` at `pos`, still parked: if its
 * peer, sending on TCP while it is parked, wrote more during the insert (a
 * psock takes microseconds to build; an upload does not pause for it), the
 * insert is undone (under the socket's lock nothing was redirected into it
 * nor sent by it) and the join waits for the next ask. True if undone. */
static __always_inline bool fionread_join_undone(struct tcp_sock *tp, struct mw_link *link, __u32 end, void *map,
						 __u32 pos)
{
	if (!fionread_would_miss(tp, link, end) || bpf_map_delete_elem(map, &pos))
		return false;
	__sync_fetch_and_and(&link->dir[end & 1].flags, ~MW_DIR_RELINK_REQ);
	return true;
}

/* What end `end` (socket `tp`, under its lock) read of its peer's TCP bytes,
 * published before it joins: its reads publish copied_seq only after the
 * call returns (mw_recv_len), and a join in between would leave its peer's
 * sends on TCP (mw_dir.tcp_read behind their write_seq) into a psock end,
 * where a FIONREAD reader misses them (731 wake-ups in 1 run of 31 of
 * `nginx_and_curl_with_tcp_fast_open`; it may not have asked FIONREAD yet).
 * Never moved back. Only for a socket in non-blocking mode: a reader asleep
 * in a plain tcp_recvmsg (MSG_WAITALL, part of it copied) watches only the
 * TCP queue, and the late publication is what keeps its peer on TCP until
 * that call returns. */
static __always_inline void tcp_read_published(struct tcp_sock *tp, struct mw_link *link, __u32 end)
{
	__u32 seq = tp->copied_seq, peer = (end ^ 1) & 1;

	if (!(sock_file_flags(&tp->inet_conn.icsk_inet.sk) & O_NONBLOCK))
		return;
	if ((__s32)(seq - link->dir[peer].tcp_read) > 0)
		link->dir[peer].tcp_read = seq;
}

/*
 * The last step of a FIONREAD reader's join, once inserted into `map` at
 * `pos`: it is unparked (its peer may redirect into it from then on) and
 * looked at once more. A send of the peer that saw it parked just before
 * goes to TCP, and holds the peer's socket lock from before that look until
 * its bytes are in the peer's write_seq (tcp_bpf pushes a passed message
 * under the lock its sk_msg ran under): so after the fetch-form clear, the
 * lock shows as owned or write_seq is ahead of what this end read. Then
 * the end is parked again and, unless its peer claimed bytes for it
 * meanwhile (claims before PARKED shows, as with park_self), taken out
 * again; it joins at the next ask. False positives (the peer holds its lock
 * to read) only put the join off. What this does not close costs wake-ups,
 * never order (a direction with TCP bytes unread stays on TCP, finish_msg):
 * a send that waits for memory drops its lock before its bytes count; a
 * claim seen here and then taken back (the send saw the new PARKED) keeps
 * the end joined; and the sender's lock store is ordered before its PARKED
 * load only by the locked instructions between them (x86), not on every
 * architecture. True if undone.
 */
static __always_inline bool fionread_unpark_undone(struct tcp_sock *tp, struct mw_link *link, __u32 end, void *map,
						   __u32 pos)
{
	__u32 peer = (end ^ 1) & 1, before, after, old;

	end &= 1;
	if (!fionread_blind(link, end))
		return false;
	before = __sync_fetch_and_add(&link->dir[peer].redir, 0);
	old = __sync_fetch_and_and(&link->end_flags[end], ~MW_EF_PARKED);
	barrier_var(old);
	if (!reader_busy(link, peer) && !fionread_would_miss(tp, link, end))
		return false;
	old = __sync_fetch_and_or(&link->end_flags[end], MW_EF_PARKED);
	barrier_var(old);
	after = __sync_fetch_and_add(&link->dir[peer].redir, 0);
	if (after != before || psock_pending((struct sock *)tp) || bpf_map_delete_elem(map, &pos)) {
		__sync_fetch_and_and(&link->end_flags[end], ~MW_EF_PARKED);
		return false;
	}
	__sync_fetch_and_and(&link->dir[end].flags, ~MW_DIR_RELINK_REQ);
	return true;
}

/*
 * The second half of a move (MW_DIR_MOVE): a client end out of mw_sockmap
 * joins mw_tgtmap. Only once its psock is gone: a thread in its send holds
 * it across the delete (sk_psock_get comes before lock_sock in
 * tcp_bpf_sendmsg), and an insert would keep that psock, sk_msg and all.
 * Until then it stays out and parked (plain TCP both ways); the retry, or
 * its peer's next send, asks again.
 */
static __always_inline __u32 move_in(struct tcp_sock *tp, struct mw_sock_state *st, struct mw_link *link, __u32 end,
				     __u32 pos)
{
	struct mw_rule_stats *rs;

	end &= 1;
	if (!(link->end_flags[end] & MW_EF_TARGET)) {
		/* Withdrawn meanwhile (its reader spliced, ...): nothing either
		 * end sends can be redirected, so it stays out, plain TCP, for
		 * good. MW_DIR_RELINK_REQ stays set: never asked again (the
		 * plain relink would put it back into mw_sockmap). */
		__sync_fetch_and_or(&link->dir[end].flags, MW_DIR_RELINK_REQ);
		return MW_PARK_MOOT;
	}
	/* A psock again now would keep its old sk_msg (a send still holds
	 * it); and a FIONREAD reader's unread TCP bytes (its peer's, sent
	 * while it moved) would go uncounted by FIONREAD on a psock, each
	 * read waiting for a wake-up: it moves in once it read them. Out of
	 * both maps meanwhile, it is plain TCP both ways. */
	if (((unsigned long)tp->inet_conn.icsk_inet.sk.sk_user_data & ~SK_USER_DATA_FLAGS) ||
	    fionread_would_miss(tp, link, end)) {
		__sync_fetch_and_and(&link->dir[end].flags, ~MW_DIR_RELINK_REQ);
		return MW_PARK_BUSY;
	}
	if (bpf_map_update_elem(&mw_tgtmap, &pos, (struct sock *)tp, BPF_NOEXIST))
		return MW_PARK_FAILED;
	if (fionread_join_undone(tp, link, end, &mw_tgtmap, pos))
		return MW_PARK_BUSY;
	/* Where its peer redirects to, before it is unparked. */
	__sync_fetch_and_or(&link->end_flags[end], MW_EF_TGTMAP);
	tcp_read_published(tp, link, end);
	if (fionread_unpark_undone(tp, link, end, &mw_tgtmap, pos)) {
		__sync_fetch_and_and(&link->end_flags[end], ~MW_EF_TGTMAP);
		return MW_PARK_BUSY;
	}
	st->flags |= MW_SOCK_TGTMAP;
	rejoined(link, end);
	rs = rule_stats(link->rule_id);
	if (rs)
		rs->tgtmap_clients++;
	return MW_PARK_DONE;
}

/*
 * Puts an unlinked end back into the SOCKMAP (mw_park_req, MW_PARK_RELINK):
 * its peer sent, so a new exchange may start; or a moving client end into
 * mw_tgtmap (move_in). Inserting a socket needs the socket: an iterator in
 * its network namespace has it, under its lock. Wakes a socket's reader
 * (MW_PARK_WAKE) the same way.
 */
SEC("iter/tcp")
int mw_park(struct bpf_iter__tcp *ctx)
{
	struct sock_common *skc = ctx->sk_common;
	struct mw_rule_stats *rs;
	struct mw_park_req *req;
	struct mw_sock_state *st;
	struct mw_link *link;
	struct tcp_sock *tp;
	__u32 end, pos;
	__u64 cookie;

	if (!skc)
		return 0;
	cookie = bpf_get_socket_cookie(skc);
	req = bpf_map_lookup_elem(&mw_park_req, &cookie);
	if (!req || req->result != MW_PARK_PENDING)
		return 0;
	tp = bpf_skc_to_tcp_sock(skc);
	if (!tp || (req->op != MW_PARK_RELINK && req->op != MW_PARK_WAKE)) {
		req->result = MW_PARK_MOOT;
		return 0;
	}
	st = bpf_sk_storage_get(&mw_sk_state, (struct sock *)tp, 0, 0);
	if (!st || !st->link) {
		req->result = MW_PARK_MOOT;
		return 0;
	}
	link = link_at(st->slot, st->link);
	end = st->end & 1;
	if (!link || link->cookie[end] != cookie) {
		req->result = MW_PARK_MOOT;
		return 0;
	}
	if (req->op == MW_PARK_WAKE) {
		req->result = wake_reader(tp, link, end);
		return 0;
	}
	if (!(link->dir[end].flags & MW_DIR_UNLINKED) || skc->skc_state != TCP_ESTABLISHED_STATE) {
		__sync_fetch_and_and(&link->dir[end].flags, ~MW_DIR_RELINK_REQ);
		req->result = MW_PARK_MOOT;
		return 0;
	}
	/* On failure MW_DIR_RELINK_REQ stays: it is not asked again. */
	pos = link->slot * 2 + end;
	if (link->dir[end].flags & MW_DIR_MOVE) {
		req->result = move_in(tp, st, link, end, pos);
		return 0;
	}
	/* SO_ZEROCOPY was taken while it was out: in mw_sockmap its sends
	 * would run tcp_bpf (see zerocopy_allowed). It stays out, plain TCP
	 * both ways; MW_DIR_RELINK_REQ stays set: never asked again. */
	if ((link->end_flags[end] & MW_EF_ZEROCOPY) ||
	    (tp->inet_conn.icsk_inet.sk.__sk_common.skc_flags & (1UL << SOCK_ZEROCOPY))) {
		req->result = MW_PARK_MOOT;
		return 0;
	}
	/* Back only while the peer has read all this end sent on TCP: its next
	 * send may then go redirected again (policy_allows promotes at a run's
	 * first message). Put back in the middle of a response it sends on TCP
	 * (the peer's request asked, the response began before this walk), it
	 * would run sk_msg on every send of it, only to pass it to TCP, and
	 * leave again. The peer's next message asks again. Not a direction
	 * judge_streamed wants redirected (MW_DIR_KEEP): it stays in, and is
	 * promoted once its peer read every TCP byte (policy_allows); refused
	 * here, the response that follows each request always began before
	 * the walk. */
	if (link->dir[end].tcp_read != tp->write_seq && !(link->dir[end].flags & MW_DIR_KEEP)) {
		__sync_fetch_and_and(&link->dir[end].flags, ~MW_DIR_RELINK_REQ);
		req->result = MW_PARK_MOOT;
		return 0;
	}
	/* Only a Fast Open server end is relinked as a FIONREAD reader (the
	 * policy never unlinks one). */
	if (fionread_would_miss(tp, link, end)) {
		__sync_fetch_and_and(&link->dir[end].flags, ~MW_DIR_RELINK_REQ);
		req->result = MW_PARK_BUSY;
		return 0;
	}
	if (bpf_map_update_elem(&mw_sockmap, &pos, (struct sock *)tp, BPF_NOEXIST)) {
		req->result = MW_PARK_FAILED;
		return 0;
	}
	if (fionread_join_undone(tp, link, end, &mw_sockmap, pos)) {
		req->result = MW_PARK_BUSY;
		return 0;
	}
	tcp_read_published(tp, link, end);
	if (fionread_unpark_undone(tp, link, end, &mw_sockmap, pos)) {
		req->result = MW_PARK_BUSY;
		return 0;
	}
	rejoined(link, end);
	rs = rule_stats(link->rule_id);
	if (rs)
		rs->relinks++;
	req->result = MW_PARK_DONE;
	return 0;
}

/* ---- the latency monitor's send side (attached only while it runs) ---- */

/* A send on the TCP path begins (before its bytes are queued): redirected
 * sends are stamped by sk_msg instead, which this never sees. */
SEC("tp_btf/tcp_sendmsg_locked")
int BPF_PROG(mw_lat_send, const struct sock *sk, const struct msghdr *msg, const struct sk_buff *skb,
	     int size_goal)
{
	struct mw_sock_state *st = bpf_sk_storage_get(&mw_sk_state, (struct sock *)sk, 0, 0);
	struct tcp_sock *tp = bpf_core_cast(sk, struct tcp_sock);
	bool every = false;
	__u32 end;
	__u64 since;

	if (!st || !(st->flags & MW_SOCK_END))
		return 0;
	/* A socket in mw_sockmap: sk_msg saw the send (what it passes to TCP
	 * comes back here once per page); in mw_tgtmap no sk_msg runs. Otherwise
	 * the tracepoint fires once per skb a send fills: a pass is a new send
	 * only if it ends elsewhere than the one seen last (copying moves
	 * write_seq and the bytes left alike). */
	if (((unsigned long)sk->sk_user_data & ~SK_USER_DATA_FLAGS) && !(st->flags & MW_SOCK_TGTMAP))
		return 0;
	end = tp->write_seq + (__u32)msg->msg_iter.count;
	if (end == st->lat_end)
		return 0;
	st->lat_end = end;
	since = lat_since(st->rule_id, &every);
	if (since)
		lat_send(st, since, every);
	return 0;
}

/* ---- the connection list ---- */

/* One struct mw_conn for user space: the socket `sk` with meshwarp state `st`. */
static __always_inline void conn_write(struct seq_file *seq, struct sock *sk, struct mw_sock_state *st)
{
	struct mw_sock_owner *own;
	struct mw_conn c = {};
	struct mw_link *link;
	struct tcp_sock *tp;
	__u32 end, peer;

	end = st->end & 1;
	peer = end ^ 1;
	c.cookie = bpf_get_socket_cookie(sk);
	c.netns = sk->__sk_common.skc_net.net->net_cookie;
	c.conn = st->conn;
	c.link = st->link;
	c.family = sk->__sk_common.skc_family;
	c.state = sk->__sk_common.skc_state;
	if (c.family == MW_AF_INET6) {
		BPF_CORE_READ_INTO(&c.local_ip, sk, __sk_common.skc_v6_rcv_saddr.in6_u.u6_addr32);
		BPF_CORE_READ_INTO(&c.remote_ip, sk, __sk_common.skc_v6_daddr.in6_u.u6_addr32);
	} else {
		c.local_ip[0] = sk->__sk_common.skc_rcv_saddr;
		c.remote_ip[0] = sk->__sk_common.skc_daddr;
	}
	/* Not skc_num: 0 once the socket reached TCP_CLOSE (its fd still open). */
	c.local_port = bpf_ntohs(bpf_core_cast(sk, struct inet_sock)->inet_sport);
	c.remote_port = bpf_ntohs(sk->__sk_common.skc_dport);
	c.rule_id = st->rule_id;
	c.end = end;
	c.fb = st->fb;
	c.sock_flags = st->flags;
	c.reader_tgid = st->rd_tgid;
	own = &st->own;
	if (own->flags & MW_OWN_KNOWN) {
		c.owner_tgid = own->tgid;
		c.exe = own->exe;
	} else if (end == MW_END_SERVER) {
		/* A server end that decided nothing (mode never, a Fast Open
		 * end whose client never linked): its listener's program. */
		struct mw_service_key svc = { .netns = c.netns, .port = c.local_port, .family = c.family };
		struct mw_service *listens = bpf_map_lookup_elem(&mw_services, &svc);

		if (listens && !(listens->flags & (MW_SVC_MIXED | MW_SVC_LEARNED))) {
			c.owner_tgid = listens->tgid;
			c.exe = listens->exe;
		}
	}
	if (st->link && st->slot != MW_NO_SLOT) {
		link = link_at(st->slot, st->link);
		if (link) {
			c.link_found = 1;
			c.link_flags = link->flags;
			c.end_flags = link->end_flags[end];
			c.peer_flags = link->end_flags[peer];
			c.tx_dir_flags = link->dir[end].flags;
			c.rx_dir_flags = link->dir[peer].flags;
		} else if (!c.fb) {
			c.fb = MW_FB_PEER; /* the server end released it */
		}
	}
	c.tx_fast_msgs = st->tx_msgs;
	c.tx_fast_bytes = st->tx_bytes;
	c.rx_fast_bytes = st->psock_rd;
	tp = bpf_skc_to_tcp_sock(sk);
	if (tp) {
		c.tx_tcp_bytes = tp->bytes_sent - tp->bytes_retrans;
		c.rx_tcp_bytes = tp->bytes_received;
		c.tx_segs = tp->data_segs_out;
		c.rx_segs = tp->data_segs_in;
	}
	c.unread = psock_pending(sk);
	bpf_seq_write(seq, &c, sizeof(c));
}

/* Every socket with meshwarp state (covered, accelerated or not), in every
 * network namespace at once. Some kernels refuse map-element iterators
 * (EPERM at load): there user space leaves this out and reads mw_conns_tcp
 * in each namespace instead. */
SEC("iter/bpf_sk_storage_map")
int mw_conns(struct bpf_iter__bpf_sk_storage_map *ctx)
{
	struct mw_sock_state *st = ctx->value;
	struct sock *sk = ctx->sk;

	if (sk && st && (st->flags & MW_SOCK_END))
		conn_write(ctx->meta->seq, sk, st);
	return 0;
}

/* The same records for the TCP sockets of the reading thread's network
 * namespace (iter/tcp walks one namespace's hash tables). */
SEC("iter/tcp")
int mw_conns_tcp(struct bpf_iter__tcp *ctx)
{
	struct sock_common *skc = ctx->sk_common;
	struct mw_sock_state *st;
	struct tcp_sock *tp;

	if (!skc)
		return 0;
	tp = bpf_skc_to_tcp_sock(skc);
	if (!tp)
		return 0; /* request and time-wait sockets hold no state */
	st = bpf_sk_storage_get(&mw_sk_state, (struct sock *)tp, 0, 0);
	if (st && (st->flags & MW_SOCK_END))
		conn_write(ctx->meta->seq, (struct sock *)tp, st);
	return 0;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
