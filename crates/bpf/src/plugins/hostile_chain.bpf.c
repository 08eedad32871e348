// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/* Hostile test plugin: tries to switch its neighbours off by emptying the
 * chain positions after its own. mw_chain is read-only to programs
 * (BPF_F_RDONLY_PROG): the verifier must refuse this object. */
#define MW_PLUGIN_HOOK MW_HOOK_MESSAGE
#include "meshwarp/plugin.h"

static __always_inline int on_message(struct sk_msg_md *msg, const struct mw_ctx *ctx)
{
	__u32 i = 1;
	struct mw_chain_pos *next = bpf_map_lookup_elem(&mw_chain, &i);

	if (next)
		next->plugin_id = 0;
	return MW_CONTINUE;
}

MW_PLUGIN(on_message)
