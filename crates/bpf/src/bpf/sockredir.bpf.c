// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * Socket redirection: sockops inserts covered sockets into a SOCKHASH, sk_msg
 * moves each message straight into the peer socket's receive queue.
 *
 * Fallback is the law: anything unexpected returns SK_PASS without a redirect,
 * so the message takes the normal TCP path.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "meshwarp/shared.h"
#include "meshwarp/chain.h"

#define TCP_CLOSE_STATE 7 /* enum tcp_state TCP_CLOSE */
#define ENOMEM 12
#define E2BIG 7

/* Sizes are placeholders: user space sets max_entries before load. */
struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, 65536);
	__type(key, struct mw_sock_key);
	__type(value, __u64);
} mw_sockhash SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct mw_pair_key);
	__type(value, struct mw_rule);
} mw_pairs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct mw_capture_key);
	__type(value, struct mw_rule);
} mw_capture SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct mw_endpoint_key);
	__type(value, struct mw_origin);
} mw_origins SEC(".maps");

MW_DEFINE_SK_STATE_MAP();

/* Plugin chains of on_connection (sockops) and on_message (sk_msg). */
MW_DEFINE_CHAIN_PROGS(mw_ch_conn);
MW_DEFINE_CHAIN_PROGS(mw_ch_msg);

/* Plugin metadata and the grace-period map (chain.h). */
MW_DEFINE_HOST_PLUGIN_MAPS();

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 16384);
	__type(key, __u32);
	__type(value, struct mw_rule_stats);
} mw_stats SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct mw_global_stats);
} mw_global SEC(".maps");

/* Owner (controller name) of each rule slot. Read only by user space; pinned
 * with the data path so a restarted agent keeps ownership. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct mw_owner);
} mw_owners SEC(".maps");

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

static __always_inline bool ip_is_loopback(__u32 family, const __u32 *ip)
{
	if (family == MW_AF_INET)
		return (bpf_ntohl(ip[0]) >> 24) == 127;
	return ip[0] == 0 && ip[1] == 0 && ip[2] == 0 && ip[3] == bpf_htonl(1);
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

/* Covered by a mirror pair: own key (local, remote), peer key (remote, local). */
static __always_inline struct mw_rule *match_pair(struct bpf_sock_ops *skops,
						  const struct tuple *t, bool active)
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

static __always_inline void tuple_keys(struct bpf_sock_ops *skops, const struct tuple *t,
				       struct mw_sock_key *own, struct mw_sock_key *peer)
{
	__u64 netns = 0;

	if (ip_is_loopback(t->family, t->local_ip) && ip_is_loopback(t->family, t->remote_ip))
		netns = bpf_get_netns_cookie(skops);

	own->family = peer->family = t->family;
	own->kind = peer->kind = MW_KEY_TUPLE;
	own->netns = peer->netns = netns;
	copy_ip(own->local_ip, t->local_ip);
	copy_ip(own->remote_ip, t->remote_ip);
	own->local_port = t->local_port;
	own->remote_port = t->remote_port;
	copy_ip(peer->local_ip, t->remote_ip);
	copy_ip(peer->remote_ip, t->local_ip);
	peer->local_port = t->remote_port;
	peer->remote_port = t->local_port;
}

/* Capture keys carry only the client endpoint; both ends build the same one and
 * differ in kind. */
static __always_inline void capture_keys(struct bpf_sock_ops *skops, __u32 family,
					 const __u32 *client_ip, __u32 client_port,
					 __u64 netns, bool origin,
					 struct mw_sock_key *own, struct mw_sock_key *peer)
{
	own->family = peer->family = family;
	own->netns = peer->netns = netns;
	copy_ip(own->local_ip, client_ip);
	copy_ip(peer->local_ip, client_ip);
	own->local_port = peer->local_port = client_port;
	own->kind = origin ? MW_KEY_ORIGIN : MW_KEY_CAPTURED;
	peer->kind = origin ? MW_KEY_CAPTURED : MW_KEY_ORIGIN;
}

static __always_inline void count_insert_failure(__u32 rule_id, long err)
{
	struct mw_rule_stats *rs = rule_stats(rule_id);

	if (!rs)
		return;
	if (err == -E2BIG || err == -ENOMEM)
		rs->fb_map_full++;
	else
		rs->fb_insert_err++;
}

/* Stores the socket's state first, then makes it visible in the SOCKHASH, so
 * sk_msg never sees a socket without state. */
