/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * One line per BTF-defined map: MW_MAP(name, type, key, value, max_entries,
 * map_flags). A map_flags of 0 is what libbpf assumes when the field is
 * absent, so a map declared here and one written out by hand are the same
 * map to the kernel and to libbpf's reuse check. Maps with other fields
 * (socket storage, ring buffers, prog arrays, maps of maps) stay written out.
 */
#ifndef MESHWARP_MAP_H
#define MESHWARP_MAP_H

#define MW_MAP(_name, _type, _key, _value, _max_entries, _map_flags) \
	struct {                                                     \
		__uint(type, _type);                                 \
		__uint(max_entries, _max_entries);                   \
		__uint(map_flags, _map_flags);                       \
		__type(key, _key);                                   \
		__type(value, _value);                               \
	} _name SEC(".maps")

#endif /* MESHWARP_MAP_H */
