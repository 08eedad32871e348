//! meshwarp's gRPC node service (`meshwarp.node.v1alpha1`), server side: the
//! proto <-> core conversions ([`convert`]), the `NodeService` server
//! ([`server`]), who may call it ([`access`]), the daemon around it
//! ([`daemon`]), `/metrics` and status mapping. The generated code and the client helper live in
//! `meshwarp-client` (no libbpf) and are re-exported here as [`pb`] and
//! [`client`].
//!
//! `meshwarp-core` never sees a protobuf type: every conversion lives here.

pub mod access;
pub mod convert;
pub mod daemon;
pub mod metrics;
pub mod server;
pub mod status;

/// Connecting to a node service (`meshwarp-client`).
pub use meshwarp_client as client;
/// Generated messages and the service stubs (from `meshwarp-client`).
pub use meshwarp_client::pb;
