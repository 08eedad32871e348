/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The maps of the plugin chains, declared once for the host programs
 * (sockredir.bpf.c, tcredir.bpf.c) and for plugin objects (plugin.h). A plugin
 * object declares them identically and user space makes it reuse the host's
 * pinned maps, which libbpf only accepts when type, sizes and flags agree.
 *
 * A chain is a row of MW_CHAIN_MAX positions per hook and generation. A
 * message starts on the generation mw_chain_gen names for its hook and stays on
 * it; user space rebuilds the other generation, flips mw_chain_gen, waits for an
 * RCU grace period and clears the old one, so a message sees the old chain or
 * the new one, never a mix.
 */
#ifndef MESHWARP_CHAIN_H
#define MESHWARP_CHAIN_H

#include "meshwarp/shared.h"
#include "meshwarp/map.h"

/* Socket state: the host's programs only. Not BPF_F_CLONE: listeners have
 * no element (their program is kept by their service, mw_services), so an
 * accepted socket starts with none. */
#define MW_DEFINE_SK_STATE_MAP()                                 \
	struct {                                                 \
		__uint(type, BPF_MAP_TYPE_SK_STORAGE);           \
		__uint(map_flags, BPF_F_NO_PREALLOC);            \
		__type(key, int);                                \
		__type(value, struct mw_sock_state);             \
	} mw_sk_state SEC(".maps")

/* A socket's place in its plugin chain: the host and on_connection /
 * on_message plugins. */
#define MW_DEFINE_SK_CHAIN_MAP()                                 \
	struct {                                                 \
		__uint(type, BPF_MAP_TYPE_SK_STORAGE);           \
		__uint(map_flags, BPF_F_NO_PREALLOC);            \
		__type(key, int);                                \
		__type(value, struct mw_sk_chain);               \
	} mw_sk_chain SEC(".maps")

/* Chain positions of both generations, all hooks; the active generation and
 * its length per hook (see mw_active_chain); configs (two slots per plugin, so an update never tears); counters.
 * Only user space writes the first three (BPF_F_RDONLY_PROG: the verifier
 * refuses a plugin that writes them, so none can rearrange the chain or take
 * a neighbour out of it; a plugin can still end the chain early for the
 * messages it sees, since it makes the next tail call itself). */
MW_MAP(mw_chain, BPF_MAP_TYPE_ARRAY, __u32, struct mw_chain_pos, 2 * MW_HOOKS * MW_CHAIN_MAX, BPF_F_RDONLY_PROG);

MW_MAP(mw_chain_gen, BPF_MAP_TYPE_ARRAY, __u32, __u32, MW_HOOKS + 1, BPF_F_RDONLY_PROG);

MW_MAP(mw_plug_cfg, BPF_MAP_TYPE_ARRAY, __u32, struct mw_plugin_config, 2 * MW_MAX_PLUGINS, BPF_F_RDONLY_PROG);

#ifndef MW_PLUGIN_HOOK
/* Host families only: what the host counts per plugin id (`missing`). A
 * plugin counts its own runs and verdicts in a map of its own
 * (mw_own_stats, plugin.h), so it can touch no other plugin's counters. */
MW_MAP(mw_plug_stats, BPF_MAP_TYPE_PERCPU_ARRAY, __u32, struct mw_plugin_stats, MW_MAX_PLUGINS, 0);
#endif

/* The programs of one hook's chain: two generations, then the finisher. */
#define MW_DEFINE_CHAIN_PROGS(name)                                      \
	struct {                                                         \
		__uint(type, BPF_MAP_TYPE_PROG_ARRAY);                   \
		__uint(max_entries, MW_CHAIN_FIN + 1);                   \
		__type(key, __u32);                                      \
		__type(value, __u32);                                    \
	} name SEC(".maps")

/* Host families only. mw_plug_meta: what user space keeps about loaded
 * plugins. mw_grace: never read by programs; user space updates it to wait for
 * an RCU grace period (the kernel synchronizes after map-in-map updates), so
 * no program still runs on a chain generation it is about to clear. */
