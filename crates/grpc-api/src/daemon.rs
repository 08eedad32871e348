//! Running the node service: a Unix socket (mode and group set, peer
//! credentials checked), optional loopback TCP, gRPC health and reflection,
//! Prometheus `/metrics`, and a graceful stop that leaves the pinned data path
//! in place (unless asked to clean up).

use std::future::Future;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use meshwarp_core::node::{Node, NodeConfig};
use meshwarp_core::DataplaneConfig;
use nix::unistd::{Gid, Group};
use tokio::net::{TcpListener, UnixListener};
use tokio_stream::wrappers::{TcpListenerStream, UnixListenerStream};
use tokio_stream::StreamExt;

use crate::access::{Access, Grant, OwnerPatterns, PeerStream, Principal};
use crate::metrics::Metrics;
use crate::pb::node_service_server::NodeServiceServer;
use crate::server::{NodeServer, ServerConfig};

/// PEM files for mTLS on TCP: the server's certificate and key, and the CA
/// that signs the clients' certificates (a client certificate is required).
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: PathBuf,
}

/// What `meshwarp serve` runs with.
#[derive(Debug, Clone)]
pub struct DaemonOptions {
    pub dataplane: DataplaneConfig,
    pub server: ServerConfig,
    /// Unix socket to serve on (`None`: TCP only).
    pub socket: Option<PathBuf>,
    pub socket_mode: u32,
    /// Group allowed besides root (and owner of the socket file).
    pub socket_group: Option<String>,
    /// gRPC over TCP, only with `tls` (mTLS: a client certificate names
    /// the caller; plaintext TCP would name no one).
    pub tcp_listen: Option<SocketAddr>,
    pub tls: Option<TlsFiles>,
    pub metrics_listen: Option<SocketAddr>,
    /// Network namespace whose interfaces tc routes refer to (`None`: the
    /// daemon's own, the node's).
    pub netns: Option<PathBuf>,
    /// On stop, detach and unpin the data path too.
    pub cleanup_on_exit: bool,
    pub drain_timeout: Duration,
    /// Who may call besides root and the daemon's own user, and as which
    /// owners (`socket_group` adds a grant of everything to its members).
    pub grants: Vec<Grant>,
}

