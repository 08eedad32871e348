//! Typed rules a controller registers: [`Endpoint`], [`EndpointPair`] (mirror
//! pairing) and [`CaptureRule`] (capture pairing), with their validation.

use std::fmt;
use std::net::{IpAddr, SocketAddr};

/// Why a rule was refused. Each names the field at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValidationError {
    #[error("{field}: port 0 is not allowed, a port is required")]
    PortZero { field: &'static str },
    #[error("{field}: {addr} is unspecified; name a concrete address")]
    Unspecified { field: &'static str, addr: IpAddr },
    #[error("{field}: {addr} is a multicast address; only unicast endpoints can be paired")]
    Multicast { field: &'static str, addr: IpAddr },
    #[error("{field}: {addr} is a broadcast address")]
    Broadcast { field: &'static str, addr: IpAddr },
    #[error("mixed address families: {a} ({a_field}) and {b} ({b_field}); one rule is all IPv4 or all IPv6")]
    MixedFamilies { a_field: &'static str, a: IpAddr, b_field: &'static str, b: IpAddr },
    #[error("{field}: IPv4-mapped IPv6 address {addr}; give the plain IPv4 address")]
    V4Mapped { field: &'static str, addr: IpAddr },
    #[error("mode: {0:?} is not a fast-path mode; use adaptive, always or never")]
    Mode(String),
}

fn check_unicast(field: &'static str, addr: IpAddr) -> Result<(), ValidationError> {
    if addr.is_unspecified() {
        return Err(ValidationError::Unspecified { field, addr });
    }
    if addr.is_multicast() {
        return Err(ValidationError::Multicast { field, addr });
    }
    match addr {
        IpAddr::V4(v4) if v4.is_broadcast() => Err(ValidationError::Broadcast { field, addr }),
        // The data path reports v4-mapped sockets as IPv4; a mapped rule would never match.
        IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some() => Err(ValidationError::V4Mapped { field, addr }),
        _ => Ok(()),
    }
}

fn check_same_family(
    a_field: &'static str,
    a: IpAddr,
    b_field: &'static str,
    b: IpAddr,
) -> Result<(), ValidationError> {
    if a.is_ipv4() != b.is_ipv4() {
        return Err(ValidationError::MixedFamilies { a_field, a, b_field, b });
    }
    Ok(())
}

/// A unicast address and a non-zero port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Endpoint {
    pub addr: IpAddr,
    pub port: u16,
}

impl Endpoint {
    /// An endpoint; validated where it is used, see [`Endpoint::validate`].
    pub const fn new(addr: IpAddr, port: u16) -> Self {
        Self { addr, port }
    }

    /// Checks the endpoint, naming `field` in the error.
    pub fn validate(&self, field: &'static str) -> Result<(), ValidationError> {
        check_unicast(field, self.addr)?;
        if self.port == 0 {
            return Err(ValidationError::PortZero { field });
        }
        Ok(())
    }
}

impl From<SocketAddr> for Endpoint {
    fn from(sa: SocketAddr) -> Self {
        Self::new(sa.ip(), sa.port())
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        SocketAddr::new(self.addr, self.port).fmt(f)
    }
}

/// Ends of a connection that must never be given redirected bytes. A
/// controller declares it for a reader it knows the fast path cannot serve
/// (e.g. a proxy configured to splice on a kernel whose splice cannot see
/// redirected bytes); what that end sends is still accelerated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct NeverRedirectInto {
    /// The end that connected (capture: the application).
    pub client: bool,
    /// The end that accepted (capture: the proxy's accepted socket).
    pub server: bool,
}

impl NeverRedirectInto {
    pub const NONE: Self = Self { client: false, server: false };
}

impl fmt::Display for NeverRedirectInto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.client, self.server) {
            (false, false) => Ok(()),
            (true, false) => write!(f, " (never redirect into the client)"),
            (false, true) => write!(f, " (never redirect into the server)"),
            (true, true) => write!(f, " (never redirect into either end)"),
        }
    }
}

/// How a rule's connections use the fast path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum FastPathMode {
    /// Per connection and direction, in the kernel: a direction that streams
    /// writes TCP would coalesce (Nagle or cork; small ones, or up to 32 KiB
    /// into a reader that keeps up), or small nodelay
    /// writes its reader falls behind on, moves to TCP, and comes back when a
    /// new exchange starts and the peer read every TCP byte.
    #[default]
    Adaptive,
    /// Every message the reader guard allows is redirected.
    Always,
    /// Covered, but every connection stays on the TCP path.
    Never,
}

impl FastPathMode {
    pub const ALL: [Self; 3] = [Self::Adaptive, Self::Always, Self::Never];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Adaptive => "adaptive",
            Self::Always => "always",
            Self::Never => "never",
        }
    }
}

impl fmt::Display for FastPathMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for FastPathMode {
    type Err = ValidationError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.into_iter().find(|m| m.as_str() == s).ok_or_else(|| ValidationError::Mode(s.to_owned()))
    }
}

/// What every socket rule says besides the connections it covers: which ends
/// never receive redirected bytes, and the fast-path mode. One definition of
/// these accessors for both rule kinds.
macro_rules! fast_path_options {
    ($rule:ty) => {
        impl $rule {
            /// The same rule with ends that must never receive redirected bytes.
            pub fn never_redirect_into(self, never_into: NeverRedirectInto) -> Self {
                Self { never_into, ..self }
            }

            pub fn never_into(&self) -> NeverRedirectInto {
                self.never_into
            }

            /// The same rule with another fast-path mode.
            pub fn with_mode(self, mode: FastPathMode) -> Self {
                Self { mode, ..self }
            }

            pub fn mode(&self) -> FastPathMode {
                self.mode
            }
        }
    };
}

