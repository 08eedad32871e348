//! How errors reach callers: one gRPC code per kind of failure, with
//! google.rpc.BadRequest field violations for invalid input.

use meshwarp_core::RuleError;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::convert::Violations;

/// INVALID_ARGUMENT listing every field violation.
pub fn invalid(v: &Violations) -> Status {
    let mut details = ErrorDetails::new();
    for x in &v.0 {
        details.add_bad_request_violation(x.field.clone(), x.description.clone());
    }
    let summary: Vec<String> = v.0.iter().map(|x| format!("{}: {}", x.field, x.description)).collect();
    Status::with_error_details(Code::InvalidArgument, summary.join("; "), details)
}

/// INVALID_ARGUMENT for one field.
pub fn invalid_field(field: &str, description: impl Into<String>) -> Status {
    let mut v = Violations::default();
    v.add(field, description);
    invalid(&v)
}

/// The code a rule-table failure (socket rules and tc routes alike) maps to.
pub fn from_rule(e: &RuleError) -> Status {
    let msg = e.to_string();
    match e {
        RuleError::AlreadyExists(_) => Status::already_exists(msg),
        RuleError::NotFound(_) => Status::not_found(msg),
        RuleError::Full { .. } => Status::resource_exhausted(msg),
        RuleError::OwnerMismatch { .. } => Status::permission_denied(msg),
        RuleError::InvalidOwner(_) => invalid_field("owner", msg),
        RuleError::DuplicateInBatch(_) => Status::invalid_argument(msg),
        RuleError::Inconsistent(_) | RuleError::Map(_) => Status::internal(msg),
    }
}

/// The code a latency-monitor failure maps to.
pub fn from_latency(e: &meshwarp_core::latency::LatencyError) -> Status {
    use meshwarp_core::latency::LatencyError;
    match e {
        LatencyError::RuleOutOfRange { .. } => Status::invalid_argument(e.to_string()),
        _ => Status::internal(e.to_string()),
    }
}

/// The code a tc data-path failure maps to.
pub fn from_tc(e: &meshwarp_core::tc::TcError) -> Status {
    use meshwarp_core::tc::{RouteError, TcError};
    let msg = e.to_string();
    match e {
        TcError::Invalid(RouteError::UnknownInterface(_)) | TcError::Invalid(RouteError::NotVeth(_)) => {
            invalid_field("route.target", msg)
        }
        TcError::Invalid(_) => Status::invalid_argument(msg),
        TcError::Rule(e) => from_rule(e),
        TcError::Latency(e) => from_latency(e),
        TcError::Netlink(_)
        | TcError::Bpf { .. }
        | TcError::Load { .. }
        | TcError::Io { .. }
        | TcError::Partial { .. }
        | TcError::Sys(_) => Status::internal(msg),
    }
}

/// The code a plugin failure maps to. Status messages travel in HTTP/2
/// headers, so a verifier log keeps only its end (where the verifier says what
/// it refused); the daemon logs it whole.
pub fn from_plugin(e: &meshwarp_core::PluginError) -> Status {
    use meshwarp_core::PluginError as E;
    const MAX_LOG: usize = 2500;
    let msg = e.to_string();
    if let E::Rejected { name, source, log } = e {
        tracing::warn!(plugin = %name, "kernel refused plugin: {source}\n{log}");
        let cut = log.len().saturating_sub(MAX_LOG);
        let cut = (cut..=log.len()).find(|i| log.is_char_boundary(*i)).unwrap_or(log.len());
        let tail = if cut > 0 { format!("...{}", &log[cut..]) } else { log.clone() };
        let mut details = ErrorDetails::new();
        details.add_bad_request_violation("object", "refused by the kernel's verifier (log in the message)");
        let msg = format!("the kernel refused plugin {name}: {source}\n--- verifier log (end) ---\n{tail}");
        return Status::with_error_details(Code::InvalidArgument, msg, details);
    }
    match e {
        E::Invalid { field, .. } => invalid_field(&format!("manifest.{field}"), msg),
        E::ConfigTooLarge { .. } => invalid_field("config", msg),
        E::Sha256Mismatch { .. } => invalid_field("manifest.sha256", msg),
        E::HookMismatch { .. } => invalid_field("manifest.hook", msg),
        E::NotAPlugin { .. } | E::Rejected { .. } => invalid_field("object", msg),
        E::AbiMismatch { .. } | E::HookUnavailable { .. } | E::HookChange { .. } => Status::failed_precondition(msg),
        E::AlreadyExists { .. } => Status::already_exists(msg),
        E::OwnerMismatch { .. } => Status::permission_denied(msg),
        E::NotFound { .. } => Status::not_found(msg),
        E::ChainFull { .. } | E::NoSlot => Status::resource_exhausted(msg),
        E::Bpf { .. } | E::Io { .. } | E::Map(_) | E::Injected(_) => Status::internal(msg),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_distinct_per_kind() {
        let cases = [
            (RuleError::AlreadyExists("x".into()), Code::AlreadyExists),
            (RuleError::NotFound("x".into()), Code::NotFound),
            (RuleError::Full { capacity: 1 }, Code::ResourceExhausted),
            (
                RuleError::OwnerMismatch { what: "x".into(), owner: "a".into(), requested: "b".into() },
                Code::PermissionDenied,
            ),
            (RuleError::Inconsistent("x".into()), Code::Internal),
        ];
        for (e, code) in cases {
            assert_eq!(from_rule(&e).code(), code, "{e}");
        }
    }

    #[test]
    fn violations_travel_as_bad_request() {
        let mut v = Violations::default();
        v.add("pair.server.port", "port 0");
        v.add("owner", "required");
        let s = invalid(&v);
        assert_eq!(s.code(), Code::InvalidArgument);
        let br = s.get_details_bad_request().expect("BadRequest detail");
        let fields: Vec<_> = br.field_violations.iter().map(|f| f.field.as_str()).collect();
        assert_eq!(fields, vec!["pair.server.port", "owner"]);
    }
}
