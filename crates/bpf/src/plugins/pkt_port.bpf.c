// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/* Test plugin: on_packet returning a verdict for TCP/UDP packets from or to
 * one port. Config: little-endian u16 port, u16 verdict. */
#define MW_PLUGIN_HOOK MW_HOOK_PACKET
#include "meshwarp/plugin.h"

static __always_inline int on_packet(struct __sk_buff *skb, const struct mw_ctx *ctx)
{
	const struct mw_plugin_config *cfg = mw_config(ctx);
	__u32 port;

	if (!cfg || cfg->len < 4)
		return MW_CONTINUE;
	port = cfg->data[0] | (cfg->data[1] << 8);
	if (ctx->local_port == port || ctx->remote_port == port)
		return cfg->data[2] | (cfg->data[3] << 8);
	return MW_CONTINUE;
}

MW_PLUGIN(on_packet)