impl Default for DaemonOptions {
    fn default() -> Self {
        Self {
            dataplane: DataplaneConfig::default(),
            server: ServerConfig::default(),
            socket: Some(crate::client::DEFAULT_SOCKET.into()),
            socket_mode: 0o660,
            socket_group: None,
            tcp_listen: None,
            tls: None,
            metrics_listen: None,
            netns: None,
            cleanup_on_exit: false,
            drain_timeout: Duration::from_secs(10),
            grants: Vec::new(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("refusing plaintext gRPC on {0}: TCP needs mTLS, since a TCP caller is known only by its client certificate (set tls_cert, tls_key and tls_client_ca), or use the Unix socket")]
    InsecureTcp(SocketAddr),
    #[error("TLS configuration: {0}")]
    Tls(String),
    #[error("unknown group {0:?} (socket_group)")]
    UnknownGroup(String),
    #[error("another meshwarp serve is answering on {0}")]
    SocketInUse(PathBuf),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Node(#[from] meshwarp_core::node::NodeError),
    #[error("serving gRPC: {0}")]
    Transport(#[from] tonic::transport::Error),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DaemonError {
    let what = what.into();
    move |source| DaemonError::Io { what, source }
}

/// Refuses what the daemon must not do before anything is loaded.
pub fn check_options(o: &DaemonOptions) -> Result<Option<Gid>, DaemonError> {
    if let Some(addr) = o.tcp_listen {
        if o.tls.is_none() {
            return Err(DaemonError::InsecureTcp(addr));
        }
    }
    match &o.socket_group {
        None => Ok(None),
        Some(name) => match Group::from_name(name) {
            Ok(Some(g)) => Ok(Some(g.gid)),
            _ => Err(DaemonError::UnknownGroup(name.clone())),
        },
    }
}

type Guarded = tower::layer::util::Stack<
    tower::util::MapResponseLayer<fn(http::Response<tonic::body::Body>) -> http::Response<tonic::body::Body>>,
    tower::layer::util::Stack<tonic::service::InterceptorLayer<Access>, tower::layer::util::Identity>,
>;

/// A gRPC server with the node service's access check (on every service,
/// health and reflection included) and limits: per-connection streams,
/// request deadlines and the code for an oversized request.
fn server_builder(limits: &ServerConfig, access: &Access) -> tonic::transport::Server<Guarded> {
    let fix: fn(http::Response<tonic::body::Body>) -> http::Response<tonic::body::Body> =
        oversize_is_resource_exhausted;
    tonic::transport::Server::builder()
        .max_concurrent_streams(limits.max_concurrent_streams)
        .timeout(limits.request_timeout)
        // Outermost first: the caller is checked before anything else runs.
        .layer(tonic::service::InterceptorLayer::new(access.clone()))
        .layer(tower::util::MapResponseLayer::new(fix))
}

/// tonic answers a request beyond the message limit with OUT_OF_RANGE; the
/// gRPC specification's code for it is RESOURCE_EXHAUSTED. Its message, which
/// names the limit, stays.
fn oversize_is_resource_exhausted<B>(mut r: http::Response<B>) -> http::Response<B> {
    let status = r.headers().get("grpc-status").and_then(|v| v.to_str().ok());
    let message = r.headers().get("grpc-message").and_then(|v| v.to_str().ok()).unwrap_or_default();
    if status == Some("11")
        && message.replace("%20", " ").replace("%2C", ",").starts_with("Error, decoded message length too large")
    {
        r.headers_mut().insert("grpc-status", http::HeaderValue::from_static("8"));
    }
    r
}

async fn bind_unix(path: &Path, mode: u32, gid: Option<Gid>) -> Result<UnixListener, DaemonError> {
    if let Some(dir) = path.parent() {
        tokio::fs::create_dir_all(dir).await.map_err(io(format!("creating {}", dir.display())))?;
    }
    if path.exists() {
        if tokio::net::UnixStream::connect(path).await.is_ok() {
            return Err(DaemonError::SocketInUse(path.to_path_buf()));
        }
        // A stale socket of a daemon that died.
        tokio::fs::remove_file(path).await.map_err(io(format!("removing stale {}", path.display())))?;
    }
    let l = UnixListener::bind(path).map_err(io(format!("binding {}", path.display())))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(io(format!("chmod {}", path.display())))?;
    if let Some(g) = gid {
        nix::unistd::chown(path, None, Some(g))
            .map_err(|e| DaemonError::Io { what: format!("chgrp {}", path.display()), source: e.into() })?;
    }
    Ok(l)
}

async fn server_tls(t: &TlsFiles) -> Result<tonic::transport::ServerTlsConfig, DaemonError> {
    let read = |p: PathBuf| async move { tokio::fs::read(&p).await.map_err(io(format!("reading {}", p.display()))) };
    let (cert, key, ca) = (read(t.cert.clone()).await?, read(t.key.clone()).await?, read(t.client_ca.clone()).await?);
    Ok(tonic::transport::ServerTlsConfig::new()
        .identity(tonic::transport::Identity::from_pem(cert, key))
        .client_ca_root(tonic::transport::Certificate::from_pem(ca))
        .client_auth_optional(false))
}

/// Runs until `shutdown` resolves, then drains: health turns NOT_SERVING,
/// RPCs answer UNAVAILABLE, in-flight calls get `drain_timeout` to finish.
pub async fn run(opts: DaemonOptions, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), DaemonError> {
    let gid = check_options(&opts)?;
    let node = Node::open(&NodeConfig {
        dataplane: opts.dataplane.clone(),
        netns: opts.netns.clone(),
        // A predecessor may still drain (up to twice its drain timeout).
        pin_lock_wait: opts.drain_timeout * 2 + Duration::from_secs(5),
    })?;
    let dp = Arc::clone(&node.dataplane);
    let metrics = Arc::new(Metrics::new());
    let node = NodeServer::new(node, opts.server.clone(), Arc::clone(&metrics));
    let (health, health_svc) = tonic_health::server::health_reporter();
    health.set_serving::<NodeServiceServer<NodeServer>>().await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| DaemonError::Io { what: "reflection".into(), source: std::io::Error::other(e) })?;
    let limits = opts.server.clone();
    // Responses are ours and may list every rule; requests are bounded.
    let inner = NodeServiceServer::new(node.clone())
        .max_decoding_message_size(limits.max_message_bytes)
        .max_encoding_message_size(64 << 20);
    let mut grants = opts.grants.clone();
    if let Some(g) = gid {
        grants.push(Grant { who: Principal::Gid(g.as_raw()), owners: OwnerPatterns::any(), node_admin: true });
    }
    let access = Access::new(grants);
    let svc = inner;

    let (stop_tx, _) = tokio::sync::broadcast::channel::<()>(1);
    let mut servers = tokio::task::JoinSet::new();
    if let Some(path) = &opts.socket {
        let l = bind_unix(path, opts.socket_mode, gid).await?;
        tracing::info!(socket = %path.display(), mode = format!("{:o}", opts.socket_mode), "serving gRPC");
        let router = server_builder(&limits, &access)
            .add_service(health_svc.clone())
            .add_service(reflection.clone())
            .add_service(svc.clone());
        let mut stop = stop_tx.subscribe();
        servers.spawn(async move {
            router
                .serve_with_incoming_shutdown(UnixListenerStream::new(l).map(|c| c.map(PeerStream::new)), async move {
                    let _ = stop.recv().await;
                })
                .await
        });
    }
    if let Some(addr) = opts.tcp_listen {
        let l = TcpListener::bind(addr).await.map_err(io(format!("binding {addr}")))?;
        let mut builder = server_builder(&limits, &access);
        if let Some(tls) = &opts.tls {
            builder = builder.tls_config(server_tls(tls).await?).map_err(|e| DaemonError::Tls(e.to_string()))?;
        }
        tracing::info!(%addr, mtls = opts.tls.is_some(), "serving gRPC on TCP");
        let router = builder.add_service(health_svc.clone()).add_service(reflection.clone()).add_service(svc.clone());
        let mut stop = stop_tx.subscribe();
        servers.spawn(async move {
            router
                .serve_with_incoming_shutdown(TcpListenerStream::new(l), async move {
                    let _ = stop.recv().await;
                })
                .await
        });
    }
    if let Some(addr) = opts.metrics_listen {
        let l = TcpListener::bind(addr).await.map_err(io(format!("binding metrics {addr}")))?;
        tracing::info!(%addr, "serving /metrics");
        let (m, d, plugins, tc) = (Arc::clone(&metrics), Arc::clone(&dp), node.plugins(), node.tc_family());
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let (m, d, p, tc) = (Arc::clone(&m), Arc::clone(&d), plugins.clone(), tc.clone());
                async move {
                    let body = tokio::task::spawn_blocking(move || m.render(&d, tc.as_deref(), p.as_deref()))
                        .await
                        .unwrap_or_default();
                    (
                        [(
                            axum::http::header::CONTENT_TYPE,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        body,
                    )
                }
            }),
        );
        let mut stop = stop_tx.subscribe();
        servers.spawn(async move {
            axum::serve(l, app)
                .with_graceful_shutdown(async move {
                    let _ = stop.recv().await;
                })
                .await
                .map_err(|e| {
                    tracing::warn!("metrics server: {e}");
                })
                .ok();
            Ok(())
        });
    }
    // Interfaces come and go with pods: routes naming a vanished one leave the
    // data path and are announced as stale. Leases are checked as often.
    {
        let (node, mut stop) = (node.clone(), stop_tx.subscribe());
        servers.spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    _ = stop.recv() => return Ok(()),
                    _ = tick.tick() => {
                        if let Err(e) = node.refresh_routes_now().await {
                            if e.code() != tonic::Code::FailedPrecondition {
                                tracing::warn!("refreshing routes: {}", e.message());
                            }
                        }
                        // Owners whose controller stopped renewing its lease.
                        node.expire_leases_now().await;
                    }
                }
            }
        });
    }
    tracing::info!(instance_id = node.instance_id(), "meshwarp node service ready");

    shutdown.await;
    tracing::info!("stopping: draining RPCs; the pinned data path keeps forwarding");
    node.start_draining();
    health.set_not_serving::<NodeServiceServer<NodeServer>>().await;
    let _ = stop_tx.send(());
    let drained = tokio::time::timeout(opts.drain_timeout, async {
        while let Some(r) = servers.join_next().await {
            if let Ok(Err(e)) = r {
                tracing::warn!("server: {e}");
            }
        }
    })
    .await;
    if drained.is_err() {
        tracing::warn!("drain timeout: closing remaining connections");
        servers.abort_all();
    }
    // A body whose connection was closed still runs on the blocking pool:
    // let it finish before the socket goes and, with --cleanup, the pins.
    let idle = node.wait_idle(opts.drain_timeout).await;
    if idle.is_none() {
        tracing::warn!("RPC bodies still running after the drain timeout");
    }
    if let Some(path) = &opts.socket {
        let _ = std::fs::remove_file(path);
    }
    drop(node);
    if opts.cleanup_on_exit {
        // The last handle stops the guard thread; then every family's pins
        // go (socket, tc, plugins), whether or not a handle is still held.
        let last = Arc::try_unwrap(dp).is_ok();
        meshwarp_core::node::uninstall(&opts.dataplane.pin_root)?;
        tracing::info!(guard_stopped = last, "data path detached and unpinned (--cleanup)");
    }
    Ok(())
}

