// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * Token-bucket rate limiter (on_message), one bucket per pair or capture rule.
 * Within the rate a message continues; beyond it, it is dropped (the send
 * fails with EACCES) or bypasses acceleration (the message, and the rest of
 * that direction, takes the normal TCP path).
 *
 * Config (little-endian, 24 bytes):
 *   u32 mode   1 = drop, 2 = bypass
 *   u32 unit   1 = messages, 2 = bytes
 *   u64 rate   tokens per second (0: no refill)
 *   u64 burst  bucket size; the bucket starts full
 * A missing or short config lets everything through.
 */
#define MW_PLUGIN_HOOK MW_HOOK_MESSAGE
#include "meshwarp/plugin.h"

#define MODE_DROP 1
#define MODE_BYPASS 2
#define UNIT_BYTES 2
#define NSEC_PER_SEC 1000000000ull

struct mw_limit {
	__u32 mode;
	__u32 unit;
	__u64 rate;
	__u64 burst;
};

struct mw_bucket {
	struct bpf_spin_lock lock;
	__u64 tokens;
	__u64 last_ns;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32);
	__type(value, struct mw_bucket);
} mw_buckets SEC(".maps");

static __always_inline bool read_limit(const struct mw_ctx *ctx, struct mw_limit *l)
{
	const struct mw_plugin_config *cfg = mw_config(ctx);

	if (!cfg || cfg->len < sizeof(*l))
		return false;
	__builtin_memcpy(l, cfg->data, sizeof(*l));
	return l->mode == MODE_DROP || l->mode == MODE_BYPASS;
}

static __always_inline int on_message(struct sk_msg_md *msg, const struct mw_ctx *ctx)
{
	__u64 now = bpf_ktime_get_ns(), cost, elapsed, refill;
	__u32 id = ctx->id;
	struct mw_bucket *b;
	struct mw_limit l;
	bool ok;

	if (!read_limit(ctx, &l))
		return MW_CONTINUE;
	cost = l.unit == UNIT_BYTES ? ctx->size : 1;
	b = bpf_map_lookup_elem(&mw_buckets, &id);
	if (!b) {
		struct mw_bucket fresh = { .tokens = l.burst, .last_ns = now };

		bpf_map_update_elem(&mw_buckets, &id, &fresh, BPF_NOEXIST);
		b = bpf_map_lookup_elem(&mw_buckets, &id);
		if (!b)
			return MW_CONTINUE;
	}
	bpf_spin_lock(&b->lock);
	elapsed = now > b->last_ns ? now - b->last_ns : 0;
	if (elapsed > NSEC_PER_SEC)
		elapsed = NSEC_PER_SEC;
	refill = l.rate && l.rate <= NSEC_PER_SEC ? elapsed * l.rate / NSEC_PER_SEC : 0;
	if (refill) {
		/* Advance only by the time the whole tokens took, keeping the rest. */
		b->last_ns = now - elapsed + refill * NSEC_PER_SEC / l.rate;
		b->tokens += refill;
	} else if (!l.rate) {
		b->last_ns = now;
	}
	if (b->tokens > l.burst)
		b->tokens = l.burst;
	ok = b->tokens >= cost;
	if (ok)
		b->tokens -= cost;
	bpf_spin_unlock(&b->lock);
	if (ok)
		return MW_CONTINUE;
	return l.mode == MODE_DROP ? MW_DROP : MW_BYPASS;
}

MW_PLUGIN(on_message)