fast_path_options!(EndpointPair);
fast_path_options!(CaptureRule);

/// Mirror pairing: every TCP connection from `client` (any source port) to
/// `server` is accelerated at both ends, on one node. The peer of the socket
/// (L -> R) is the socket (R -> L).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointPair {
    client: IpAddr,
    server: Endpoint,
    never_into: NeverRedirectInto,
    mode: FastPathMode,
}

impl EndpointPair {
    /// A validated pair.
    pub fn new(client: IpAddr, server: Endpoint) -> Result<Self, ValidationError> {
        check_unicast("client", client)?;
        server.validate("server")?;
        check_same_family("client", client, "server", server.addr)?;
        Ok(Self { client, server, never_into: NeverRedirectInto::NONE, mode: FastPathMode::Adaptive })
    }

    pub fn client(&self) -> IpAddr {
        self.client
    }

    pub fn server(&self) -> Endpoint {
        self.server
    }

    /// Two pairs with the same key cover the same connections.
    pub fn key(&self) -> (IpAddr, Endpoint) {
        (self.client, self.server)
    }
}

impl fmt::Display for EndpointPair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} -> {}{}", self.client, self.server, self.never_into)?;
        mode_suffix(self.mode, f)
    }
}

/// Capture pairing: connections from `client` (`None`: any client) to
/// `original_dst` are captured by iptables (REDIRECT/TPROXY) to a proxy
/// accepting on `listener`; the origin socket and the socket the listener
/// accepted are paired by the client endpoint (client_ip:ephemeral_port), as in
/// Istio's 15001 (outbound) and 15006 (inbound) listeners.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CaptureRule {
    client: Option<IpAddr>,
    original_dst: Endpoint,
    listener: Endpoint,
    never_into: NeverRedirectInto,
    mode: FastPathMode,
}

impl CaptureRule {
    /// A validated capture rule.
    pub fn new(client: Option<IpAddr>, original_dst: Endpoint, listener: Endpoint) -> Result<Self, ValidationError> {
        original_dst.validate("original_dst")?;
        listener.validate("listener")?;
        check_same_family("original_dst", original_dst.addr, "listener", listener.addr)?;
        if let Some(c) = client {
            check_unicast("client", c)?;
            check_same_family("client", c, "original_dst", original_dst.addr)?;
        }
        Ok(Self { client, original_dst, listener, never_into: NeverRedirectInto::NONE, mode: FastPathMode::Adaptive })
    }

    pub fn client(&self) -> Option<IpAddr> {
        self.client
    }

    pub fn original_dst(&self) -> Endpoint {
        self.original_dst
    }

    pub fn listener(&self) -> Endpoint {
        self.listener
    }

    /// Two rules with the same key cover the same connections.
    pub fn key(&self) -> (Option<IpAddr>, Endpoint) {
        (self.client, self.original_dst)
    }
}

impl fmt::Display for CaptureRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.client {
            Some(c) => write!(f, "{c} -> {} captured at {}", self.original_dst, self.listener)?,
            None => write!(f, "* -> {} captured at {}", self.original_dst, self.listener)?,
        }
        self.never_into.fmt(f)?;
        mode_suffix(self.mode, f)
    }
}

fn mode_suffix(mode: FastPathMode, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    match mode {
        FastPathMode::Adaptive => Ok(()),
        m => write!(f, " (mode {m})"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn valid_pairs_both_families() {
        EndpointPair::new(ip("198.18.0.2"), Endpoint::new(ip("198.18.0.3"), 80)).unwrap();
        EndpointPair::new(ip("2001:db8::2"), Endpoint::new(ip("2001:db8::3"), 80)).unwrap();
        EndpointPair::new(ip("127.0.0.6"), Endpoint::new(ip("198.18.0.3"), 8080)).unwrap();
    }

    #[test]
    fn refuses_port_zero() {
        let e = EndpointPair::new(ip("198.18.0.2"), Endpoint::new(ip("198.18.0.3"), 0)).unwrap_err();
        assert_eq!(e, ValidationError::PortZero { field: "server" });
        let e =
            CaptureRule::new(None, Endpoint::new(ip("198.19.0.1"), 80), Endpoint::new(ip("127.0.0.1"), 0)).unwrap_err();
        assert_eq!(e, ValidationError::PortZero { field: "listener" });
    }

    #[test]
    fn refuses_mixed_families() {
        let e = EndpointPair::new(ip("198.18.0.2"), Endpoint::new(ip("2001:db8::3"), 80)).unwrap_err();
        assert!(matches!(e, ValidationError::MixedFamilies { .. }), "{e}");
        let e = CaptureRule::new(
            Some(ip("2001:db8::2")),
            Endpoint::new(ip("198.19.0.1"), 80),
            Endpoint::new(ip("127.0.0.1"), 15001),
        )
        .unwrap_err();
        assert!(matches!(e, ValidationError::MixedFamilies { .. }), "{e}");
    }

    #[test]
    fn refuses_unspecified_multicast_broadcast_mapped() {
        for (bad, want) in [
            ("0.0.0.0", "unspecified"),
            ("::", "unspecified"),
            ("224.0.0.1", "multicast"),
            ("ff02::1", "multicast"),
            ("255.255.255.255", "broadcast"),
            ("::ffff:198.18.0.1", "IPv4-mapped"),
        ] {
            let server = if ip(bad).is_ipv4() { ip("198.18.0.3") } else { ip("2001:db8::3") };
            let e = EndpointPair::new(ip(bad), Endpoint::new(server, 80)).unwrap_err();
            assert!(e.to_string().contains(want), "{bad}: {e}");
            let e = EndpointPair::new(server, Endpoint::new(ip(bad), 80)).unwrap_err();
            assert!(e.to_string().contains("server"), "{bad}: {e}");
        }
    }
}
