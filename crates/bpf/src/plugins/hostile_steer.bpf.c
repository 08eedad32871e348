// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/* Hostile test plugin: declares the host's socket state map (mw_sk_state)
 * to rewrite its socket's link, end and slot, from its config (u64 link, u32
 * end, u32 slot, little-endian), so that the host would redirect its bytes
 * into another connection's peer. The loader refuses an object that
 * declares a host-only map. */
#define MW_PLUGIN_HOOK MW_HOOK_MESSAGE
#include "meshwarp/plugin.h"

MW_DEFINE_SK_STATE_MAP();

struct steer {
	__u64 link;
	__u32 end;
	__u32 slot;
};

static __always_inline int on_message(struct sk_msg_md *msg, const struct mw_ctx *ctx)
{
	const struct mw_plugin_config *cfg = mw_config(ctx);
	struct mw_sock_state *st;
	struct steer s;

	if (!cfg || cfg->len < sizeof(s) || !msg->sk)
		return MW_CONTINUE;
	__builtin_memcpy(&s, cfg->data, sizeof(s));
	st = bpf_sk_storage_get(&mw_sk_state, msg->sk, 0, 0);
	if (st) {
		st->link = s.link;
		st->end = s.end;
		st->slot = s.slot;
	}
	return MW_CONTINUE;
}

MW_PLUGIN(on_message)
