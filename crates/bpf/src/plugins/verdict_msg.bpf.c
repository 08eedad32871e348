// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/* Test plugin: on_message returning the little-endian u32 in its config
 * (MW_CONTINUE without one), including values the hook does not know. */
#define MW_PLUGIN_HOOK MW_HOOK_MESSAGE
#include "meshwarp/plugin.h"

static __always_inline int on_message(struct sk_msg_md *msg, const struct mw_ctx *ctx)
{
	const struct mw_plugin_config *cfg = mw_config(ctx);

	if (!cfg || cfg->len < 4)
		return MW_CONTINUE;
	return cfg->data[0] | (cfg->data[1] << 8) | (cfg->data[2] << 16);
}

MW_PLUGIN(on_message)
