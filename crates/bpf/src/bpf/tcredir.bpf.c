// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * tc redirection: packets entering (or leaving) an attached interface are
 * matched against the interface routes registered for that attach point
 * (longest destination prefix wins, optional source prefix) and redirected to
 * another interface, into a veth peer, or via the neighbour subsystem, with an
 * optional MAC rewrite. A miss, or a redirect the kernel refuses, is TC_ACT_OK:
 * the normal path.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "meshwarp/shared.h"
#include "meshwarp/chain.h"
#include "meshwarp/latency.h"

#define TC_ACT_OK 0
#define TC_ACT_SHOT 2
#define TC_ACT_REDIRECT 7
#define ETH_P_IP 0x0800
#define ETH_P_IPV6 0x86DD

MW_MAP(mw_rt4, BPF_MAP_TYPE_LPM_TRIE, struct mw_route_key4, struct mw_route, 16384, BPF_F_NO_PREALLOC);

MW_MAP(mw_rt6, BPF_MAP_TYPE_LPM_TRIE, struct mw_route_key6, struct mw_route, 16384, BPF_F_NO_PREALLOC);

MW_MAP(mw_rt_stats, BPF_MAP_TYPE_PERCPU_ARRAY, __u32, struct mw_route_stats, 16384, 0);

MW_MAP(mw_att_stats, BPF_MAP_TYPE_PERCPU_HASH, struct mw_attach_key, struct mw_attach_stats, 1024, 0);

/* Owner of each route slot; read only by user space, pinned so a restarted
 * agent keeps ownership. */
MW_MAP(mw_rt_owner, BPF_MAP_TYPE_HASH, __u32, struct mw_owner, 16384, BPF_F_NO_PREALLOC);

/* Plugin chain of on_packet (both directions). */
MW_DEFINE_CHAIN_PROGS(mw_ch_pkt);
/* The build that loaded these programs (struct mw_build, shared.h): an
 * adopting agent of another build replaces them in place. */
MW_MAP(mw_build, BPF_MAP_TYPE_ARRAY, __u32, struct mw_build, 1, 0);
/* The packet a chain runs for, as the host saw it (interface in the high
 * word, direction in the low), per CPU: plugins can rewrite skb->cb, so the
 * finisher acts only when the chain state there agrees with this. */
MW_MAP(mw_pkt_dir, BPF_MAP_TYPE_PERCPU_ARRAY, __u32, __u64, 1, 0);

/* ---- the latency monitor (shared.h): transit time per route ---- */

/* Its switch: flags MW_CFG_LATENCY (| MW_CFG_LAT_ALL, since lat_since). */
MW_MAP(mw_config, BPF_MAP_TYPE_ARRAY, __u32, struct mw_config, 1, 0);
/* Per route id: when the monitor was switched on for it, 0 while off. */
MW_MAP(mw_lat_rule, BPF_MAP_TYPE_ARRAY, __u32, __u64, 16384, 0);
/* Histograms of route ids below MW_LAT_ROWS, by index (sized at load). */
MW_MAP(mw_lat_rows, BPF_MAP_TYPE_PERCPU_ARRAY, __u32, struct mw_lat_hist, MW_LAT_ROWS * MW_LAT_RT_ROW_METRICS, 0);
/* The other routes' histograms; not preallocated. */
MW_MAP(mw_lat_hist, BPF_MAP_TYPE_PERCPU_HASH, struct mw_lat_key, struct mw_lat_hist, 16384, BPF_F_NO_PREALLOC);
/* Never written: the zeroes a new histogram starts from. */
MW_MAP(mw_lat_zero, BPF_MAP_TYPE_ARRAY, __u32, struct mw_lat_hist, 1, 0);

/* Plugin metadata and the grace-period map (chain.h). */
MW_DEFINE_HOST_PLUGIN_MAPS();

