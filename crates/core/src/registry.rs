//! The registry of rules: which endpoint pairs and capture rules are installed,
//! which counter slot each owns, and how they are written to the data path.
//!
//! Its state is derived from the maps themselves ([`Registry::reconcile`]), so
//! an agent that adopts a pinned data path knows exactly what is installed.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};

use meshwarp_bpf::shared::{
    ip_from_raw, raw_addr, CaptureKey, PairKey, Rule, SockKey, KEY_CAPTURED, KEY_ORIGIN, KEY_TUPLE,
};

use crate::endpoint::{CaptureRule, Endpoint, EndpointPair, ValidationError};
use crate::maps::{MapError, RuleMaps};
use crate::stats::{GlobalCounters, RuleCounters};

/// Why a registry operation failed; on error nothing was changed.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("{0} is already registered")]
    AlreadyExists(String),
    #[error("{0} is not registered")]
    NotFound(String),
    /// No room for another rule: existing entries are intact.
    #[error("rule capacity exhausted ({capacity} rules); nothing was changed")]
    Full { capacity: u32 },
    #[error(transparent)]
    Invalid(#[from] ValidationError),
    #[error("data path holds an entry meshwarp cannot read back: {0}")]
    Inconsistent(String),
    #[error(transparent)]
    Map(MapError),
}

impl From<MapError> for RegistryError {
    fn from(e: MapError) -> Self {
        match e {
            MapError::Full { capacity, .. } => Self::Full { capacity },
            other => Self::Map(other),
        }
    }
}

/// The map key of a mirror pair.
pub fn pair_key(pair: &EndpointPair) -> PairKey {
    let (client_ip, family) = raw_addr(pair.client());
    let (server_ip, _) = raw_addr(pair.server().addr);
    PairKey {
        client_ip,
        server_ip,
        server_port: u32::from(pair.server().port),
        family,
    }
}

/// The map key of a capture rule (all-zero client: any client).
pub fn capture_key(rule: &CaptureRule) -> CaptureKey {
    let (dst_ip, family) = raw_addr(rule.original_dst().addr);
    let client_ip = rule.client().map(|c| raw_addr(c).0).unwrap_or_default();
    CaptureKey {
        client_ip,
        dst_ip,
        dst_port: u32::from(rule.original_dst().port),
        family,
    }
}

fn capture_value(rule: &CaptureRule, id: u32) -> Rule {
    let (listener_ip, _) = raw_addr(rule.listener().addr);
    Rule {
        id,
        listener_port: u32::from(rule.listener().port),
        listener_ip,
    }
}

fn port(raw: u32, what: &str) -> Result<u16, RegistryError> {
    u16::try_from(raw).map_err(|_| RegistryError::Inconsistent(format!("{what} port {raw}")))
}

fn ip(raw: [u32; 4], family: u32, what: &str) -> Result<IpAddr, RegistryError> {
    ip_from_raw(raw, family)
        .ok_or_else(|| RegistryError::Inconsistent(format!("{what} family {family}")))
}

/// Reads a mirror pair back from its map key.
pub fn pair_from_key(k: &PairKey) -> Result<EndpointPair, RegistryError> {
    let server = Endpoint::new(
        ip(k.server_ip, k.family, "pair server")?,
        port(k.server_port, "pair server")?,
    );
    Ok(EndpointPair::new(
        ip(k.client_ip, k.family, "pair client")?,
        server,
    )?)
}

/// Reads a capture rule back from its map entry.
pub fn capture_from_entry(k: &CaptureKey, v: &Rule) -> Result<CaptureRule, RegistryError> {
    let client = if k.client_ip == [0; 4] {
        None
    } else {
        Some(ip(k.client_ip, k.family, "capture client")?)
    };
    let dst = Endpoint::new(
        ip(k.dst_ip, k.family, "capture dst")?,
        port(k.dst_port, "capture dst")?,
    );
    let listener = Endpoint::new(
        ip(v.listener_ip, k.family, "capture listener")?,
        port(v.listener_port, "listener")?,
    );
    Ok(CaptureRule::new(client, dst, listener)?)
}

