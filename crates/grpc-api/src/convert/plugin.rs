//! Plugins: manifests, hooks and counters.

use super::{join, Violations};
use crate::pb;
use meshwarp_core::plugin::{hex, PluginCounters, PluginInfo};
use meshwarp_core::{FailurePolicy, Hook, Phase, PluginManifest};

pub fn hook_to_pb(h: Hook) -> i32 {
    (match h {
        Hook::Connection => pb::PluginHook::Connection,
        Hook::Message => pb::PluginHook::Message,
        Hook::Packet => pb::PluginHook::Packet,
    }) as i32
}

fn phase_to_pb(p: Phase) -> i32 {
    (match p {
        Phase::Authn => pb::PluginPhase::Authn,
        Phase::Authz => pb::PluginPhase::Authz,
        Phase::Stats => pb::PluginPhase::Stats,
        Phase::Unspecified => pb::PluginPhase::Unspecified,
    }) as i32
}

fn parse_hex32(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// A manifest from the wire; every violation under `field`.
pub fn manifest_from_pb(field: &str, m: Option<&pb::PluginManifest>) -> Result<PluginManifest, Violations> {
    let mut v = Violations::default();
    let Some(m) = m else {
        v.add(field, "required");
        return Err(v);
    };
    let hook = match pb::PluginHook::try_from(m.hook) {
        Ok(pb::PluginHook::Connection) => Some(Hook::Connection),
        Ok(pb::PluginHook::Message) => Some(Hook::Message),
        Ok(pb::PluginHook::Packet) => Some(Hook::Packet),
        Ok(pb::PluginHook::Unspecified) => {
            v.add(join(field, "hook"), "required");
            None
        }
        Err(_) => {
            v.add(join(field, "hook"), format!("unknown hook {}", m.hook));
            None
        }
    };
    let phase = match pb::PluginPhase::try_from(m.phase) {
        Ok(pb::PluginPhase::Authn) => Phase::Authn,
        Ok(pb::PluginPhase::Authz) => Phase::Authz,
        Ok(pb::PluginPhase::Stats) => Phase::Stats,
        Ok(pb::PluginPhase::Unspecified) => Phase::Unspecified,
        Err(_) => {
            v.add(join(field, "phase"), format!("unknown phase {}", m.phase));
            Phase::Unspecified
        }
    };
    let failure = match pb::FailurePolicy::try_from(m.failure_policy) {
        Ok(pb::FailurePolicy::FailClosed) => FailurePolicy::Closed,
        Ok(pb::FailurePolicy::FailOpen | pb::FailurePolicy::Unspecified) => FailurePolicy::Open,
        Err(_) => {
            v.add(join(field, "failure_policy"), format!("unknown failure policy {}", m.failure_policy));
            FailurePolicy::Open
        }
    };
    let sha256 = if m.sha256.is_empty() {
        None
    } else {
        let parsed = parse_hex32(&m.sha256.to_ascii_lowercase());
        if parsed.is_none() {
            v.add(join(field, "sha256"), "want 64 hex digits");
        }
        parsed
    };
    let out = PluginManifest {
        name: m.name.clone(),
        version: m.version.clone(),
        hook: hook.unwrap_or(Hook::Message),
        phase,
        priority: m.priority,
        failure,
        sha256,
    };
    if let Err(meshwarp_core::PluginError::Invalid { field: f, reason }) = out.validate() {
        v.add(join(field, f), reason);
    }
    v.into_result(out)
}

fn manifest_to_pb(m: &PluginManifest) -> pb::PluginManifest {
    pb::PluginManifest {
        name: m.name.clone(),
        version: m.version.clone(),
        hook: hook_to_pb(m.hook),
        phase: phase_to_pb(m.phase),
        priority: m.priority,
        failure_policy: (match m.failure {
            FailurePolicy::Open => pb::FailurePolicy::FailOpen,
            FailurePolicy::Closed => pb::FailurePolicy::FailClosed,
        }) as i32,
        sha256: m.sha256.as_ref().map(|d| hex(d)).unwrap_or_default(),
    }
}

pub fn plugin_counters_to_pb(hook: Hook, c: &PluginCounters) -> pb::PluginCounters {
    let mut out = pb::PluginCounters {
        runs: c.runs,
        continued: c.continued,
        dropped: c.dropped,
        invalid: c.invalid,
        missing: c.missing,
        ..Default::default()
    };
    match hook {
        Hook::Connection => out.declined = c.verdict1,
        Hook::Message => out.bypassed = c.verdict1,
        Hook::Packet => out.passed = c.verdict1,
    }
    out
}

pub fn plugin_to_pb(p: &PluginInfo) -> pb::Plugin {
    pb::Plugin {
        manifest: Some(manifest_to_pb(&p.manifest)),
        id: p.id,
        prog_id: p.prog_id,
        abi_version: format!("{}.{}", p.abi.0, p.abi.1),
        sha256: hex(&p.sha256),
        config: p.config.clone(),
        position: p.position,
        counters: Some(plugin_counters_to_pb(p.manifest.hook, &p.counters)),
        maps: p.maps.iter().map(|m| pb::PluginMap { name: m.name.clone(), pin: m.pin.display().to_string() }).collect(),
        owner: p.owner.clone(),
    }
}

#[cfg(test)]
mod plugin_tests {
    use super::*;

    #[test]
    fn manifest_round_trip_and_violations() {
        let m = pb::PluginManifest {
            name: "ports".into(),
            version: "1.0".into(),
            hook: pb::PluginHook::Connection as i32,
            phase: pb::PluginPhase::Authz as i32,
            priority: 7,
            failure_policy: pb::FailurePolicy::FailClosed as i32,
            sha256: "ab".repeat(32),
        };
        let core = manifest_from_pb("manifest", Some(&m)).unwrap();
        assert_eq!(core.sha256, Some([0xab; 32]));
        assert_eq!(manifest_to_pb(&core), m);

        let bad = pb::PluginManifest {
            name: "Bad Name".into(),
            hook: 9,
            phase: 8,
            failure_policy: 5,
            sha256: "xyz".into(),
            ..m
        };
        let v = manifest_from_pb("manifest", Some(&bad)).unwrap_err();
        let fields: Vec<&str> = v.0.iter().map(|x| x.field.as_str()).collect();
        assert_eq!(
            fields,
            ["manifest.hook", "manifest.phase", "manifest.failure_policy", "manifest.sha256", "manifest.name"]
        );
        let v = manifest_from_pb("manifest", None).unwrap_err();
        assert_eq!(v.0[0].field, "manifest");
        let unspecified = pb::PluginManifest { name: "x".into(), ..Default::default() };
        assert_eq!(manifest_from_pb("m", Some(&unspecified)).unwrap_err().0[0].field, "m.hook");
    }
}
