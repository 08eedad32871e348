// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * Per-pair byte counter and sampler (on_message): counts messages and bytes of
 * every pair or capture rule in its own map (mw_samples, keyed by rule id) and
 * samples every Nth message of a rule (its size). Never changes a verdict.
 *
 * Config: optional little-endian u32 N (sample every Nth message); absent or 0
 * means 1.
 */
#define MW_PLUGIN_HOOK MW_HOOK_MESSAGE
#include "meshwarp/plugin.h"

struct mw_sample {
	__u64 msgs;
	__u64 bytes;
	__u64 sampled;       /* messages sampled */
	__u64 sampled_bytes; /* their bytes */
	__u64 last_sample;   /* size of the last sampled message */
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32);
	__type(value, struct mw_sample);
} mw_samples SEC(".maps");

static __always_inline __u32 sample_every(const struct mw_ctx *ctx)
{
	const struct mw_plugin_config *cfg = mw_config(ctx);
	__u32 n;

	if (!cfg || cfg->len < 4)
		return 1;
	n = cfg->data[0] | (cfg->data[1] << 8) | (cfg->data[2] << 16) | ((__u32)cfg->data[3] << 24);
	return n ? n : 1;
}

static __always_inline int on_message(struct sk_msg_md *msg, const struct mw_ctx *ctx)
{
	__u32 id = ctx->id;
	struct mw_sample *s = bpf_map_lookup_elem(&mw_samples, &id);
	__u64 seen;

	if (!s) {
		struct mw_sample zero = {};

		bpf_map_update_elem(&mw_samples, &id, &zero, BPF_NOEXIST);
		s = bpf_map_lookup_elem(&mw_samples, &id);
		if (!s)
			return MW_CONTINUE;
	}
	seen = __sync_fetch_and_add(&s->msgs, 1);
	__sync_fetch_and_add(&s->bytes, ctx->size);
	if ((seen + 1) % sample_every(ctx) == 0) {
		__sync_fetch_and_add(&s->sampled, 1);
		__sync_fetch_and_add(&s->sampled_bytes, ctx->size);
		s->last_sample = ctx->size;
	}
	return MW_CONTINUE;
}

MW_PLUGIN(on_message)
