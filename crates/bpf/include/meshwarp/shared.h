/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Structs shared between meshwarp's BPF programs and user space.
 *
 * Every struct here has a #[repr(C)] mirror in crates/bpf/src/shared.rs with a
 * layout test; change both together and bump MW_SCHEMA_VERSION when a pinned map's
 * key or value changes, so an agent never adopts maps of another layout.
 *
 * Addresses are 16 bytes for both families, in network byte order exactly as the
 * kernel hands them to sockops (IPv4 in ip[0], ip[1..3] zero). Ports are host order.
 */
#ifndef MESHWARP_SHARED_H
#define MESHWARP_SHARED_H

#define MW_SCHEMA_VERSION 2

#define MW_AF_INET 2
#define MW_AF_INET6 10

/* How a socket's SOCKHASH key was built (mw_sock_key.kind). */
enum mw_key_kind {
	/* Mirror pairing: own (local, remote); the peer is (remote, local). */
	MW_KEY_TUPLE = 1,
	/* Capture pairing: the socket that opened the connection, keyed by its
	 * own endpoint (client_ip:port). */
	MW_KEY_ORIGIN = 2,
	/* Capture pairing: the socket the capture listener accepted, keyed by the
	 * remote (client) endpoint, which equals the origin's local endpoint. */
	MW_KEY_CAPTURED = 3,
};

/* SOCKHASH key. For MW_KEY_TUPLE netns is the netns cookie when both ends are
 * loopback (such tuples repeat across namespaces), else 0. For the capture
 * kinds only local_* is used; netns is set when the client address is loopback. */
struct mw_sock_key {
	__u32 local_ip[4];
	__u32 remote_ip[4];
	__u32 local_port;
	__u32 remote_port;
	__u64 netns;
	__u32 family;
	__u32 kind;
};

/* Mirror-pairing rule: connections from client_ip (any port) to
 * server_ip:server_port are covered, both ends. */
struct mw_pair_key {
	__u32 client_ip[4];
	__u32 server_ip[4];
	__u32 server_port;
	__u32 family;
};

/* Capture-pairing rule: connections from client_ip (all-zero: any client of
 * this family) to the original destination dst_ip:dst_port, which iptables
 * captures to a proxy listening on the rule's listener. */
struct mw_capture_key {
	__u32 client_ip[4];
	__u32 dst_ip[4];
	__u32 dst_port;
	__u32 family;
};

/* Value of both rule maps. */
struct mw_rule {
	/* Index into mw_stats; allocated by user space, < max rules. */
	__u32 id;
	/* Capture rules only: where the captured connection is accepted. */
	__u32 listener_port;
	__u32 listener_ip[4];
};

/* An origin socket of a capture rule, waiting for (or paired with) the socket
 * its listener accepted. Keyed by the origin's endpoint. */
struct mw_endpoint_key {
	__u32 ip[4];
	__u32 port;
	__u32 family;
	__u64 netns;
};

struct mw_origin {
	__u32 rule_id;
	__u32 listener_port;
	__u32 listener_ip[4];
	/* Socket cookie of the origin, so a closing socket only removes its own
	 * entry after the 4-tuple was reused. */
	__u64 cookie;
};

/* Per-socket state set by sockops (socket local storage), read by sk_msg. */
struct mw_sock_state {
	struct mw_sock_key peer;
	__u32 rule_id;
	__u32 flags;
};

/* mw_sock_state.flags */
#define MW_SOCK_NEEDS_SYNC 1u /* redirect only if the TCP path carried no payload */
/* Plugin chain position of the message (or connection) being handled: bits 8-15
 * the next chain position, bit 16 the chain generation it started on. Only the
 * programs of one socket's hook touch them, under the socket's lock. */
#define MW_SOCK_CHAIN_POS_SHIFT 8
#define MW_SOCK_CHAIN_GEN_SHIFT 16

/* Per-rule counters, one slot per rule id in a per-CPU array. */
struct mw_rule_stats {
	__u64 sockets;          /* sockets inserted into the SOCKHASH */
	__u64 msgs;             /* messages redirected */
	__u64 bytes;            /* bytes redirected */
	__u64 fb_no_peer;       /* messages sent on the TCP path: peer absent */
	__u64 fb_tcp_path;      /* messages sent on the TCP path: this direction already used it */
	__u64 fb_map_full;      /* covered sockets not inserted: SOCKHASH full */
	__u64 fb_insert_err;    /* covered sockets not inserted: other error (ULP, ...) */
};

/* Owner of a rule slot: a NUL-padded controller name. */
#define MW_OWNER_LEN 64
struct mw_owner {
	char name[MW_OWNER_LEN];
};

/* Node-wide counters (one slot). */
struct mw_global_stats {
	__u64 established;      /* ESTABLISHED callbacks seen */
	__u64 not_covered;      /* connections no rule covers: left alone */
	__u64 no_state;         /* sk_msg without socket state: passed */
};

/* ---- tc redirection (tcredir.bpf.c) ---- */

/* mw_route.action */
enum mw_route_action {
	MW_ACT_REDIRECT = 1,       /* bpf_redirect to target's egress */
	MW_ACT_REDIRECT_PEER = 2,  /* bpf_redirect_peer into the target veth's peer */
	MW_ACT_REDIRECT_NEIGH = 3, /* bpf_redirect_neigh: kernel fills L2 */
};

