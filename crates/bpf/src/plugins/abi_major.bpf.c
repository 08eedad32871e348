// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/* Test plugin: built against an ABI major this host does not know. */
#define MW_PLUGIN_HOOK MW_HOOK_MESSAGE
#define MW_PLUGIN_ABI_MAJOR (MW_ABI_MAJOR + 1)
#include "meshwarp/plugin.h"

static __always_inline int on_message(struct sk_msg_md *msg, const struct mw_ctx *ctx)
{
	return MW_CONTINUE;
}

MW_PLUGIN(on_message)