/// A node service run inside this process on a runtime of its own (the demo,
/// benches): [`EmbeddedNode::start`] returns once it answers on its socket;
/// dropping it stops it (and, with `cleanup_on_exit`, removes its data path).
#[derive(Debug)]
pub struct EmbeddedNode {
    rt: tokio::runtime::Runtime,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<(), DaemonError>>>,
    socket: PathBuf,
}

impl EmbeddedNode {
    /// Starts `opts` (which must name a Unix socket) and waits until it serves.
    pub fn start(opts: DaemonOptions) -> Result<Self, DaemonError> {
        let socket = opts.socket.clone().ok_or_else(|| DaemonError::Io {
            what: "an embedded node service".into(),
            source: std::io::Error::other("needs a Unix socket"),
        })?;
        let rt = tokio::runtime::Runtime::new().map_err(io("starting a runtime"))?;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = rt.spawn(run(opts, async move {
            let _ = rx.await;
        }));
        let mut node = Self { rt, stop: Some(tx), task: Some(task), socket };
        let target = node.socket.display().to_string();
        let ready = node.rt.block_on(async {
            for _ in 0..500 {
                if let Ok(mut c) = crate::client::connect(&target).await {
                    if c.get_node_info(crate::pb::GetNodeInfoRequest {}).await.is_ok() {
                        return true;
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            false
        });
        if !ready {
            // Surface why it stopped, if it did.
            if let Some(t) = node.task.take() {
                if t.is_finished() {
                    if let Ok(Err(e)) = node.rt.block_on(t) {
                        return Err(e);
                    }
                } else {
                    node.task = Some(t);
                }
            }
            return Err(DaemonError::Io {
                what: format!("embedded node service on {target}"),
                source: std::io::Error::new(std::io::ErrorKind::TimedOut, "did not answer within 10 s"),
            });
        }
        Ok(node)
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The runtime the service runs on, to drive a client from it.
    pub fn runtime(&self) -> &tokio::runtime::Runtime {
        &self.rt
    }

    /// A client connected over the socket, on the service's runtime.
    pub fn client(
        &self,
    ) -> Result<crate::pb::node_service_client::NodeServiceClient<tonic::transport::Channel>, crate::client::ClientError>
    {
        self.rt.block_on(crate::client::connect(&self.socket.display().to_string()))
    }
}

impl Drop for EmbeddedNode {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.task.take() {
            match self.rt.block_on(t) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!("embedded node service: {e}"),
                Err(e) => tracing::warn!("embedded node service task: {e}"),
            }
        }
    }
}