/* mw_route.flags */
#define MW_ROUTE_REWRITE_MAC 1u
#define MW_ROUTE_HAS_NEXTHOP 2u
#define MW_ROUTE_HAS_SRC 4u

/* mw_attach_key.dir */
#define MW_DIR_INGRESS 1
#define MW_DIR_EGRESS 2

/* LPM key: attach point first (always fully matched), then the destination.
 * prefixlen = 64 + destination prefix length. */
struct mw_route_key4 {
	__u32 prefixlen;
	__u32 ifindex;
	__u32 dir;
	__u8 dst[4];
};

struct mw_route_key6 {
	__u32 prefixlen;
	__u32 ifindex;
	__u32 dir;
	__u8 dst[16];
};

struct mw_route {
	__u32 id;            /* counter slot */
	__u32 action;
	__u32 target_ifindex;
	__u32 flags;
	__u8 smac[6];
	__u8 dmac[6];
	__u32 src_prefixlen; /* optional source match (MW_ROUTE_HAS_SRC) */
	__u8 src[16];
	__u32 nh_family;     /* MW_AF_INET / MW_AF_INET6 with MW_ROUTE_HAS_NEXTHOP */
	__u8 nh_addr[16];
};

struct mw_route_stats {
	__u64 packets;
	__u64 bytes;
	__u64 redirect_err;  /* helper refused: the packet took the normal path */
};

struct mw_attach_key {
	__u32 ifindex;
	__u32 dir;
};

struct mw_attach_stats {
	__u64 packets;
	__u64 misses;        /* no route matched: TC_ACT_OK */
};

/* ---- plugins (plugin.h for authors, chain.h for the maps) ---- */

/* Plugin ABI offered by this host: a plugin of the same major and an equal or
 * older minor is accepted. */
#define MW_ABI_MAJOR 1
#define MW_ABI_MINOR 0

/* Hooks a plugin attaches to (mw_plugin_abi.hook, chain rows); macros so that
 * plugin.h can select on them with #if. */
#define MW_HOOK_CONNECTION 1 /* sockops: a covered connection is ESTABLISHED */
#define MW_HOOK_MESSAGE 2    /* sk_msg: a message on an accelerated socket */
#define MW_HOOK_PACKET 3     /* tc: a packet on an attached interface */
#define MW_HOOKS 3

/* Verdicts a plugin returns. 1 means, by hook: decline acceleration of the
 * connection / send this message on the normal path / pass the packet
 * unmodified past meshwarp's routes. */
enum mw_verdict {
	MW_CONTINUE = 0,
	MW_DECLINE = 1,
	MW_BYPASS = 1,
	MW_PASS = 1,
	MW_DROP = 2, /* on_message, on_packet only */
};

/* Plugins per hook chain, plugins per node, config bytes per plugin. */
#define MW_CHAIN_MAX 8
#define MW_MAX_PLUGINS 64
#define MW_PLUGIN_CFG_MAX 512
/* Prog-array index of the hook's finisher (the host's own decision), after
 * the two generations of MW_CHAIN_MAX positions. */
#define MW_CHAIN_FIN (2 * MW_CHAIN_MAX)
/* mw_ctx.id when no pair or route matched. */
#define MW_NO_ID 0xffffffffu

/* ELF section ".mw_abi" of a plugin object. */
struct mw_plugin_abi {
	__u16 major;
	__u16 minor;
	__u32 hook;
};

/* One chain position (mw_chain): which plugin runs there, with which config. */
struct mw_chain_pos {
	__u32 plugin_id;  /* 0: empty */
	__u32 cfg_slot;   /* index into mw_plug_cfg */
	__u32 flags;      /* MW_PLUGIN_FAIL_CLOSED */
	__u32 pad;
};

/* mw_chain_pos.flags, mw_plugin_meta.flags */
#define MW_PLUGIN_FAIL_CLOSED 1u

/* A plugin's configuration bytes (mw_plug_cfg, read-only to programs). */
struct mw_plugin_config {
	__u32 len;
	__u8 data[MW_PLUGIN_CFG_MAX];
};

/* Per-plugin counters (one slot per plugin id, per CPU). */
struct mw_plugin_stats {
	__u64 runs;
	__u64 cont;      /* MW_CONTINUE */
	__u64 verdict1;  /* MW_DECLINE / MW_BYPASS / MW_PASS */
	__u64 drop;      /* MW_DROP */
	__u64 invalid;   /* a verdict the hook does not know */
	__u64 missing;   /* its chain slot was empty when reached */
};

/* What user space keeps about a loaded plugin (mw_plug_meta, pinned), so a
 * restarted agent knows its plugins. Programs never read it. */
#define MW_PLUGIN_NAME_LEN 64
#define MW_PLUGIN_VERSION_LEN 32
struct mw_plugin_meta {
	char name[MW_PLUGIN_NAME_LEN];
	char version[MW_PLUGIN_VERSION_LEN];
	__u32 hook;
	__u32 phase;
	__s32 priority;
	__u32 flags;
	__u32 cfg_slot;
	__u32 abi;        /* major << 16 | minor */
	__u8 sha256[32];
};

#endif /* MESHWARP_SHARED_H */
