// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/* Test plugin the verifier must refuse: it indexes its config with the
 * message size, which may lie past the end of the map value. */
#define MW_PLUGIN_HOOK MW_HOOK_MESSAGE
#include "meshwarp/plugin.h"

static __always_inline int on_message(struct sk_msg_md *msg, const struct mw_ctx *ctx)
{
	const struct mw_plugin_config *cfg = mw_config(ctx);

	if (!cfg)
		return MW_CONTINUE;
	return cfg->data[ctx->size] == 1 ? MW_BYPASS : MW_CONTINUE;
}

MW_PLUGIN(on_message)
