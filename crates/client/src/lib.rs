//! meshwarp-client: the node API (`meshwarp.node.v1alpha1`) for controllers —
//! the generated messages and `NodeService` stubs ([`pb`]) and a connection
//! helper for `unix:/path`, a bare absolute path, or an `http(s)://host:port`
//! address.
//!
//! It depends on no BPF library: a controller that only calls a node links
//! tonic and prost, not libbpf. The server side is `meshwarp-grpc-api`.

use std::path::PathBuf;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity, Uri};
use tower::service_fn;

use crate::pb::node_service_client::NodeServiceClient;

/// Generated messages and the service stubs.
pub mod pb {
    #![allow(missing_docs, missing_debug_implementations, clippy::all, clippy::unwrap_used)]
    tonic::include_proto!("meshwarp.node.v1alpha1");
    include!(concat!(env!("OUT_DIR"), "/meshwarp.node.v1alpha1.serde.rs"));

    /// The encoded descriptor set, for server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("meshwarp_descriptor");
}

/// Default Unix socket of `meshwarp serve`.
pub const DEFAULT_SOCKET: &str = "/run/meshwarp/meshwarp.sock";

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("connecting to {target}: {source}")]
    Connect {
        target: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("{0:?} is not a node address (unix:/path, /path or http://host:port)")]
    BadTarget(String),
}

/// Where a node service listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Unix(PathBuf),
    Tcp(String),
}

impl Target {
    pub fn parse(s: &str) -> Result<Self, ClientError> {
        if let Some(p) = s.strip_prefix("unix:") {
            return Ok(Self::Unix(p.into()));
        }
        if s.starts_with('/') {
            return Ok(Self::Unix(s.into()));
        }
        if s.starts_with("http://") || s.starts_with("https://") {
            return Ok(Self::Tcp(s.into()));
        }
        Err(ClientError::BadTarget(s.into()))
    }
}

/// PEM material for an `https://` node address: the CA that signed the
/// server's certificate, and this client's certificate and key.
#[derive(Debug, Clone)]
pub struct ClientTls {
    pub ca: Vec<u8>,
    pub cert: Vec<u8>,
    pub key: Vec<u8>,
    /// Name to verify the server certificate against (default: the host).
    pub domain: Option<String>,
}

/// A connected client.
pub async fn connect(target: &str) -> Result<NodeServiceClient<Channel>, ClientError> {
    connect_tls(target, None).await
}

/// A connected client, with mTLS for `https://` targets.
pub async fn connect_tls(target: &str, tls: Option<&ClientTls>) -> Result<NodeServiceClient<Channel>, ClientError> {
    let channel = channel_tls(target, tls).await?;
    Ok(NodeServiceClient::new(channel).max_decoding_message_size(64 << 20).max_encoding_message_size(64 << 20))
}

/// A channel to a node service, for the NodeService client or for the
/// health and reflection services served next to it.
pub async fn channel(target: &str) -> Result<Channel, ClientError> {
    channel_tls(target, None).await
}

/// As [`channel`], with mTLS for `https://` targets.
pub async fn channel_tls(target: &str, tls: Option<&ClientTls>) -> Result<Channel, ClientError> {
    let t = Target::parse(target)?;
    let err = |source| ClientError::Connect { target: target.to_string(), source };
    let channel = match t {
        Target::Unix(path) => {
            // The URI is required by the API and ignored by the connector.
            Endpoint::from_static("http://[::]:50051")
                .connect_timeout(Duration::from_secs(5))
                .connect_with_connector(service_fn(move |_: Uri| {
                    let path = path.clone();
                    async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
                }))
                .await
                .map_err(err)?
        }
        Target::Tcp(addr) => {
            let mut ep = Endpoint::from_shared(addr).map_err(err)?.connect_timeout(Duration::from_secs(5));
            if let Some(t) = tls {
                let mut cfg = ClientTlsConfig::new()
                    .ca_certificate(Certificate::from_pem(&t.ca))
                    .identity(Identity::from_pem(&t.cert, &t.key));
                if let Some(d) = &t.domain {
                    cfg = cfg.domain_name(d.clone());
                }
                ep = ep.tls_config(cfg).map_err(err)?;
            }
            ep.connect().await.map_err(err)?
        }
    };
    Ok(channel)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets() {
        assert_eq!(Target::parse("unix:/run/x.sock").unwrap(), Target::Unix("/run/x.sock".into()));
        assert_eq!(Target::parse("/run/x.sock").unwrap(), Target::Unix("/run/x.sock".into()));
        assert_eq!(Target::parse("http://127.0.0.1:1").unwrap(), Target::Tcp("http://127.0.0.1:1".into()));
        assert!(Target::parse("127.0.0.1:1").is_err());
    }
}