/// The SOCKHASH key sockops gives the socket with local address `local` and
/// remote address `remote` under mirror pairing; `netns` is the socket's
/// netns cookie and is kept only when both ends are loopback.
pub fn tuple_sock_key(local: SocketAddr, remote: SocketAddr, netns: u64) -> SockKey {
    let (local_ip, family) = raw_addr(local.ip());
    let (remote_ip, _) = raw_addr(remote.ip());
    let both_loopback = local.ip().is_loopback() && remote.ip().is_loopback();
    SockKey {
        local_ip,
        remote_ip,
        local_port: u32::from(local.port()),
        remote_port: u32::from(remote.port()),
        netns: if both_loopback { netns } else { 0 },
        family,
        kind: KEY_TUPLE,
    }
}

/// The SOCKHASH key of either end of a captured connection, by its client
/// endpoint: `origin` for the socket that connected, else the accepted one.
pub fn capture_sock_key(client: SocketAddr, netns: u64, origin: bool) -> SockKey {
    let (local_ip, family) = raw_addr(client.ip());
    SockKey {
        local_ip,
        local_port: u32::from(client.port()),
        netns: if client.ip().is_loopback() { netns } else { 0 },
        family,
        kind: if origin { KEY_ORIGIN } else { KEY_CAPTURED },
        ..SockKey::default()
    }
}

/// The key the sk_msg program redirects to from a socket with key `own`.
pub fn peer_sock_key(own: &SockKey) -> SockKey {
    match own.kind {
        KEY_TUPLE => SockKey {
            local_ip: own.remote_ip,
            remote_ip: own.local_ip,
            local_port: own.remote_port,
            remote_port: own.local_port,
            ..*own
        },
        KEY_ORIGIN => SockKey {
            kind: KEY_CAPTURED,
            ..*own
        },
        _ => SockKey {
            kind: KEY_ORIGIN,
            ..*own
        },
    }
}

/// Rules installed in one data path and the counter slot of each.
#[derive(Debug)]
pub struct Registry<M> {
    maps: M,
    pairs: BTreeMap<EndpointPair, u32>,
    captures: BTreeMap<(Option<IpAddr>, Endpoint), (CaptureRule, u32)>,
    used_ids: BTreeSet<u32>,
}

impl<M: RuleMaps> Registry<M> {
    /// Builds the registry from what the maps hold (adoption after a restart).
    pub fn reconcile(maps: M) -> Result<Self, RegistryError> {
        let mut reg = Self {
            maps,
            pairs: BTreeMap::new(),
            captures: BTreeMap::new(),
            used_ids: BTreeSet::new(),
        };
        let capacity = reg.maps.rule_capacity();
        let mut claim = |id: u32, what: &dyn std::fmt::Display| {
            if id >= capacity || !reg.used_ids.insert(id) {
                return Err(RegistryError::Inconsistent(format!(
                    "{what} holds counter slot {id} twice or out of range"
                )));
            }
            Ok(())
        };
        let mut pairs = Vec::new();
        for (k, v) in reg.maps.pairs()? {
            let pair = pair_from_key(&k)?;
            claim(v.id, &pair)?;
            pairs.push((pair, v.id));
        }
        let mut captures = Vec::new();
        for (k, v) in reg.maps.captures()? {
            let rule = capture_from_entry(&k, &v)?;
            claim(v.id, &rule)?;
            captures.push((rule, v.id));
        }
        reg.pairs.extend(pairs);
        reg.captures
            .extend(captures.into_iter().map(|(r, id)| (r.key(), (r, id))));
        Ok(reg)
    }

    pub fn maps(&self) -> &M {
        &self.maps
    }

    /// Lowest free counter slot, zeroed.
    fn allocate_id(&mut self) -> Result<u32, RegistryError> {
        let capacity = self.maps.rule_capacity();
        let id = (0..capacity)
            .find(|i| !self.used_ids.contains(i))
            .ok_or(RegistryError::Full { capacity })?;
        self.maps.reset_rule_stats(id)?;
        self.used_ids.insert(id);
        Ok(id)
    }

