//! The failures every family shares, each saying what was being done: a
//! libbpf call ([`BpfError`]) and a file or system call ([`IoError`]). The
//! error enums of the modules wrap them, so they are written once.

/// A libbpf call failed while doing `what`.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub struct BpfError {
    pub what: String,
    #[source]
    pub source: libbpf_rs::Error,
}

impl BpfError {
    pub fn new(what: impl Into<String>, source: libbpf_rs::Error) -> Self {
        Self { what: what.into(), source }
    }
}

/// A file or system call failed while doing `what` (or on the path `what`).
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub struct IoError {
    pub what: String,
    #[source]
    pub source: std::io::Error,
}

impl IoError {
    pub fn new(what: impl Into<String>, source: std::io::Error) -> Self {
        Self { what: what.into(), source }
    }
}