static __always_inline bool insert_socket(struct bpf_sock_ops *skops, struct mw_sock_key *own,
					  const struct mw_sock_key *peer, __u32 rule_id)
{
	struct bpf_sock *sk = skops->sk;
	struct mw_sock_state *st;
	struct mw_rule_stats *rs;
	long err;

	if (!sk)
		return false;
	st = bpf_sk_storage_get(&mw_sk_state, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!st) {
		count_insert_failure(rule_id, -ENOMEM);
		return false;
	}
	__builtin_memcpy(&st->peer, peer, sizeof(*peer));
	st->rule_id = rule_id;
	st->flags = MW_SOCK_NEEDS_SYNC;

	err = bpf_sock_hash_update(skops, &mw_sockhash, own, BPF_ANY);
	if (err) {
		count_insert_failure(rule_id, err);
		bpf_sk_storage_delete(&mw_sk_state, sk);
		return false;
	}
	rs = rule_stats(rule_id);
	if (rs)
		rs->sockets++;
	return true;
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

static __always_inline __u64 client_netns(struct bpf_sock_ops *skops, __u32 family,
					  const __u32 *client_ip)
{
	return ip_is_loopback(family, client_ip) ? bpf_get_netns_cookie(skops) : 0;
}

static __always_inline void on_active_established(struct bpf_sock_ops *skops, const struct tuple *t)
{
	struct mw_sock_key own = {}, peer = {};
	struct mw_endpoint_key ek = {};
	struct mw_origin origin = {};
	struct mw_global_stats *gs;
	struct mw_rule *rule;

	rule = match_pair(skops, t, true);
	if (rule) {
		tuple_keys(skops, t, &own, &peer);
		insert_socket(skops, &own, &peer, rule->id);
		return;
	}
	rule = match_capture(t);
	if (!rule) {
		gs = global_stats();
		if (gs)
			gs->not_covered++;
		return;
	}
	ek.family = t->family;
	copy_ip(ek.ip, t->local_ip);
	ek.port = t->local_port;
	ek.netns = client_netns(skops, t->family, t->local_ip);
	origin.rule_id = rule->id;
	origin.listener_port = rule->listener_port;
	copy_ip(origin.listener_ip, rule->listener_ip);
	origin.cookie = bpf_get_socket_cookie(skops);
	capture_keys(skops, t->family, t->local_ip, t->local_port, ek.netns, true, &own, &peer);
	if (!insert_socket(skops, &own, &peer, rule->id))
		return;
	/* Announce the origin to the listener side, and forget it on close. */
	bpf_map_update_elem(&mw_origins, &ek, &origin, BPF_ANY);
	bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
}

static __always_inline void on_passive_established(struct bpf_sock_ops *skops, const struct tuple *t)
{
	struct mw_sock_key own = {}, peer = {};
	struct mw_endpoint_key ek = {};
	struct mw_global_stats *gs;
	struct mw_origin *origin;
	struct mw_rule *rule;

	rule = match_pair(skops, t, false);
	if (rule) {
		tuple_keys(skops, t, &own, &peer);
		insert_socket(skops, &own, &peer, rule->id);
		return;
	}
	/* Accepted by a capture listener from a known origin? */
	ek.family = t->family;
	copy_ip(ek.ip, t->remote_ip);
	ek.port = t->remote_port;
	ek.netns = client_netns(skops, t->family, t->remote_ip);
	origin = bpf_map_lookup_elem(&mw_origins, &ek);
	if (origin && origin->listener_port == t->local_port &&
	    ip_eq(origin->listener_ip, t->local_ip)) {
		capture_keys(skops, t->family, t->remote_ip, t->remote_port, ek.netns, false,
			     &own, &peer);
		insert_socket(skops, &own, &peer, origin->rule_id);
		return;
	}
	gs = global_stats();
	if (gs)
		gs->not_covered++;
}

static __always_inline void on_state_change(struct bpf_sock_ops *skops)
{
	struct mw_endpoint_key ek = {};
	struct mw_origin *origin;
	struct tuple t;

	if (skops->args[1] != TCP_CLOSE_STATE)
		return;
	if (!load_tuple(skops, &t))
		return;
	ek.family = t.family;
	copy_ip(ek.ip, t.local_ip);
	ek.port = t.local_port;
	ek.netns = client_netns(skops, t.family, t.local_ip);
	origin = bpf_map_lookup_elem(&mw_origins, &ek);
	if (origin && origin->cookie == bpf_get_socket_cookie(skops))
		bpf_map_delete_elem(&mw_origins, &ek);
}

/* The rule id covering a connection, without changing anything; MW_NO_ID if
 * none does. What on_connection plugins are told before the host decides. */
static __always_inline __u32 covering_rule(struct bpf_sock_ops *skops, const struct tuple *t, bool active)
{
	struct mw_endpoint_key ek = {};
	struct mw_origin *origin;
	struct mw_rule *rule;

	rule = match_pair(skops, t, active);
	if (rule)
		return rule->id;
	if (active) {
		rule = match_capture(t);
		return rule ? rule->id : MW_NO_ID;
	}
	ek.family = t->family;
	copy_ip(ek.ip, t->remote_ip);
	ek.port = t->remote_port;
	ek.netns = client_netns(skops, t->family, t->remote_ip);
	origin = bpf_map_lookup_elem(&mw_origins, &ek);
	if (origin && origin->listener_port == t->local_port && ip_eq(origin->listener_ip, t->local_ip))
		return origin->rule_id;
	return MW_NO_ID;
}

static __always_inline void on_established(struct bpf_sock_ops *skops, const struct tuple *t, __u32 op)
{
	if (op == BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB)
		on_active_established(skops, t);
	else
		on_passive_established(skops, t);
}

/* Runs the on_connection chain for a covered connection. Returns only when
 * the chain is empty or its first program is absent (fail-open); *declined
 * is set when that plugin asked to fail closed. */
static __always_inline void run_conn_chain(struct bpf_sock_ops *skops, const struct tuple *t, __u32 op,
					   bool *declined)
{
	struct bpf_sock *sk = skops->sk;
	struct mw_sock_state *st;
	__u32 gen, id;

	if (!mw_active_chain(MW_HOOK_CONNECTION, &gen) || !sk)
		return;
	id = covering_rule(skops, t, op == BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB);
	if (id == MW_NO_ID)
		return;
	st = bpf_sk_storage_get(&mw_sk_state, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!st)
		return;
	st->rule_id = id;
	st->flags = mw_sock_chain_set(0, gen, 0);
	bpf_tail_call(skops, &mw_ch_conn, gen * MW_CHAIN_MAX);
	*declined = mw_chain_fails_closed(gen, MW_HOOK_CONNECTION, 0);
}

SEC("sockops")
int mw_sockops(struct bpf_sock_ops *skops)
{
	struct mw_global_stats *gs;
	bool declined = false;
	struct tuple t;
	__u32 op = skops->op;

	if (op == BPF_SOCK_OPS_STATE_CB) {
		on_state_change(skops);
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

/*
 * Redirected bytes land in the peer's psock queue, which a reader drains before
 * its TCP receive queue. So a direction may be redirected only if it has never
 * carried payload on the TCP path (written before the peer was in the map, or
 * while it was absent): otherwise bytes would reorder. sk_msg cannot inspect the
 * peer (bpf_sk_release is not offered to it), so such a direction stays on TCP.
 */
static __always_inline bool tcp_path_unused(struct bpf_sock *sk)
{
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(sk);

	return tp && tp->bytes_sent == 0 && tp->write_seq == tp->snd_una;
}

/* The host's decision for a message every plugin continued. */
static __always_inline int finish_msg(struct sk_msg_md *msg, struct bpf_sock *sk, struct mw_sock_state *st)
{
	struct mw_rule_stats *rs = rule_stats(st->rule_id);

	if ((st->flags & MW_SOCK_NEEDS_SYNC) && !tcp_path_unused(sk)) {
		if (rs)
			rs->fb_tcp_path++;
		return SK_PASS;
	}
	if (bpf_msg_redirect_hash(msg, &mw_sockhash, &st->peer, BPF_F_INGRESS) != SK_PASS) {
		/* Peer absent: this message takes the TCP path. */
		st->flags |= MW_SOCK_NEEDS_SYNC;
		if (rs)
			rs->fb_no_peer++;
		return SK_PASS;
	}
	st->flags &= ~MW_SOCK_NEEDS_SYNC;
	if (rs) {
		rs->msgs++;
		rs->bytes += msg->size;
	}
	return SK_PASS;
}

static __always_inline struct mw_sock_state *msg_state(struct bpf_sock *sk)
{
	struct mw_global_stats *gs;
	struct mw_sock_state *st;

	if (!sk)
		return NULL;
	st = bpf_sk_storage_get(&mw_sk_state, sk, 0, 0);
	if (!st) {
		gs = global_stats();
		if (gs)
			gs->no_state++;
	}
	return st;
}

SEC("sk_msg")
int mw_sk_msg(struct sk_msg_md *msg)
{
	struct bpf_sock *sk = msg->sk;
	struct mw_sock_state *st;
	__u32 gen;

	st = msg_state(sk);
	if (!st || !sk)
		return SK_PASS;
	if (mw_active_chain(MW_HOOK_MESSAGE, &gen)) {
		st->flags = mw_sock_chain_set(st->flags, gen, 0);
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

char LICENSE[] SEC("license") = "Dual BSD/GPL";