static __always_inline bool src_matches(const struct mw_route *r, const __u8 *src, __u32 len)
{
	__u32 bits = r->src_prefixlen;

	if (!(r->flags & MW_ROUTE_HAS_SRC))
		return true;
#pragma unroll
	for (int i = 0; i < 16; i++) {
		__u8 mask;

		if (i >= len || bits == 0)
			break;
		mask = bits >= 8 ? 0xff : (__u8)(0xff << (8 - bits));
		if ((src[i] & mask) != (r->src[i] & mask))
			return false;
		bits = bits >= 8 ? bits - 8 : 0;
	}
	return true;
}

static __always_inline void count_attach(struct __sk_buff *skb, __u32 dir, bool miss)
{
	struct mw_attach_key k = { .ifindex = skb->ifindex, .dir = dir };
	struct mw_attach_stats *s = bpf_map_lookup_elem(&mw_att_stats, &k);

	if (!s) {
		struct mw_attach_stats zero = {};

		bpf_map_update_elem(&mw_att_stats, &k, &zero, BPF_NOEXIST);
		s = bpf_map_lookup_elem(&mw_att_stats, &k);
		if (!s)
			return;
	}
	s->packets++;
	if (miss)
		s->misses++;
}

/* A packet route `id` redirected: its age since its sender's TCP transmit,
 * while the monitor runs for the route. Only a monotonic delivery time is
 * TCP's departure stamp (reading tstamp_type also lets ingress see it). */
static __always_inline void route_latency(struct __sk_buff *skb, __u32 id)
{
	struct mw_lat_key k = { .rule_id = id, .metric = MW_LAT_TRANSIT, .from_rule = MW_NO_ID };
	struct mw_lat_hist *h;
	struct mw_config *c;
	__u64 since, t, now, *on;
	__u32 zero = 0;

	c = bpf_map_lookup_elem(&mw_config, &zero);
	if (!c || !(c->flags & MW_CFG_LATENCY))
		return;
	if (c->flags & MW_CFG_LAT_ALL) {
		since = c->lat_since;
	} else {
		on = bpf_map_lookup_elem(&mw_lat_rule, &id);
		since = on ? *on : 0;
	}
	if (!since || skb->tstamp_type != BPF_SKB_TSTAMP_DELIVERY_MONO)
		return;
	t = skb->tstamp;
	now = bpf_ktime_get_ns();
	/* A departure time ahead of now is pacing's (EDT), not a transmit. */
	if (t < since || now < t)
		return;
	h = id < MW_LAT_ROWS ? bpf_map_lookup_elem(&mw_lat_rows, &id) : NULL;
	if (!h)
		h = mw_hist_of(&mw_lat_hist, &mw_lat_zero, &k);
	if (h)
		mw_hist_add(h, now - t);
}

static __always_inline int apply(struct __sk_buff *skb, const struct mw_route *r)
{
	struct mw_route_stats *st = bpf_map_lookup_elem(&mw_rt_stats, &r->id);
	struct bpf_redir_neigh nh = {};
	long ret;

	switch (r->action) {
	case MW_ACT_REDIRECT:
		ret = bpf_redirect(r->target_ifindex, 0);
		break;
	case MW_ACT_REDIRECT_PEER:
		ret = bpf_redirect_peer(r->target_ifindex, 0);
		break;
	case MW_ACT_REDIRECT_NEIGH:
		if (r->flags & MW_ROUTE_HAS_NEXTHOP) {
			nh.nh_family = r->nh_family;
			__builtin_memcpy(&nh.ipv6_nh, r->nh_addr, 16);
			ret = bpf_redirect_neigh(r->target_ifindex, &nh, sizeof(nh), 0);
		} else {
			ret = bpf_redirect_neigh(r->target_ifindex, NULL, 0, 0);
		}
		break;
	default:
		goto refused;
	}
	if (ret != TC_ACT_REDIRECT)
		goto refused;
	/* Only a packet that leaves redirected gets new addresses, both in one
	 * store: a refused redirect (here or by the store) passes the packet
	 * exactly as it came. The helpers above only record the target; the
	 * kernel redirects after the program returns TC_ACT_REDIRECT. */
	if (r->flags & MW_ROUTE_REWRITE_MAC) {
		__u8 macs[12];

		__builtin_memcpy(macs, r->dmac, 6);
		__builtin_memcpy(macs + 6, r->smac, 6);
		if (bpf_skb_store_bytes(skb, 0, macs, sizeof(macs), 0))
			goto refused;
	}
	if (st) {
		st->packets++;
		st->bytes += skb->len;
	}
	route_latency(skb, r->id);
	return TC_ACT_REDIRECT;
refused:
	if (st)
		st->redirect_err++;
	return TC_ACT_OK;
}

