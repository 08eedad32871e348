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
    /// Every map of the sockredir family, in pin order.
    pub const SOCKREDIR_MAPS: [&str; 8] =
        [MAP_SOCKHASH, MAP_PAIRS, MAP_CAPTURE, MAP_ORIGINS, MAP_SK_STATE, MAP_STATS, MAP_GLOBAL, MAP_OWNERS];
}

#[cfg(test)]
mod tests {
    use super::names;

    #[test]
    fn kernel_names_fit_in_bpf_obj_name_len() {
        let mut all = vec![names::PROG_SOCKOPS, names::PROG_SK_MSG];
        all.extend(names::SOCKREDIR_MAPS);
        for n in all {
            assert!(n.len() < 16, "{n} is too long for BPF_OBJ_NAME_LEN");
        }
    }
}
