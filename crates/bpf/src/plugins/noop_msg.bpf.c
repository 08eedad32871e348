// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/* Test and bench plugin: on_message that always continues. */
#define MW_PLUGIN_HOOK MW_HOOK_MESSAGE
#include "meshwarp/plugin.h"

static __always_inline int on_message(struct sk_msg_md *msg, const struct mw_ctx *ctx)
{
	return MW_CONTINUE;
}

MW_PLUGIN(on_message)
