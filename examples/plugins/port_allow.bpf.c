// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * Port allowlist (on_connection): only connections whose server port is in the
 * configured list are accelerated; every other covered connection is declined
 * and keeps the normal TCP path.
 *
 * Config: up to 64 ports, each a little-endian u16 (so the config is 2 * n
 * bytes). An empty config declines everything.
 */
#define MW_PLUGIN_HOOK MW_HOOK_CONNECTION
#include "meshwarp/plugin.h"

#define MAX_PORTS 64

static __always_inline int on_connection(struct bpf_sock_ops *skops, const struct mw_ctx *ctx)
{
	const struct mw_plugin_config *cfg = mw_config(ctx);
	__u32 port = mw_server_port(ctx);

	if (!cfg)
		return MW_DECLINE;
	for (int i = 0; i < MAX_PORTS; i++) {
		__u32 off = i * 2;

		if (off + 2 > cfg->len)
			break;
		if ((cfg->data[off] | (cfg->data[off + 1] << 8)) == port)
			return MW_CONTINUE;
	}
	return MW_DECLINE;
}

MW_PLUGIN(on_connection)
