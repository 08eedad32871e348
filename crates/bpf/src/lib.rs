//! meshwarp's BPF programs and the structs they share with user space.
//!
//! `build.rs` compiles each program family (`src/bpf/*.bpf.c`) into a libbpf-rs
//! skeleton; [`shared`] holds the `#[repr(C)]` mirrors of
//! `include/meshwarp/shared.h`.

pub mod shared;

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

/// Names of programs and maps as the kernel sees them (all under 16 bytes).
pub mod names {
    pub const PROG_SOCKOPS: &str = "mw_sockops";
    pub const PROG_SK_MSG: &str = "mw_sk_msg";
    pub const MAP_SOCKHASH: &str = "mw_sockhash";
    pub const MAP_PAIRS: &str = "mw_pairs";
    pub const MAP_CAPTURE: &str = "mw_capture";
    pub const MAP_ORIGINS: &str = "mw_origins";
    pub const MAP_SK_STATE: &str = "mw_sk_state";
    pub const MAP_STATS: &str = "mw_stats";
    pub const MAP_GLOBAL: &str = "mw_global";
    pub const MAP_OWNERS: &str = "mw_owners";
    pub const PROG_TC_INGRESS: &str = "mw_tc_ingress";
    pub const PROG_TC_EGRESS: &str = "mw_tc_egress";
    pub const MAP_RT4: &str = "mw_rt4";
    pub const MAP_RT6: &str = "mw_rt6";
    pub const MAP_RT_STATS: &str = "mw_rt_stats";
    pub const MAP_ATT_STATS: &str = "mw_att_stats";
    pub const MAP_RT_OWNER: &str = "mw_rt_owner";
    /// Every map of the tcredir family.
    pub const TCREDIR_MAPS: [&str; 5] = [MAP_RT4, MAP_RT6, MAP_RT_STATS, MAP_ATT_STATS, MAP_RT_OWNER];
    /// Every map of the sockredir family, in pin order.
    pub const SOCKREDIR_MAPS: [&str; 8] =
        [MAP_SOCKHASH, MAP_PAIRS, MAP_CAPTURE, MAP_ORIGINS, MAP_SK_STATE, MAP_STATS, MAP_GLOBAL, MAP_OWNERS];
}

#[cfg(test)]
mod tests {
    use super::names;

    #[test]
    fn kernel_names_fit_in_bpf_obj_name_len() {
        let mut all = vec![names::PROG_SOCKOPS, names::PROG_SK_MSG, names::PROG_TC_INGRESS, names::PROG_TC_EGRESS];
        all.extend(names::SOCKREDIR_MAPS);
        all.extend(names::TCREDIR_MAPS);
        for n in all {
            assert!(n.len() < 16, "{n} is too long for BPF_OBJ_NAME_LEN");
        }
    }
}
