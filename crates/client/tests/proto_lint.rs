//! The proto follows buf's STANDARD lint rules that matter for a public API:
//! versioned package matching its directory, `FooRequest`/`FooResponse` per
//! RPC and unique, `_UNSPECIFIED` zero values with type-prefixed enum values,
//! lower_snake_case fields, PascalCase messages, a `Service` suffix.

use meshwarp_client::pb::FILE_DESCRIPTOR_SET;
use prost::Message;
use prost_types::FileDescriptorSet;

fn upper_snake(pascal: &str) -> String {
    let mut out = String::new();
    for (i, c) in pascal.chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

#[test]
fn follows_buf_standard_conventions() {
    let set = FileDescriptorSet::decode(FILE_DESCRIPTOR_SET).expect("descriptor set");
    let mut problems = Vec::new();
    for file in &set.file {
        let pkg = file.package();
        let name = file.name();
        if !pkg
            .split('.')
            .next_back()
            .is_some_and(|v| v.starts_with('v') && v[1..].chars().next().is_some_and(|c| c.is_ascii_digit()))
        {
            problems.push(format!("{name}: package {pkg} has no version suffix"));
        }
        if !name.starts_with(&format!("{}/", pkg.replace('.', "/"))) {
            problems.push(format!("{name}: not in the directory of package {pkg}"));
        }
        for m in &file.message_type {
            if !m.name().chars().next().is_some_and(|c| c.is_ascii_uppercase()) || m.name().contains('_') {
                problems.push(format!("message {} is not PascalCase", m.name()));
            }
            for f in &m.field {
                if f.name() != f.name().to_lowercase() || f.name().contains("__") {
                    problems.push(format!("field {}.{} is not lower_snake_case", m.name(), f.name()));
                }
            }
        }
        for e in &file.enum_type {
            let prefix = upper_snake(e.name());
            match e.value.first() {
                Some(z) if z.number() == 0 && z.name() == format!("{prefix}_UNSPECIFIED") => {}
                _ => problems.push(format!("enum {}: zero value must be {prefix}_UNSPECIFIED", e.name())),
            }
            for v in &e.value {
                if !v.name().starts_with(&format!("{prefix}_")) {
                    problems.push(format!("enum value {} lacks prefix {prefix}_", v.name()));
                }
            }
        }
        let mut seen = std::collections::HashSet::new();
        for s in &file.service {
            if !s.name().ends_with("Service") {
                problems.push(format!("service {} lacks the Service suffix", s.name()));
            }
            for m in &s.method {
                let want_in = format!(".{pkg}.{}Request", m.name());
                let want_out = format!(".{pkg}.{}Response", m.name());
                if m.input_type() != want_in {
                    problems.push(format!("rpc {}: request is {}, want {want_in}", m.name(), m.input_type()));
                }
                if m.output_type() != want_out {
                    problems.push(format!("rpc {}: response is {}, want {want_out}", m.name(), m.output_type()));
                }
                for t in [m.input_type(), m.output_type()] {
                    if !seen.insert(t.to_string()) {
                        problems.push(format!("{t} is used by more than one rpc"));
                    }
                }
            }
        }
    }
    assert!(problems.is_empty(), "proto lint:\n{}", problems.join("\n"));
}
