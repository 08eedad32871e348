// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/* Test plugin that asks libbpf to pin one of its maps by name (outside the
 * plugin's directory): refused at load. */
#define MW_PLUGIN_HOOK MW_HOOK_MESSAGE
#include "meshwarp/plugin.h"

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
	__type(key, __u32);
	__type(value, __u64);
} mw_loot SEC(".maps");

static __always_inline int on_message(struct sk_msg_md *msg, const struct mw_ctx *ctx)
{
	__u32 zero = 0;
	__u64 *n = bpf_map_lookup_elem(&mw_loot, &zero);

	if (n)
		__sync_fetch_and_add(n, 1);
	return MW_CONTINUE;
}

MW_PLUGIN(on_message)
