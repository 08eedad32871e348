/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * meshwarp plugin ABI, for plugin authors.
 *
 * A plugin is one eBPF object with one callback at one hook, in the model of
 * proxy-wasm: the host gives it a configuration blob (set at load, updatable at
 * run time, read-only to the plugin), calls it at a fixed point of the data path
 * with a context, and its verdict says whether the chain continues.
 *
 *   #define MW_PLUGIN_HOOK MW_HOOK_MESSAGE
 *   #include "meshwarp/plugin.h"
 *
 *   static __always_inline int on_message(struct sk_msg_md *msg, const struct mw_ctx *ctx)
 *   {
 *           const struct mw_plugin_config *cfg = mw_config(ctx);
 *           return cfg && cfg->len && msg->size > 4096 ? MW_BYPASS : MW_CONTINUE;
 *   }
 *   MW_PLUGIN(on_message)
 *
 * Hooks and verdicts:
 *   MW_HOOK_CONNECTION  int fn(struct bpf_sock_ops *, const struct mw_ctx *)
 *       a connection a pair or capture rule covers reached ESTABLISHED (each end
 *       separately): MW_CONTINUE, or MW_DECLINE (this end is not accelerated).
 *   MW_HOOK_MESSAGE     int fn(struct sk_msg_md *, const struct mw_ctx *)
 *       a message sent on an accelerated socket: MW_CONTINUE, MW_BYPASS (the
 *       message takes the normal TCP path; to keep bytes in order, this
 *       direction comes back to the fast path only once the peer has read
 *       every byte it sent on TCP), or MW_DROP (the send fails with EACCES).
 *   MW_HOOK_PACKET      int fn(struct __sk_buff *, const struct mw_ctx *)
 *       a packet on an interface meshwarp is attached to: MW_CONTINUE, MW_PASS
 *       (the normal path, meshwarp's routes not applied), or MW_DROP.
 * Any other value counts as invalid and is treated as MW_CONTINUE, or, for a
 * plugin loaded fail-closed, as MW_DECLINE / MW_DROP / MW_DROP.
 *
 * The object carries its ABI version in the ".mw_abi" section; the host refuses
 * another major and a newer minor than its own. This header also defines the
 * object's single program (mw_plugin), the shared maps it reuses from the host,
 * and its license ("Dual BSD/GPL", as the host's programs). A plugin may
 * declare maps of its own; they are pinned under the plugin's directory for tools to read.
 */
#ifndef MESHWARP_PLUGIN_H
#define MESHWARP_PLUGIN_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "meshwarp/shared.h"
#include "meshwarp/chain.h"

#ifndef MW_PLUGIN_HOOK
#error "define MW_PLUGIN_HOOK (MW_HOOK_CONNECTION, MW_HOOK_MESSAGE or MW_HOOK_PACKET) before including meshwarp/plugin.h"
#endif
/* What this plugin was built against (overridable only to test the host). */
#ifndef MW_PLUGIN_ABI_MAJOR
#define MW_PLUGIN_ABI_MAJOR MW_ABI_MAJOR
#endif
#ifndef MW_PLUGIN_ABI_MINOR
#define MW_PLUGIN_ABI_MINOR MW_ABI_MINOR
#endif

const struct mw_plugin_abi mw_abi SEC(".mw_abi") __attribute__((used)) = {
	.major = MW_PLUGIN_ABI_MAJOR,
	.minor = MW_PLUGIN_ABI_MINOR,
	.hook = MW_PLUGIN_HOOK,
};

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* mw_ctx.flags */
#define MW_CTX_ACTIVE 1u  /* sockets: this end opened the connection */
#define MW_CTX_EGRESS 2u  /* packets: egress hook (else ingress) */

/* What the callback is told. Addresses are network order, 16 bytes for both
 * families (IPv4 in word 0), ports host order. For packets "local" is the
 * source and "remote" the destination. */
struct mw_ctx {
	__u32 hook;
	__u32 id;        /* pair / capture rule id, or route id; MW_NO_ID if none */
	__u32 plugin_id;
	__u32 cfg_slot;
	__u32 family;    /* MW_AF_INET, MW_AF_INET6; 0 for non-IP packets */
	__u32 flags;     /* MW_CTX_* */
	__u32 local_ip[4];
	__u32 remote_ip[4];
	__u32 local_port;
	__u32 remote_port;
	__u32 size;      /* message or packet bytes */
	__u32 protocol;  /* IPPROTO_* (sockets: TCP) */
};

/* The plugin's configuration (len bytes of data), or NULL. Read-only. */
static __always_inline const struct mw_plugin_config *mw_config(const struct mw_ctx *ctx)
{
	__u32 slot = ctx->cfg_slot;

	return bpf_map_lookup_elem(&mw_plug_cfg, &slot);
}

/* The server port of a connection (sockets): the remote port of the end that
 * opened it, the local port of the accepting end. */
static __always_inline __u32 mw_server_port(const struct mw_ctx *ctx)
{
	return (ctx->flags & MW_CTX_ACTIVE) ? ctx->remote_port : ctx->local_port;
}

/* This plugin's own counters (one entry); the host reads them from its pins. */
MW_MAP(mw_own_stats, BPF_MAP_TYPE_PERCPU_ARRAY, __u32, struct mw_plugin_stats, 1, 0);

/* Counts the verdict and applies the failure policy to invalid ones. */
static __always_inline int mw__account(const struct mw_chain_pos *p, int v, int max_verdict, int closed)
{
	__u32 zero = 0;
	struct mw_plugin_stats *s = bpf_map_lookup_elem(&mw_own_stats, &zero);

	if (v < MW_CONTINUE || v > max_verdict) {
		if (s) {
			s->runs++;
			s->invalid++;
		}
		return (p->flags & MW_PLUGIN_FAIL_CLOSED) ? closed : MW_CONTINUE;
	}
	if (s) {
		s->runs++;
		if (v == MW_CONTINUE)
			s->cont++;
		else if (v == MW_DROP)
			s->drop++;
		else
			s->verdict1++;
	}
	return v;
}

static __always_inline void mw__ctx_init(struct mw_ctx *c, const struct mw_chain_pos *p, __u32 id)
{
	__builtin_memset(c, 0, sizeof(*c));
	c->hook = MW_PLUGIN_HOOK;
	c->id = id;
	c->plugin_id = p->plugin_id;
	c->cfg_slot = p->cfg_slot;
}

/* Fills the tuple; every field is read unconditionally (the verifier refuses
 * context loads through a pointer clang merged across branches). */
#define MW__SOCK_TUPLE(c, x, rport)                                                      \
	do {                                                                             \
		__u32 fam_ = (x)->family, l4_ = (x)->local_ip4, r4_ = (x)->remote_ip4;    \
		__u32 l0_ = (x)->local_ip6[0], l1_ = (x)->local_ip6[1];                  \
		__u32 l2_ = (x)->local_ip6[2], l3_ = (x)->local_ip6[3];                  \
		__u32 r0_ = (x)->remote_ip6[0], r1_ = (x)->remote_ip6[1];                \
		__u32 r2_ = (x)->remote_ip6[2], r3_ = (x)->remote_ip6[3];                \
		(c)->local_port = (x)->local_port;                                       \
		(c)->remote_port = (rport);                                              \
		(c)->protocol = 6;                                                       \
		if (fam_ == MW_AF_INET) {                                                \
			(c)->family = MW_AF_INET;                                        \
			(c)->local_ip[0] = l4_;                                          \
			(c)->remote_ip[0] = r4_;                                         \
		} else if (l0_ == 0 && l1_ == 0 && l2_ == bpf_htonl(0xffff)) {           \
			(c)->family = MW_AF_INET;                                        \
			(c)->local_ip[0] = l3_;                                          \
			(c)->remote_ip[0] = r3_;                                         \
		} else {                                                                 \
			(c)->family = MW_AF_INET6;                                       \
			(c)->local_ip[0] = l0_; (c)->local_ip[1] = l1_;                   \
			(c)->local_ip[2] = l2_; (c)->local_ip[3] = l3_;                   \
			(c)->remote_ip[0] = r0_; (c)->remote_ip[1] = r1_;                 \
			(c)->remote_ip[2] = r2_; (c)->remote_ip[3] = r3_;                 \
		}                                                                        \
	} while (0)

#if MW_PLUGIN_HOOK == MW_HOOK_CONNECTION || MW_PLUGIN_HOOK == MW_HOOK_MESSAGE

MW_DEFINE_SK_CHAIN_MAP();

/* The socket's chain state and the plugin at the position it reached; NULL:
 * nothing to run (the socket is not one meshwarp handles). */
static __always_inline const struct mw_chain_pos *mw__sock_step(struct bpf_sock *sk, struct mw_sk_chain **st,
								 __u32 *gen, __u32 *pos)
{
	if (!sk)
		return NULL;
	*st = bpf_sk_storage_get(&mw_sk_chain, sk, 0, 0);
	if (!*st)
		return NULL;
	*gen = mw_sock_chain_gen((*st)->flags);
	*pos = mw_sock_chain_pos((*st)->flags);
	return mw_chain_at(*gen, MW_PLUGIN_HOOK, *pos);
}

/* The start of a socket hook's plugin program: the socket's chain state and
 * position (`p`, `st`, `gen`, `pos`) and its context `c`; returns `pass` when
 * there is nothing to run. */
#define MW__SOCK_ENTER(ctx, pass)                                                        \
	struct bpf_sock *sk = (ctx)->sk;                                                 \
	__u32 rport = bpf_ntohl((ctx)->remote_port);                                     \
	const struct mw_chain_pos *p;                                                    \
	struct mw_sk_chain *st;                                                          \
	struct mw_ctx c;                                                                 \
	__u32 gen, pos;                                                                  \
	int v;                                                                           \
                                                                                         \
	p = mw__sock_step(sk, &st, &gen, &pos);                                          \
	if (!p)                                                                          \
		return (pass);                                                           \
	mw__ctx_init(&c, p, st->rule_id);                                                \
	MW__SOCK_TUPLE(&c, (ctx), rport)

/* After MW_CONTINUE: the next plugin of the socket's chain, else the host's
 * finisher, unless a refused plugin made the chain fail closed (`closed`). */
#define MW__SOCK_NEXT(ctx, chain, hook, closed, pass)                                    \
	pos++;                                                                           \
	st->flags = mw_sock_chain_set(st->flags, gen, pos);                              \
	if (pos < MW_CHAIN_MAX)                                                          \
		bpf_tail_call((ctx), &chain, gen * MW_CHAIN_MAX + pos);                  \
	if (mw_chain_fails_closed(gen, hook, pos))                                       \
		return (closed);                                                         \
	bpf_tail_call((ctx), &chain, MW_CHAIN_FIN);                                      \
	return (pass)

#endif

#if MW_PLUGIN_HOOK == MW_HOOK_CONNECTION

MW_DEFINE_CHAIN_PROGS(mw_ch_conn);

#define MW_PLUGIN(fn)                                                                    \
	SEC("sockops")                                                                   \
	int mw_plugin(struct bpf_sock_ops *skops)                                        \
	{                                                                                \
		MW__SOCK_ENTER(skops, 1);                                                \
		if (skops->op == BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB)                     \
			c.flags |= MW_CTX_ACTIVE;                                        \
		v = mw__account(p, fn(skops, &c), MW_DECLINE, MW_DECLINE);               \
		if (v != MW_CONTINUE)                                                    \
			return 1; /* declined: the host never inserts this socket */     \
		MW__SOCK_NEXT(skops, mw_ch_conn, MW_HOOK_CONNECTION, 1, 1);              \
	}

#elif MW_PLUGIN_HOOK == MW_HOOK_MESSAGE

MW_DEFINE_CHAIN_PROGS(mw_ch_msg);

#define MW_PLUGIN(fn)                                                                    \
	SEC("sk_msg")                                                                    \
	int mw_plugin(struct sk_msg_md *msg)                                             \
	{                                                                                \
		__u32 size = msg->size;                                                  \
		MW__SOCK_ENTER(msg, SK_PASS);                                            \
		c.size = size;                                                           \
		v = mw__account(p, fn(msg, &c), MW_DROP, MW_DROP);                       \
		if (v == MW_DROP)                                                        \
			return SK_DROP;                                                  \
		if (v == MW_BYPASS)                                                      \
			return SK_PASS;                                                  \
		MW__SOCK_NEXT(msg, mw_ch_msg, MW_HOOK_MESSAGE, SK_DROP, SK_PASS);        \
	}

#elif MW_PLUGIN_HOOK == MW_HOOK_PACKET

MW_DEFINE_CHAIN_PROGS(mw_ch_pkt);

#define MW__TC_ACT_OK 0
#define MW__TC_ACT_SHOT 2

/* Source/destination, protocol and ports of an IPv4/IPv6 packet. */
static __always_inline void mw__pkt_tuple(struct __sk_buff *skb, struct mw_ctx *c)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	void *l4 = NULL;

	if ((void *)(eth + 1) > end)
		return;
	if (eth->h_proto == bpf_htons(0x0800)) {
		struct iphdr *ip = (void *)(eth + 1);

		if ((void *)(ip + 1) > end)
			return;
		c->family = MW_AF_INET;
		c->local_ip[0] = ip->saddr;
		c->remote_ip[0] = ip->daddr;
		c->protocol = ip->protocol;
		if (ip->ihl == 5)
			l4 = ip + 1;
	} else if (eth->h_proto == bpf_htons(0x86DD)) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);

		if ((void *)(ip6 + 1) > end)
			return;
		c->family = MW_AF_INET6;
		__builtin_memcpy(c->local_ip, &ip6->saddr, 16);
		__builtin_memcpy(c->remote_ip, &ip6->daddr, 16);
		c->protocol = ip6->nexthdr;
		l4 = ip6 + 1;
	}
	if (l4 && (c->protocol == 6 || c->protocol == 17)) {
		__be16 *ports = l4;

		if ((void *)(ports + 2) > end)
			return;
		c->local_port = bpf_ntohs(ports[0]);
		c->remote_port = bpf_ntohs(ports[1]);
	}
}

