//! Who may call the node service, and as which owners.
//!
//! Every caller has an identity, taken from the transport and never from the
//! request: Unix peer credentials (uid, gid and supplementary groups, read
//! with SO_PEERCRED/SO_PEERGROUPS when the connection is accepted, so a
//! reused PID cannot lend its groups) or the names of an mTLS client
//! certificate (subject CN, DNS and URI SANs, each kept with its field). [`Access`] maps identities to
//! [`Rights`]: the owners they may act as and whether they may change the
//! node itself (plugins, attachments). A request without an identity, or
//! with one no grant names, is refused before any service (health and
//! reflection included) sees it; a mutation for an owner the caller may not
//! use is PERMISSION_DENIED.

use std::io;
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::UnixStream;
use tonic::transport::server::{Connected, TcpConnectInfo, TlsConnectInfo};
use tonic::{Request, Status};

use crate::pb;

/// Who a grant is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Principal {
    /// A Unix user, by uid.
    Uid(u32),
    /// Members of a Unix group (primary or supplementary), by gid.
    Gid(u32),
    /// A client certificate carrying this name, in this field.
    Cert(CertName),
}

/// One name of a client certificate and the field it is in. Kept apart so a
/// certificate whose CN reads like another's DNS or URI SAN (a CA that signs
/// CNs freely) is not taken for it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum CertName {
    /// Subject common name.
    Cn(String),
    /// DNS subject alternative name.
    Dns(String),
    /// URI subject alternative name (e.g. a SPIFFE ID).
    Uri(String),
}

impl std::str::FromStr for CertName {
    type Err = String;

    /// `cn:NAME`, `dns:NAME` or `uri:NAME`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (kind, name) = s.split_once(':').unwrap_or(("", s));
        if name.is_empty() {
            return Err(format!("certificate name {s:?} is empty"));
        }
        match kind {
            "cn" => Ok(Self::Cn(name.into())),
            "dns" => Ok(Self::Dns(name.into())),
            "uri" => Ok(Self::Uri(name.into())),
            _ => Err(format!("certificate name {s:?} must say which field it is in: cn:NAME, dns:NAME or uri:NAME")),
        }
    }
}

impl std::fmt::Display for CertName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cn(n) => write!(f, "cn:{n}"),
            Self::Dns(n) => write!(f, "dns:{n}"),
            Self::Uri(n) => write!(f, "uri:{n}"),
        }
    }
}

/// Owners a caller may act as: names, or prefixes ending in `*` (`*` alone:
/// any owner).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OwnerPatterns(pub Vec<String>);

impl OwnerPatterns {
    pub fn any() -> Self {
        Self(vec!["*".into()])
    }

    pub fn allows(&self, owner: &str) -> bool {
        self.0.iter().any(|p| match p.strip_suffix('*') {
            Some(prefix) => owner.starts_with(prefix),
            None => p == owner,
        })
    }
}

/// What one principal may do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub who: Principal,
    pub owners: OwnerPatterns,
    /// May load, unload and configure plugins and attach or detach
    /// interfaces: changes to the node beyond one owner's rules.
    pub node_admin: bool,
}

/// What a caller may do: the union of the grants that name it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rights {
    pub owners: OwnerPatterns,
    pub node_admin: bool,
}

impl Rights {
    fn all() -> Self {
        Self { owners: OwnerPatterns::any(), node_admin: true }
    }

    fn add(&mut self, g: &Grant) {
        self.owners.0.extend(g.owners.0.iter().cloned());
        self.node_admin |= g.node_admin;
    }
}

/// A caller's identity, as its transport proves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    Unix { uid: u32, gid: u32, groups: Vec<u32> },
    Cert { names: Vec<CertName> },
}

impl std::fmt::Display for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unix { uid, gid, .. } => write!(f, "uid {uid} (gid {gid})"),
            Self::Cert { names } => {
                let names: Vec<String> = names.iter().map(ToString::to_string).collect();
                write!(f, "certificate [{}]", names.join(", "))
            }
        }
    }
}

