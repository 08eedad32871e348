//! meshwarp's gRPC node API (`meshwarp.node.v1alpha1`): the generated code,
//! proto <-> core conversions ([`convert`]), the `NodeService` server
//! ([`server`]) and a client helper ([`client`]).
//!
//! `meshwarp-core` never sees a protobuf type: every conversion lives here.

pub mod client;
pub mod convert;
pub mod daemon;
pub mod metrics;
pub mod server;
pub mod status;

/// Generated messages and the service stubs.
pub mod pb {
    #![allow(missing_docs, missing_debug_implementations, clippy::all, clippy::unwrap_used)]
    tonic::include_proto!("meshwarp.node.v1alpha1");
    include!(concat!(env!("OUT_DIR"), "/meshwarp.node.v1alpha1.serde.rs"));

    /// The encoded descriptor set, for server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("meshwarp_descriptor");
}