#define MW_PLUGIN(fn)                                                                    \
	SEC("tc")                                                                        \
	int mw_plugin(struct __sk_buff *skb)                                             \
	{                                                                                \
		__u32 cb = skb->cb[MW_CB_CHAIN], route = skb->cb[MW_CB_ROUTE];           \
		__u32 gen = (cb >> 8) & 1, pos = cb & 0xff, dir = (cb >> 12) & 0xf;      \
		const struct mw_chain_pos *p;                                            \
		struct mw_ctx c;                                                         \
		int v;                                                                   \
                                                                                         \
		if ((cb & 0xffff0000u) != MW_CB_MAGIC)                                   \
			return MW__TC_ACT_OK;                                            \
		p = mw_chain_at(gen, MW_HOOK_PACKET, pos);                               \
		if (!p)                                                                  \
			return MW__TC_ACT_OK;                                            \
		mw__ctx_init(&c, p, route);                                              \
		if (dir == MW_DIR_EGRESS)                                                \
			c.flags |= MW_CTX_EGRESS;                                        \
		c.size = skb->len;                                                       \
		mw__pkt_tuple(skb, &c);                                                  \
		v = mw__account(p, fn(skb, &c), MW_DROP, MW_DROP);                       \
		if (v == MW_DROP)                                                        \
			return MW__TC_ACT_SHOT;                                          \
		if (v == MW_PASS)                                                        \
			return MW__TC_ACT_OK;                                            \
		pos++;                                                                   \
		skb->cb[MW_CB_CHAIN] = mw_cb_chain(gen, pos, dir);                       \
		if (pos < MW_CHAIN_MAX)                                                  \
			bpf_tail_call(skb, &mw_ch_pkt, gen * MW_CHAIN_MAX + pos);        \
		if (mw_chain_fails_closed(gen, MW_HOOK_PACKET, pos))                     \
			return MW__TC_ACT_SHOT;                                          \
		bpf_tail_call(skb, &mw_ch_pkt, MW_CHAIN_FIN);                            \
		return MW__TC_ACT_OK;                                                    \
	}

#else
#error "MW_PLUGIN_HOOK must be MW_HOOK_CONNECTION, MW_HOOK_MESSAGE or MW_HOOK_PACKET"
#endif

#endif /* MESHWARP_PLUGIN_H */
