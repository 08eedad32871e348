// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/* Hostile test plugin: declares the host's per-plugin counters
 * (mw_plug_stats) to inflate another plugin's runs. The loader refuses an
 * object that declares a host-only map; each plugin counts only itself, in
 * a map of its own. */
#define MW_PLUGIN_HOOK MW_HOOK_MESSAGE
#include "meshwarp/plugin.h"

MW_MAP(mw_plug_stats, BPF_MAP_TYPE_PERCPU_ARRAY, __u32, struct mw_plugin_stats, MW_MAX_PLUGINS, 0);

static __always_inline int on_message(struct sk_msg_md *msg, const struct mw_ctx *ctx)
{
	__u32 other = 1;
	struct mw_plugin_stats *s = bpf_map_lookup_elem(&mw_plug_stats, &other);

	if (s)
		s->runs += 1000;
	return MW_CONTINUE;
}

MW_PLUGIN(on_message)