    /// Registers a new pair; [`RegistryError::AlreadyExists`] if present.
    pub fn insert_pair(&mut self, pair: &EndpointPair) -> Result<(), RegistryError> {
        if self.pairs.contains_key(pair) {
            return Err(RegistryError::AlreadyExists(format!("pair {pair}")));
        }
        let id = self.allocate_id()?;
        if let Err(e) = self.maps.put_pair(
            &pair_key(pair),
            &Rule {
                id,
                ..Rule::default()
            },
        ) {
            self.used_ids.remove(&id);
            return Err(e.into());
        }
        self.pairs.insert(*pair, id);
        Ok(())
    }

    /// Registers the pair unless present; true if it was added.
    pub fn upsert_pair(&mut self, pair: &EndpointPair) -> Result<bool, RegistryError> {
        match self.insert_pair(pair) {
            Ok(()) => Ok(true),
            Err(RegistryError::AlreadyExists(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Removes a pair: new connections take the normal path. Connections it
    /// already accelerates stay accelerated until they close, because removing
    /// a socket from the SOCKHASH would drop bytes queued for its reader.
    pub fn remove_pair(&mut self, pair: &EndpointPair) -> Result<(), RegistryError> {
        let id = *self
            .pairs
            .get(pair)
            .ok_or_else(|| RegistryError::NotFound(format!("pair {pair}")))?;
        self.maps.delete_pair(&pair_key(pair))?;
        self.pairs.remove(pair);
        self.used_ids.remove(&id);
        Ok(())
    }

    pub fn pairs(&self) -> Vec<EndpointPair> {
        self.pairs.keys().copied().collect()
    }

    pub fn pair_stats(&self, pair: &EndpointPair) -> Result<RuleCounters, RegistryError> {
        let id = *self
            .pairs
            .get(pair)
            .ok_or_else(|| RegistryError::NotFound(format!("pair {pair}")))?;
        Ok(self.maps.rule_stats(id)?.into())
    }

    /// Registers a new capture rule; [`RegistryError::AlreadyExists`] if one
    /// covers the same client and original destination.
    pub fn insert_capture(&mut self, rule: &CaptureRule) -> Result<(), RegistryError> {
        if let Some((existing, _)) = self.captures.get(&rule.key()) {
            return Err(RegistryError::AlreadyExists(format!(
                "capture rule {existing}"
            )));
        }
        let id = self.allocate_id()?;
        if let Err(e) = self
            .maps
            .put_capture(&capture_key(rule), &capture_value(rule, id))
        {
            self.used_ids.remove(&id);
            return Err(e.into());
        }
        self.captures.insert(rule.key(), (*rule, id));
        Ok(())
    }

    /// Creates the rule, or replaces the listener of the rule with the same
    /// key (keeping its counters); true if it was added.
    pub fn upsert_capture(&mut self, rule: &CaptureRule) -> Result<bool, RegistryError> {
        let Some((_, id)) = self.captures.get(&rule.key()).copied() else {
            self.insert_capture(rule)?;
            return Ok(true);
        };
        self.maps
            .put_capture(&capture_key(rule), &capture_value(rule, id))?;
        self.captures.insert(rule.key(), (*rule, id));
        Ok(false)
    }

    /// Removes the capture rule with the same key as `rule`.
    pub fn remove_capture(&mut self, rule: &CaptureRule) -> Result<(), RegistryError> {
        let (_, id) = *self
            .captures
            .get(&rule.key())
            .ok_or_else(|| RegistryError::NotFound(format!("capture rule {rule}")))?;
        self.maps.delete_capture(&capture_key(rule))?;
        self.captures.remove(&rule.key());
        self.used_ids.remove(&id);
        Ok(())
    }

    pub fn captures(&self) -> Vec<CaptureRule> {
        self.captures.values().map(|(r, _)| *r).collect()
    }

    pub fn capture_stats(&self, rule: &CaptureRule) -> Result<RuleCounters, RegistryError> {
        let (_, id) = self
            .captures
            .get(&rule.key())
            .ok_or_else(|| RegistryError::NotFound(format!("capture rule {rule}")))?;
        Ok(self.maps.rule_stats(*id)?.into())
    }

    pub fn global_stats(&self) -> Result<GlobalCounters, RegistryError> {
        Ok(self.maps.global_stats()?.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::maps::MemoryMaps;
    use meshwarp_bpf::shared::RuleStats;
    use proptest::prelude::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn pair(c: &str, s: &str, p: u16) -> EndpointPair {
        EndpointPair::new(ip(c), Endpoint::new(ip(s), p)).unwrap()
    }

    fn capture(c: Option<&str>, d: &str, l: &str, lp: u16) -> CaptureRule {
        CaptureRule::new(
            c.map(ip),
            Endpoint::new(ip(d), 80),
            Endpoint::new(ip(l), lp),
        )
        .unwrap()
    }

    #[test]
    fn insert_list_remove_pairs() {
        let mut reg = Registry::reconcile(MemoryMaps::with_capacity(8)).unwrap();
        let a = pair("198.18.0.2", "198.18.0.3", 80);
        let b = pair("2001:db8::2", "2001:db8::3", 80);
        reg.insert_pair(&a).unwrap();
        reg.insert_pair(&b).unwrap();
        assert!(matches!(
            reg.insert_pair(&a),
            Err(RegistryError::AlreadyExists(_))
        ));
        assert!(!reg.upsert_pair(&a).unwrap());
        assert_eq!(reg.pairs().len(), 2);
        reg.remove_pair(&a).unwrap();
        assert!(matches!(
            reg.remove_pair(&a),
            Err(RegistryError::NotFound(_))
        ));
        assert_eq!(reg.pairs(), vec![b]);
        assert_eq!(reg.maps().pairs.len(), 1);
    }

    #[test]
    fn full_is_typed_and_leaves_entries_intact() {
        let mut reg = Registry::reconcile(MemoryMaps::with_capacity(2)).unwrap();
        let a = pair("198.18.0.2", "198.18.0.3", 80);
        let b = pair("198.18.0.2", "198.18.0.3", 81);
        let c = pair("198.18.0.2", "198.18.0.3", 82);
        reg.insert_pair(&a).unwrap();
        reg.insert_pair(&b).unwrap();
        assert!(matches!(
            reg.insert_pair(&c),
            Err(RegistryError::Full { capacity: 2 })
        ));
        assert_eq!(reg.pairs(), vec![a, b]);
        assert_eq!(reg.maps().pairs.len(), 2);
        // Freed slots are reused, with zeroed counters.
        reg.remove_pair(&a).unwrap();
        reg.insert_pair(&c).unwrap();
        assert_eq!(reg.pair_stats(&c).unwrap(), RuleCounters::default());
    }

    #[test]
    fn map_full_from_the_map_is_typed_too() {
        // The hash map is smaller than the id space: its own E2BIG must surface as Full.
        let mut maps = MemoryMaps::with_capacity(4);
        maps.pairs.insert(
            pair_key(&pair("198.18.0.9", "198.18.0.3", 1)),
            Rule {
                id: 0,
                ..Rule::default()
            },
        );
        maps.capacity = 1;
        let mut reg = Registry::reconcile(maps).unwrap();
        let err = reg
            .insert_pair(&pair("198.18.0.2", "198.18.0.3", 80))
            .unwrap_err();
        assert!(matches!(err, RegistryError::Full { .. }), "{err}");
        assert_eq!(reg.pairs().len(), 1);
    }

    #[test]
    fn reconcile_restores_rules_and_ids() {
        let mut reg = Registry::reconcile(MemoryMaps::with_capacity(8)).unwrap();
        let a = pair("198.18.0.2", "198.18.0.3", 80);
        let r = capture(Some("198.18.0.2"), "198.19.0.10", "127.0.0.1", 15001);
        let any = capture(None, "198.18.0.3", "198.18.0.3", 15006);
        reg.insert_pair(&a).unwrap();
        reg.insert_capture(&r).unwrap();
        reg.insert_capture(&any).unwrap();
        let mut maps = reg.maps;
        maps.stats.insert(
            maps.pairs[&pair_key(&a)].id,
            RuleStats {
                msgs: 5,
                ..Default::default()
            },
        );
        let reg = Registry::reconcile(maps).unwrap();
        assert_eq!(reg.pairs(), vec![a]);
        let mut caps = reg.captures();
        caps.sort();
        let mut want = vec![r, any];
        want.sort();
        assert_eq!(caps, want);
        assert_eq!(reg.pair_stats(&a).unwrap().redirected_msgs, 5);
    }

    #[test]
    fn reconcile_refuses_duplicate_slots() {
        let mut maps = MemoryMaps::with_capacity(8);
        maps.pairs.insert(
            pair_key(&pair("198.18.0.2", "198.18.0.3", 80)),
            Rule {
                id: 1,
                ..Rule::default()
            },
        );
        maps.pairs.insert(
            pair_key(&pair("198.18.0.2", "198.18.0.3", 81)),
            Rule {
                id: 1,
                ..Rule::default()
            },
        );
        assert!(matches!(
            Registry::reconcile(maps),
            Err(RegistryError::Inconsistent(_))
        ));
    }

    #[test]
    fn capture_upsert_replaces_listener_keeping_slot() {
        let mut reg = Registry::reconcile(MemoryMaps::with_capacity(8)).unwrap();
        let r1 = capture(Some("198.18.0.2"), "198.19.0.10", "127.0.0.1", 15001);
        let r2 = capture(Some("198.18.0.2"), "198.19.0.10", "127.0.0.1", 15002);
        assert!(reg.upsert_capture(&r1).unwrap());
        assert!(matches!(
            reg.insert_capture(&r2),
            Err(RegistryError::AlreadyExists(_))
        ));
        assert!(!reg.upsert_capture(&r2).unwrap());
        assert_eq!(reg.captures(), vec![r2]);
        let v = reg.maps().captures[&capture_key(&r2)];
        assert_eq!(v.listener_port, 15002);
        reg.remove_capture(&r1).unwrap(); // same key
        assert!(reg.captures().is_empty());
    }

    fn any_ip() -> impl Strategy<Value = IpAddr> {
        prop_oneof![
            any::<u32>().prop_map(|v| IpAddr::V4(Ipv4Addr::from(v))),
            any::<u128>().prop_map(|v| IpAddr::V6(Ipv6Addr::from(v))),
        ]
    }

    proptest! {
        /// The two ends of one connection build keys that point at each other,
        /// in both pairing modes, whatever the addresses and ports.
        #[test]
        fn peer_keys_agree(a in any_ip(), b in any_ip(), pa in 1u16.., pb in 1u16.., netns in any::<u64>()) {
            prop_assume!(a.is_ipv4() == b.is_ipv4());
            let client = SocketAddr::new(a, pa);
            let server = SocketAddr::new(b, pb);
            let client_key = tuple_sock_key(client, server, netns);
            let server_key = tuple_sock_key(server, client, netns);
            prop_assert_eq!(peer_sock_key(&client_key), server_key);
            prop_assert_eq!(peer_sock_key(&server_key), client_key);
            let origin = capture_sock_key(client, netns, true);
            let captured = capture_sock_key(client, netns, false);
            prop_assert_eq!(peer_sock_key(&origin), captured);
            prop_assert_eq!(peer_sock_key(&captured), origin);
            prop_assert_eq!(origin.local_port, u32::from(pa));
        }

        /// Rules survive the round trip through their map form.
        #[test]
        fn pair_keys_round_trip(a in any_ip(), b in any_ip(), p in 1u16..) {
            if let Ok(pair) = EndpointPair::new(a, Endpoint::new(b, p)) {
                prop_assert_eq!(pair_from_key(&pair_key(&pair)).unwrap(), pair);
                prop_assert_eq!(pair_key(&pair).server_port, u32::from(p));
            }
        }
    }
}
