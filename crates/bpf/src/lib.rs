//! meshwarp's BPF programs and the structs they share with user space.
//!
//! `build.rs` compiles each program family (`src/bpf/*.bpf.c`) into a libbpf-rs
//! skeleton; [`shared`] holds the `#[repr(C)]` mirrors of
//! `include/meshwarp/shared.h`.

pub mod shared;

/// The build id of this crate's program objects (16 hex digits of their
/// SHA-256): what `mw_build` records when they are loaded.
pub const BUILD_ID: &str = env!("MESHWARP_BPF_BUILD");

/// Skeleton of the socket-redirection family (`sockredir.bpf.c`): the sockops and
/// sk_msg programs and their maps.
pub mod sockredir {
    #![allow(missing_debug_implementations, clippy::all, clippy::unwrap_used)]
    include!(concat!(env!("OUT_DIR"), "/sockredir.skel.rs"));
}

/// Skeleton of the tc-redirection family (`tcredir.bpf.c`): the ingress and
/// egress tc programs and the interface-route maps.
pub mod tcredir {
    #![allow(missing_debug_implementations, clippy::all, clippy::unwrap_used)]
    include!(concat!(env!("OUT_DIR"), "/tcredir.skel.rs"));
}

/// Plugin objects built from C by `build.rs`: the examples users start from
/// (`examples/plugins/`) and, with the feature `test-plugins`, the ones tests
/// and benches load.
pub mod plugins {
    macro_rules! object {
        ($(#[$doc:meta])* $name:ident, $file:literal) => {
            $(#[$doc])*
            pub const $name: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/", $file, ".bpf.o"));
        };
    }
    object!(
        /// on_connection: declines acceleration outside the configured server ports.
        PORT_ALLOW, "port_allow");
    object!(
        /// on_message: per-rule message/byte counter and sampler (map `mw_samples`).
        BYTE_SAMPLER, "byte_sampler");
    object!(
        /// on_message: per-rule token bucket that drops or bypasses beyond the rate.
        RATE_LIMIT, "rate_limit");
    /// Plugins for tests and benches (feature `test-plugins`).
    #[cfg(feature = "test-plugins")]
    mod test_objects {
        object!(
            /// on_message: always continues (the cost of a chain position).
            NOOP_MSG, "noop_msg");
        object!(
            /// on_message: returns the verdict in its config.
            VERDICT_MSG, "verdict_msg");
        object!(
            /// on_packet: returns a verdict for packets from or to a configured port.
            PKT_PORT, "pkt_port");
        object!(
            /// Built against an ABI major the host does not offer.
            ABI_MAJOR, "abi_major");
        object!(
            /// Refused by the verifier.
            REJECTED, "rejected");
        object!(
            /// Hostile: writes the read-only chain (refused by the verifier).
            HOSTILE_CHAIN, "hostile_chain");
        object!(
            /// Hostile: declares the host's socket state to point its socket at
            /// another connection's link (refused at load).
            HOSTILE_STEER, "hostile_steer");
        object!(
            /// Hostile: declares the host's per-plugin counters to inflate
            /// another plugin's (refused at load).
            HOSTILE_STATS, "hostile_stats");
        object!(
            /// Hostile: on_packet that flips the direction in the chain state
            /// (skb->cb) and jumps to the finisher.
            HOSTILE_DIR, "hostile_dir");
        object!(
            /// Asks for one of its maps to be pinned by name (refused).
            PINNED_MAP, "pinned_map");
    }
    #[cfg(feature = "test-plugins")]
    pub use test_objects::*;
}

/// Names of programs and maps as the kernel sees them (all under 16 bytes).
pub mod names {
    pub const PROG_SOCKOPS: &str = "mw_sockops";
    pub const PROG_SK_MSG: &str = "mw_sk_msg";
    pub const MAP_SOCKMAP: &str = "mw_sockmap";
    pub const MAP_TGTMAP: &str = "mw_tgtmap";
    pub const MAP_SLOTS: &str = "mw_slots";
    pub const MAP_PAIRS: &str = "mw_pairs";
    pub const MAP_CAPTURE: &str = "mw_capture";
    pub const MAP_LINKS: &str = "mw_links";
    pub const MAP_OBSERVE: &str = "mw_observe";
    pub const MAP_COOKIES: &str = "mw_cookies";
    pub const MAP_EXES: &str = "mw_exes";
    pub const MAP_EXE_CLASS: &str = "mw_exe_class";
    pub const MAP_SERVICES: &str = "mw_services";
    pub const MAP_READERS: &str = "mw_readers";
    pub const MAP_JOINS: &str = "mw_joins";
    /// The server ports some rule names, one bit each (`struct mw_ports`).
    pub const MAP_PORTS: &str = "mw_ports";
    pub const MAP_SRV_HINT: &str = "mw_srv_hint";
    pub const MAP_CONFIG: &str = "mw_config";
    pub const MAP_DOOMED: &str = "mw_doomed";
    pub const MAP_PARK_REQ: &str = "mw_park_req";
    pub const MAP_EVENTS: &str = "mw_events";
    pub const MAP_SCRATCH: &str = "mw_scratch";
    /// Per rule id: whether its connections are short (`struct mw_short`).
    pub const MAP_SHORT: &str = "mw_short";
    /// The reader guard's programs (sockredir family).
    pub const PROG_RECV_LEN: &str = "mw_recv_len";
    pub const PROG_SYS_ENTER: &str = "mw_sys_enter";
    pub const PROG_SETSOCKOPT: &str = "mw_setsockopt";
    /// connect(): hints from a listener of the caller's namespace (`mw_srv_hint`).
    pub const PROG_CONNECT4: &str = "mw_connect4";
    pub const PROG_CONNECT6: &str = "mw_connect6";
    pub const PROG_DESTROY: &str = "mw_destroy";
    pub const PROG_PARK: &str = "mw_park";
    pub const PROG_UNLINK: &str = "mw_unlink";
    /// The latency monitor's TCP-path send side (attached while it runs).
    pub const PROG_LAT_SEND: &str = "mw_lat_send";
    /// The connection list: an iterator over `mw_sk_state` (every network
    /// namespace at once), where the kernel loads map-element iterators.
    pub const PROG_CONNS: &str = "mw_conns";
    /// The connection list of one network namespace (an iter/tcp program),
    /// read in each namespace where `mw_conns` is refused.
    pub const PROG_CONNS_TCP: &str = "mw_conns_tcp";
    pub const MAP_LAT_RULE: &str = "mw_lat_rule";
    pub const MAP_LAT_HIST: &str = "mw_lat_hist";
    pub const MAP_LAT_ROWS: &str = "mw_lat_rows";
    pub const MAP_LAT_ZERO: &str = "mw_lat_zero";
    pub const MAP_LAT_PEND: &str = "mw_lat_pend";
    pub const MAP_LAT_SLOT: &str = "mw_lat_slot";
    pub const MAP_LAT_THR: &str = "mw_lat_thr";
    pub const MAP_LAT_THRH: &str = "mw_lat_thrh";
    pub const MAP_SK_CONN: &str = "mw_sk_conn";
    pub const MAP_SK_STATE: &str = "mw_sk_state";
    /// A socket's place in its plugin chain (`struct mw_sk_chain`).
    pub const MAP_SK_CHAIN: &str = "mw_sk_chain";
    pub const MAP_STATS: &str = "mw_stats";
    pub const MAP_GLOBAL: &str = "mw_global";
    pub const MAP_OWNERS: &str = "mw_owners";
    pub const MAP_BUILD: &str = "mw_build";
    pub const PROG_TC_INGRESS: &str = "mw_tc_ingress";
    pub const PROG_TC_EGRESS: &str = "mw_tc_egress";
    pub const PROG_CONN_FIN: &str = "mw_conn_fin";
    pub const PROG_MSG_FIN: &str = "mw_msg_fin";
    pub const PROG_PKT_FIN: &str = "mw_pkt_fin";
    /// The program every plugin object defines.
    pub const PROG_PLUGIN: &str = "mw_plugin";
    pub const MAP_CH_CONN: &str = "mw_ch_conn";
    pub const MAP_CH_MSG: &str = "mw_ch_msg";
    pub const MAP_CH_PKT: &str = "mw_ch_pkt";
    pub const MAP_CHAIN: &str = "mw_chain";
    pub const MAP_CHAIN_GEN: &str = "mw_chain_gen";
    pub const MAP_PLUG_CFG: &str = "mw_plug_cfg";
    pub const MAP_PLUG_STATS: &str = "mw_plug_stats";
    /// A plugin's own counters (`mw_own_stats` in plugin.h, one entry).
    pub const MAP_OWN_STATS: &str = "mw_own_stats";
    pub const MAP_PLUG_META: &str = "mw_plug_meta";
    pub const MAP_GRACE: &str = "mw_grace";
    /// Maps of a host family that plugin objects share (reuse), besides the
    /// hook's prog array.
    pub const PLUGIN_SHARED_MAPS: [&str; 4] = [MAP_SK_CHAIN, MAP_CHAIN, MAP_CHAIN_GEN, MAP_PLUG_CFG];
    pub const MAP_RT4: &str = "mw_rt4";
    pub const MAP_RT6: &str = "mw_rt6";
    pub const MAP_RT_STATS: &str = "mw_rt_stats";
    pub const MAP_ATT_STATS: &str = "mw_att_stats";
    pub const MAP_RT_OWNER: &str = "mw_rt_owner";
    /// Per CPU: the interface and direction of the packet a chain runs for.
    pub const MAP_PKT_DIR: &str = "mw_pkt_dir";
    /// The sockredir family's programs that are pinned.
    pub const SOCKREDIR_PROGS: [&str; 10] = [
        PROG_SOCKOPS,
        PROG_SK_MSG,
        PROG_RECV_LEN,
        PROG_SYS_ENTER,
        PROG_SETSOCKOPT,
        PROG_CONNECT4,
        PROG_CONNECT6,
        PROG_DESTROY,
        PROG_PARK,
        PROG_UNLINK,
    ];
    /// Pinned only where the kernel has what they attach to
    /// (`tcp_sendmsg_locked`: 6.13 and newer) or loads them (map-element
    /// iterators); `mw_conns_tcp` loads everywhere, but instances pinned by
    /// builds before it lack it until an upgrade adds it.
    pub const SOCKREDIR_OPTIONAL_PROGS: [&str; 3] = [PROG_LAT_SEND, PROG_CONNS, PROG_CONNS_TCP];
    /// Maps of the sockredir family newer than the family itself: pinned by
    /// every load of this build, missing from instances an older build
    /// pinned until an upgrade creates them. Each holds only what the
    /// programs learn or ask for, so starting empty loses nothing (an older
    /// build's programs ask nothing in `mw_joins`); `mw_ports` empty filters
    /// nothing until user space writes the set (its bit 0).
    pub const SOCKREDIR_ADDED_MAPS: [&str; 3] = [MAP_READERS, MAP_JOINS, MAP_PORTS];
    /// The tcredir family's programs that are pinned.
    pub const TCREDIR_PROGS: [&str; 2] = [PROG_TC_INGRESS, PROG_TC_EGRESS];
    /// The maps of a family's plugin chain (`chain.h`), which every family
    /// that hosts plugins has besides its hook's prog array.
    pub const PLUGIN_HOST_MAPS: [&str; 6] =
        [MAP_CHAIN, MAP_CHAIN_GEN, MAP_PLUG_CFG, MAP_PLUG_STATS, MAP_PLUG_META, MAP_GRACE];
    /// The tcredir family's own maps (besides [`PLUGIN_HOST_MAPS`]).
    pub const TCREDIR_MAPS: [&str; 13] = [
        MAP_RT4,
        MAP_RT6,
        MAP_RT_STATS,
        MAP_ATT_STATS,
        MAP_RT_OWNER,
        MAP_CH_PKT,
        MAP_BUILD,
        MAP_PKT_DIR,
        MAP_CONFIG,
        MAP_LAT_RULE,
        MAP_LAT_ROWS,
        MAP_LAT_HIST,
        MAP_LAT_ZERO,
    ];
    /// The sockredir family's own maps (besides [`PLUGIN_HOST_MAPS`]), in pin order.
    pub const SOCKREDIR_MAPS: [&str; 35] = [
        MAP_SOCKMAP,
        MAP_TGTMAP,
        MAP_SLOTS,
        MAP_PAIRS,
        MAP_CAPTURE,
        MAP_LINKS,
        MAP_OBSERVE,
        MAP_COOKIES,
        MAP_SK_STATE,
        MAP_SK_CHAIN,
        MAP_EXES,
        MAP_EXE_CLASS,
        MAP_SERVICES,
        MAP_SRV_HINT,
        MAP_CONFIG,
        MAP_DOOMED,
        MAP_PARK_REQ,
        MAP_EVENTS,
        MAP_SCRATCH,
        MAP_STATS,
        MAP_GLOBAL,
        MAP_SHORT,
        MAP_OWNERS,
        MAP_BUILD,
        MAP_CH_CONN,
        MAP_CH_MSG,
        MAP_LAT_RULE,
        MAP_LAT_HIST,
        MAP_LAT_ROWS,
        MAP_LAT_ZERO,
        MAP_LAT_PEND,
        MAP_LAT_SLOT,
        MAP_LAT_THR,
        MAP_LAT_THRH,
        MAP_SK_CONN,
    ];
}

#[cfg(test)]
mod tests {
    use super::names;

    #[test]
    fn kernel_names_fit_in_bpf_obj_name_len() {
        let mut all = vec![names::PROG_CONN_FIN, names::PROG_MSG_FIN, names::PROG_PKT_FIN, names::PROG_PLUGIN];
        all.extend(names::SOCKREDIR_PROGS);
        all.extend(names::SOCKREDIR_OPTIONAL_PROGS);
        all.extend(names::TCREDIR_PROGS);
        all.extend(names::SOCKREDIR_MAPS);
        all.extend(names::SOCKREDIR_ADDED_MAPS);
        all.extend(names::TCREDIR_MAPS);
        all.extend(names::PLUGIN_HOST_MAPS);
        for n in all {
            assert!(n.len() < 16, "{n} is too long for BPF_OBJ_NAME_LEN");
        }
    }
}