/// The node's access configuration: root and the daemon's own user may do
/// everything; everyone else only what a grant gives them.
#[derive(Debug, Clone)]
pub struct Access {
    me: u32,
    grants: Vec<Grant>,
}

impl Access {
    pub fn new(grants: Vec<Grant>) -> Self {
        Self { me: nix::unistd::geteuid().as_raw(), grants }
    }

    /// The rights of `id`; `None`: it may not call at all.
    pub fn rights(&self, id: &Identity) -> Option<Rights> {
        if let Identity::Unix { uid, .. } = id {
            if *uid == 0 || *uid == self.me {
                return Some(Rights::all());
            }
        }
        let mut rights: Option<Rights> = None;
        for g in self.grants.iter().filter(|g| names(id, &g.who)) {
            rights.get_or_insert_with(Rights::default).add(g);
        }
        rights
    }

    /// Authenticates a request from its transport and attaches its
    /// [`Rights`]; for every service of the daemon.
    #[allow(clippy::result_large_err)]
    fn check(&self, mut req: Request<()>) -> Result<Request<()>, Status> {
        let id = identity(&req).ok_or_else(|| {
            Status::unauthenticated("no caller identity: use the Unix socket or mTLS with a client certificate")
        })?;
        let rights = self
            .rights(&id)
            .ok_or_else(|| Status::permission_denied(format!("{id} is not allowed to use this node")))?;
        req.extensions_mut().insert(rights);
        req.extensions_mut().insert(id);
        Ok(req)
    }
}

impl tonic::service::Interceptor for Access {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        self.check(req)
    }
}

fn names(id: &Identity, who: &Principal) -> bool {
    match (id, who) {
        (Identity::Unix { uid, .. }, Principal::Uid(u)) => uid == u,
        (Identity::Unix { gid, groups, .. }, Principal::Gid(g)) => gid == g || groups.contains(g),
        (Identity::Cert { names }, Principal::Cert(n)) => names.iter().any(|x| x == n),
        _ => false,
    }
}

fn identity<T>(req: &Request<T>) -> Option<Identity> {
    if let Some(p) = req.extensions().get::<UnixPeer>() {
        return p.0.clone();
    }
    let tls = req.extensions().get::<TlsConnectInfo<TcpConnectInfo>>()?;
    let certs = tls.peer_certs()?;
    let names = cert_names(certs.first()?.as_ref());
    (!names.is_empty()).then_some(Identity::Cert { names })
}

/// Subject CN, DNS and URI SANs of a DER certificate.
pub fn cert_names(der: &[u8]) -> Vec<CertName> {
    use x509_parser::extensions::GeneralName;
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return Vec::new();
    };
    let mut out: Vec<CertName> =
        cert.subject().iter_common_name().filter_map(|cn| cn.as_str().ok().map(|n| CertName::Cn(n.into()))).collect();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for n in &san.value.general_names {
            match n {
                GeneralName::DNSName(s) => out.push(CertName::Dns((*s).to_string())),
                GeneralName::URI(s) => out.push(CertName::Uri((*s).to_string())),
                _ => {}
            }
        }
    }
    out
}

