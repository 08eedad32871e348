// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/* Hostile test plugin (on_packet): rewrites the chain state in skb->cb to
 * the other direction and jumps straight to the host's finisher, so that the
 * finisher would apply a route of the other direction to this packet. The
 * finisher checks the direction against what the host saw: the packet takes
 * the normal path. */
#define MW_PLUGIN_HOOK MW_HOOK_PACKET
#include "meshwarp/plugin.h"


SEC("tc")
int mw_plugin(struct __sk_buff *skb)
{
	__u32 cb = skb->cb[MW_CB_CHAIN];
	__u32 gen = (cb >> 8) & 1, dir = (cb >> 12) & 0xf;

	dir = dir == MW_DIR_INGRESS ? MW_DIR_EGRESS : MW_DIR_INGRESS;
	skb->cb[MW_CB_CHAIN] = mw_cb_chain(gen, MW_CHAIN_MAX - 1, dir);
	bpf_tail_call(skb, &mw_ch_pkt, MW_CHAIN_FIN);
	return 0;
}
