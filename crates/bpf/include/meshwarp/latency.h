/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The latency monitor's histogram arithmetic, shared by the families that
 * record (struct mw_lat_hist, shared.h): bucket i counts [2^i, 2^(i+1)) ns.
 * Each family keeps its own maps and decides what a sample is.
 */
#ifndef MESHWARP_LATENCY_H
#define MESHWARP_LATENCY_H

static __always_inline __u32 mw_log2_32(__u32 v)
{
	__u32 r, shift;

	r = (v > 0xffff) << 4;
	v >>= r;
	shift = (v > 0xff) << 3;
	v >>= shift;
	r |= shift;
	shift = (v > 0xf) << 2;
	v >>= shift;
	r |= shift;
	shift = (v > 0x3) << 1;
	v >>= shift;
	r |= shift;
	r |= (v >> 1);
	return r;
}

/* Adds one sample of `ns` (plain increments: the histograms are per CPU). */
static __always_inline void mw_hist_add(struct mw_lat_hist *h, __u64 ns)
{
	__u32 hi = ns >> 32, b;

	b = hi ? 32 + mw_log2_32(hi) : mw_log2_32((__u32)ns);
	if (b >= MW_LAT_BUCKETS)
		b = MW_LAT_BUCKETS - 1;
	h->count++;
	h->sum_ns += ns;
	h->bucket[b & (MW_LAT_BUCKETS - 1)]++;
}

/* The histogram of `k` in the per-CPU hash `hist`, made from `zero_map`'s
 * never-written entry 0 the first time (too large for the stack). Each
 * family passes its own maps. */
static __always_inline struct mw_lat_hist *mw_hist_of(void *hist, void *zero_map, const struct mw_lat_key *k)
{
	struct mw_lat_hist *h = bpf_map_lookup_elem(hist, k), *z;
	__u32 zero = 0;

	if (h)
		return h;
	z = bpf_map_lookup_elem(zero_map, &zero);
	if (!z)
		return NULL;
	bpf_map_update_elem(hist, k, z, BPF_NOEXIST);
	return bpf_map_lookup_elem(hist, k);
}

#endif /* MESHWARP_LATENCY_H */
