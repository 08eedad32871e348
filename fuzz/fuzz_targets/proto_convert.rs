//! Requests arrive as protobuf from callers: any message must convert into a
//! core rule or a list of field violations, never a crash.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meshwarp_grpc_api::{convert, pb};
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let Some((&kind, body)) = data.split_first() else { return };
    match kind % 7 {
        0 => {
            if let Ok(m) = pb::EndpointPair::decode(body) {
                let _ = convert::pair_from_pb("pair", Some(&m));
            }
        }
        1 => {
            if let Ok(m) = pb::PairKey::decode(body) {
                let _ = convert::pair_from_key("key", Some(&m));
            }
        }
        2 => {
            if let Ok(m) = pb::CaptureRule::decode(body) {
                let _ = convert::capture_from_pb("rule", Some(&m));
            }
        }
        3 => {
            if let Ok(m) = pb::CaptureRuleKey::decode(body) {
                let _ = convert::capture_from_key("key", Some(&m));
            }
        }
        4 => {
            if let Ok(m) = pb::InterfaceRoute::decode(body) {
                let _ = convert::route_from_pb("route", Some(&m));
            }
        }
        5 => {
            if let Ok(m) = pb::RouteKey::decode(body) {
                let _ = convert::route_key_from_pb("key", Some(&m));
            }
        }
        _ => {
            if let Ok(m) = pb::PluginManifest::decode(body) {
                let _ = convert::manifest_from_pb("manifest", Some(&m));
            }
        }
    }
});
