//! Connecting to a node service: `unix:/path`, a bare absolute path, or an
//! `http://host:port` address.

use std::path::PathBuf;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};
use tower::service_fn;

use crate::pb::node_service_client::NodeServiceClient;

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

/// A connected client.
pub async fn connect(target: &str) -> Result<NodeServiceClient<Channel>, ClientError> {
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
        Target::Tcp(addr) => Endpoint::from_shared(addr)
            .map_err(err)?
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .await
            .map_err(err)?,
    };
    Ok(NodeServiceClient::new(channel).max_decoding_message_size(64 << 20).max_encoding_message_size(64 << 20))
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
