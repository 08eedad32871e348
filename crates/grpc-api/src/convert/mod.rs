//! Proto <-> core conversions, one module per family: socket rules
//! ([`sock`]), interface routes ([`tc`]), plugins ([`plugin`]) and the
//! latency monitor and connection list ([`monitor`]). Parsing
//! collects every field violation with its proto path, so a client learns all
//! that is wrong with a request at once.

mod monitor;
mod plugin;
mod sock;
mod tc;

pub use monitor::*;
pub use plugin::*;
pub use sock::*;
pub use tc::*;

use std::net::IpAddr;

use meshwarp_core::{Endpoint, ValidationError};

use crate::pb;

/// A field that is wrong, with the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub field: String,
    pub description: String,
}

/// Every violation found in one request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Violations(pub Vec<Violation>);

impl Violations {
    pub fn add(&mut self, field: impl Into<String>, description: impl Into<String>) {
        self.0.push(Violation { field: field.into(), description: description.into() });
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `Ok(v)` if nothing was wrong.
    pub fn into_result<T>(self, v: T) -> Result<T, Violations> {
        if self.0.is_empty() {
            Ok(v)
        } else {
            Err(self)
        }
    }
}

fn join(prefix: &str, field: &str) -> String {
    if prefix.is_empty() {
        field.to_string()
    } else {
        format!("{prefix}.{field}")
    }
}

fn ip(v: &mut Violations, field: String, s: &str) -> Option<IpAddr> {
    if s.is_empty() {
        v.add(field, "required");
        return None;
    }
    match s.parse() {
        Ok(ip) => Some(ip),
        Err(_) => {
            v.add(field, format!("{s:?} is not an IPv4 or IPv6 address"));
            None
        }
    }
}

fn endpoint(v: &mut Violations, field: String, e: Option<&pb::Endpoint>) -> Option<Endpoint> {
    let Some(e) = e else {
        v.add(field, "required");
        return None;
    };
    let addr = ip(v, join(&field, "ip"), &e.ip);
    let port = match u16::try_from(e.port) {
        Ok(p) => Some(p),
        Err(_) => {
            v.add(join(&field, "port"), format!("{} is not a port (1-65535)", e.port));
            None
        }
    };
    Some(Endpoint::new(addr?, port?))
}

/// Maps a core validation error to the proto field it concerns. Core names
/// the endpoint ("server", "listener", ...) or "client"; the proto calls the
/// latter `client_ip` and an endpoint's address `<endpoint>.ip`.
fn validation(v: &mut Violations, prefix: &str, e: &ValidationError) {
    let addr_field = |core: &str| match core {
        "client" => "client_ip".to_string(),
        endpoint => format!("{endpoint}.ip"),
    };
    let field = match e {
        ValidationError::PortZero { field } => format!("{field}.port"),
        ValidationError::Unspecified { field, .. }
        | ValidationError::Multicast { field, .. }
        | ValidationError::Broadcast { field, .. }
        | ValidationError::V4Mapped { field, .. } => addr_field(field),
        ValidationError::MixedFamilies { b_field, .. } => addr_field(b_field),
        ValidationError::Mode(_) => "mode".to_string(),
    };
    v.add(join(prefix, &field), e.to_string());
}

/// Checks the owner of a mutating request.
pub fn owner(v: &mut Violations, field: &str, owner: &str) {
    if owner.is_empty() {
        v.add(field, "required: the controller that owns the resource");
    } else if owner.len() >= meshwarp_bpf::shared::OWNER_LEN {
        v.add(field, format!("at most {} bytes", meshwarp_bpf::shared::OWNER_LEN - 1));
    } else if owner.chars().any(|c| c.is_control()) {
        v.add(field, "control characters are not allowed");
    }
}

pub fn endpoint_to_pb(e: Endpoint) -> pb::Endpoint {
    pb::Endpoint { ip: e.addr.to_string(), port: u32::from(e.port) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners() {
        for (o, bad) in [("istio", false), ("", true), ("a\nb", true)] {
            let mut v = Violations::default();
            owner(&mut v, "owner", o);
            assert_eq!(!v.is_empty(), bad, "{o:?}");
        }
        let mut v = Violations::default();
        owner(&mut v, "owner", &"x".repeat(64));
        assert!(!v.is_empty());
    }
}