struct mw_grace_inner {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
};

#define MW_DEFINE_HOST_PLUGIN_MAPS()                                     \
	struct {                                                         \
		__uint(type, BPF_MAP_TYPE_HASH);                         \
		__uint(max_entries, MW_MAX_PLUGINS);                     \
		__type(key, __u32);                                      \
		__type(value, struct mw_plugin_meta);                    \
	} mw_plug_meta SEC(".maps");                                     \
	struct {                                                         \
		__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);                \
		__uint(max_entries, 1);                                  \
		__type(key, __u32);                                      \
		__array(values, struct mw_grace_inner);                  \
	} mw_grace SEC(".maps")

static __always_inline __u32 mw_chain_index(__u32 gen, __u32 hook, __u32 pos)
{
	return (gen * MW_HOOKS + (hook - 1)) * MW_CHAIN_MAX + pos;
}

static __always_inline __u32 mw_sock_chain_pos(__u32 flags)
{
	return (flags >> MW_SOCK_CHAIN_POS_SHIFT) & 0xff;
}

static __always_inline __u32 mw_sock_chain_gen(__u32 flags)
{
	return (flags >> MW_SOCK_CHAIN_GEN_SHIFT) & 1;
}

static __always_inline __u32 mw_sock_chain_set(__u32 flags, __u32 gen, __u32 pos)
{
	flags &= (1u << MW_SOCK_CHAIN_POS_SHIFT) - 1;
	return flags | (pos << MW_SOCK_CHAIN_POS_SHIFT) | (gen << MW_SOCK_CHAIN_GEN_SHIFT);
}

/* tc keeps the chain position in skb->cb[MW_CB_CHAIN] (tail calls keep the
 * skb) and the matched route in skb->cb[MW_CB_ROUTE]. */
#define MW_CB_CHAIN 0
#define MW_CB_ROUTE 1
#define MW_CB_MAGIC 0x6d770000u

static __always_inline __u32 mw_cb_chain(__u32 gen, __u32 pos, __u32 dir)
{
	return MW_CB_MAGIC | (dir << 12) | (gen << 8) | pos;
}

/* The hook's active chain: its length (0: no plugins), and its generation in
 * *gen. mw_chain_gen[hook] holds the generation in bit 0 and the length from
 * bit 8, so a hook without plugins costs one lookup. */
static __always_inline __u32 mw_active_chain(__u32 hook, __u32 *gen)
{
	__u32 *g = bpf_map_lookup_elem(&mw_chain_gen, &hook);
	__u32 v = g ? *g : 0;

	*gen = v & 1;
	return v >> 8;
}

/* The plugin at a chain position; NULL (or plugin_id 0) past the chain's end. */
static __always_inline const struct mw_chain_pos *mw_chain_at(__u32 gen, __u32 hook, __u32 pos)
{
	__u32 i = mw_chain_index(gen, hook, pos);

	if (pos >= MW_CHAIN_MAX)
		return NULL;
	return bpf_map_lookup_elem(&mw_chain, &i);
}

/* The tail call into position `pos` returned: its program is absent. Past the
 * end of the chain that is normal; for a plugin the chain expects it is
 * counted, and the chain fails closed if that plugin asked for it. */
static __always_inline bool mw_chain_fails_closed(__u32 gen, __u32 hook, __u32 pos)
{
	const struct mw_chain_pos *p = mw_chain_at(gen, hook, pos);
	struct mw_plugin_stats *s;
	__u32 id;

	if (!p || !p->plugin_id)
		return false;
	id = p->plugin_id;
#ifndef MW_PLUGIN_HOOK
	s = bpf_map_lookup_elem(&mw_plug_stats, &id);
	if (s)
		s->missing++;
#else
	/* A plugin cannot reach the host's counters: only the host counts. */
	(void)s;
	(void)id;
#endif
	return p->flags & MW_PLUGIN_FAIL_CLOSED;
}

#endif /* MESHWARP_CHAIN_H */