/// What a request does, for the check of its owner.
#[derive(Debug)]
pub enum Scope<'a> {
    /// Reads only.
    Read,
    /// Changes rules of this owner.
    Owner(&'a str),
    /// Changes the node beyond one owner's rules.
    NodeAdmin,
    /// Changes the node, as this owner (plugins).
    NodeAdminAs(&'a str),
}

/// The scope of each request type of the node service.
pub trait Scoped {
    fn scope(&self) -> Scope<'_>;
}

macro_rules! scoped {
    (owner: $($t:ident),*) => { $(impl Scoped for pb::$t { fn scope(&self) -> Scope<'_> { Scope::Owner(&self.owner) } })* };
    (read: $($t:ident),*) => { $(impl Scoped for pb::$t { fn scope(&self) -> Scope<'_> { Scope::Read } })* };
    (admin: $($t:ident),*) => { $(impl Scoped for pb::$t { fn scope(&self) -> Scope<'_> { Scope::NodeAdmin } })* };
    (admin_as_owner: $($t:ident),*) => {
        $(impl Scoped for pb::$t { fn scope(&self) -> Scope<'_> { Scope::NodeAdminAs(&self.owner) } })*
    };
}

scoped!(owner: CreatePairRequest, UpdatePairRequest, DeletePairRequest, BatchUpsertPairsRequest,
    BatchDeletePairsRequest, CreateCaptureRuleRequest, UpdateCaptureRuleRequest, DeleteCaptureRuleRequest,
    BatchUpsertCaptureRulesRequest, BatchDeleteCaptureRulesRequest, CreateRouteRequest, UpdateRouteRequest,
    DeleteRouteRequest, BatchUpsertRoutesRequest, BatchDeleteRoutesRequest, SyncOwnerRequest, RenewLeaseRequest);
scoped!(read: GetPairRequest, ListPairsRequest, GetCaptureRuleRequest, ListCaptureRulesRequest, GetRouteRequest,
    ListRoutesRequest, ListAttachmentsRequest, GetStatsRequest, ListPluginsRequest, WatchRequest,
    GetNodeInfoRequest, GetLatencyRequest, WatchLatencyRequest, ListConnectionsRequest);
scoped!(admin: AttachInterfaceRequest, DetachInterfaceRequest);
// The latency monitor is node-wide: whoever switches it switches it for every rule's owner.
scoped!(admin_as_owner: LoadPluginRequest, UnloadPluginRequest, UpdatePluginConfigRequest, SetLatencyRequest);

/// PERMISSION_DENIED unless the caller's rights cover what `req` does.
#[allow(clippy::result_large_err)]
pub fn authorize<T: Scoped>(req: &Request<T>) -> Result<(), Status> {
    let rights = req
        .extensions()
        .get::<Rights>()
        .ok_or_else(|| Status::unauthenticated("no caller identity reached the node service"))?;
    let who = || req.extensions().get::<Identity>().map_or_else(|| "the caller".to_string(), |i| i.to_string());
    match req.get_ref().scope() {
        Scope::Read => Ok(()),
        // An empty owner is refused by the request's own validation.
        Scope::Owner(o) if o.is_empty() || rights.owners.allows(o) => Ok(()),
        Scope::Owner(o) => Err(Status::permission_denied(format!("{} may not act as owner {o:?}", who()))),
        Scope::NodeAdminAs(o) if !o.is_empty() && !rights.owners.allows(o) => {
            Err(Status::permission_denied(format!("{} may not act as owner {o:?}", who())))
        }
        Scope::NodeAdmin | Scope::NodeAdminAs(_) if rights.node_admin => Ok(()),
        Scope::NodeAdmin | Scope::NodeAdminAs(_) => Err(Status::permission_denied(format!(
            "{} may not change the node (plugins, attachments): its grant has no node_admin",
            who()
        ))),
    }
}

/// The Unix peer of a connection, as its credentials said at accept
/// (`None`: the kernel gave none).
#[derive(Debug, Clone)]
pub struct UnixPeer(pub Option<Identity>);

/// An accepted Unix connection that carries its peer's identity.
#[derive(Debug)]
pub struct PeerStream {
    stream: UnixStream,
    peer: UnixPeer,
}

impl PeerStream {
    pub fn new(stream: UnixStream) -> Self {
        let peer = UnixPeer(peer_identity(&stream).ok());
        Self { stream, peer }
    }
}

fn peer_identity(s: &UnixStream) -> io::Result<Identity> {
    let cred = s.peer_cred()?;
    Ok(Identity::Unix { uid: cred.uid(), gid: cred.gid(), groups: peer_groups(s)? })
}

/// The peer's supplementary groups as of its connect (SO_PEERGROUPS).
fn peer_groups(s: &UnixStream) -> io::Result<Vec<u32>> {
    let mut groups = vec![0 as libc::gid_t; 64];
    loop {
        let mut len = (groups.len() * size_of::<libc::gid_t>()) as libc::socklen_t;
        // SAFETY: a valid socket fd and a buffer of `len` bytes.
        let rc = unsafe {
            libc::getsockopt(s.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERGROUPS, groups.as_mut_ptr().cast(), &mut len)
        };
        let n = len as usize / size_of::<libc::gid_t>();
        if rc == 0 {
            groups.truncate(n);
            return Ok(groups);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ERANGE) && n > groups.len() {
            groups.resize(n, 0);
            continue;
        }
        return Err(e);
    }
}

impl Connected for PeerStream {
    type ConnectInfo = UnixPeer;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.peer.clone()
    }
}

impl AsyncRead for PeerStream {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for PeerStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_patterns() {
        let p = OwnerPatterns(vec!["istio".into(), "team-a-*".into()]);
        assert!(p.allows("istio") && p.allows("team-a-x") && p.allows("team-a-"));
        assert!(!p.allows("istio2") && !p.allows("team-b") && !p.allows(""));
        assert!(OwnerPatterns::any().allows("anything"));
        assert!(!OwnerPatterns::default().allows("x"));
    }

    #[test]
    fn grants_add_up_and_nobody_else_gets_in() {
        let a = Access {
            me: 4242,
            grants: vec![
                Grant { who: Principal::Gid(100), owners: OwnerPatterns(vec!["a".into()]), node_admin: false },
                Grant { who: Principal::Uid(1000), owners: OwnerPatterns(vec!["b".into()]), node_admin: true },
                Grant {
                    who: Principal::Cert(CertName::Dns("ctl".into())),
                    owners: OwnerPatterns(vec!["c".into()]),
                    node_admin: false,
                },
            ],
        };
        let unix = |uid, gid, groups: &[u32]| Identity::Unix { uid, gid, groups: groups.to_vec() };
        assert_eq!(a.rights(&unix(0, 0, &[])), Some(Rights::all()));
        assert_eq!(a.rights(&unix(4242, 7, &[])), Some(Rights::all()), "the daemon's own user");
        assert_eq!(a.rights(&unix(5, 5, &[])), None);
        let r = a.rights(&unix(1000, 5, &[100])).unwrap();
        assert!(r.owners.allows("a") && r.owners.allows("b") && !r.owners.allows("c") && r.node_admin);
        let r = a.rights(&unix(7, 100, &[])).unwrap();
        assert!(r.owners.allows("a") && !r.node_admin, "primary group");
        let r = a
            .rights(&Identity::Cert { names: vec![CertName::Cn("other".into()), CertName::Dns("ctl".into())] })
            .unwrap();
        assert!(r.owners.allows("c") && !r.owners.allows("a"));
        assert_eq!(a.rights(&Identity::Cert { names: vec![CertName::Dns("rogue".into())] }), None);
        // The same name in another field is another name.
        assert_eq!(a.rights(&Identity::Cert { names: vec![CertName::Cn("ctl".into())] }), None);
        assert_eq!(a.rights(&Identity::Cert { names: vec![CertName::Uri("ctl".into())] }), None);
        assert_eq!("uri:spiffe://c/ns/a/sa/b".parse(), Ok(CertName::Uri("spiffe://c/ns/a/sa/b".into())));
        assert!("ctl".parse::<CertName>().unwrap_err().contains("cn:NAME, dns:NAME or uri:NAME"));
        assert!("dns:".parse::<CertName>().is_err());
    }
}