static __always_inline struct mw_route *lookup_route(struct __sk_buff *skb, __u32 dir)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct mw_route *r = NULL;

	if ((void *)(eth + 1) > end)
		return NULL;
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = (void *)(eth + 1);
		struct mw_route_key4 k = { .prefixlen = 64 + 32, .ifindex = skb->ifindex, .dir = dir };

		if ((void *)(ip + 1) > end)
			return NULL;
		__builtin_memcpy(k.dst, &ip->daddr, 4);
		r = bpf_map_lookup_elem(&mw_rt4, &k);
		if (r && !src_matches(r, (const __u8 *)&ip->saddr, 4))
			r = NULL;
	} else if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);
		struct mw_route_key6 k = { .prefixlen = 64 + 128, .ifindex = skb->ifindex, .dir = dir };
		__u8 src[16];

		if ((void *)(ip6 + 1) > end)
			return NULL;
		__builtin_memcpy(k.dst, &ip6->daddr, 16);
		__builtin_memcpy(src, &ip6->saddr, 16);
		r = bpf_map_lookup_elem(&mw_rt6, &k);
		if (r && !src_matches(r, src, 16))
			r = NULL;
	}
	return r;
}

static __always_inline int finish(struct __sk_buff *skb, __u32 dir, const struct mw_route *r)
{
	count_attach(skb, dir, !r);
	return r ? apply(skb, r) : TC_ACT_OK;
}

static __always_inline int handle(struct __sk_buff *skb, __u32 dir)
{
	struct mw_route *r = lookup_route(skb, dir);
	__u32 gen;

	if (mw_active_chain(MW_HOOK_PACKET, &gen)) {
		__u32 zero = 0;
		__u64 *seen = bpf_map_lookup_elem(&mw_pkt_dir, &zero);

		if (seen)
			*seen = ((__u64)skb->ifindex << 32) | dir;
		skb->cb[MW_CB_CHAIN] = mw_cb_chain(gen, 0, dir);
		skb->cb[MW_CB_ROUTE] = r ? r->id : MW_NO_ID;
		bpf_tail_call(skb, &mw_ch_pkt, gen * MW_CHAIN_MAX);
		if (mw_chain_fails_closed(gen, MW_HOOK_PACKET, 0))
			return TC_ACT_SHOT;
	}
	return finish(skb, dir, r);
}

SEC("tc")
int mw_tc_ingress(struct __sk_buff *skb)
{
	return handle(skb, MW_DIR_INGRESS);
}

SEC("tc")
int mw_tc_egress(struct __sk_buff *skb)
{
	return handle(skb, MW_DIR_EGRESS);
}

/* End of the on_packet chain: every plugin continued. */
SEC("tc")
int mw_pkt_fin(struct __sk_buff *skb)
{
	__u32 cb = skb->cb[MW_CB_CHAIN], dir = (cb >> 12) & 0xf, zero = 0;
	__u64 *seen = bpf_map_lookup_elem(&mw_pkt_dir, &zero);

	if ((cb & 0xffff0000u) != MW_CB_MAGIC)
		return TC_ACT_OK;
	/* A direction a plugin rewrote (or, rarely, another packet of this CPU
	 * in between): the normal path. */
	if (!seen || *seen != (((__u64)skb->ifindex << 32) | dir))
		return TC_ACT_OK;
	return finish(skb, dir, lookup_route(skb, dir));
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
