//! Interface lookups over rtnetlink (netlink-packet-route), in the current
//! network namespace or in one given by path: names to ifindexes, MAC
//! addresses and link kinds (is it a veth?).

use std::fmt;
use std::path::Path;

use futures::TryStreamExt;
use netlink_packet_route::link::{InfoKind, LinkAttribute, LinkInfo, LinkMessage};

use crate::error::IoError;

/// An interface, by name or by index (in the namespace it is looked up in).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum IfaceRef {
    Name(String),
    Index(u32),
}

impl fmt::Display for IfaceRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Name(n) => write!(f, "{n}"),
            Self::Index(i) => write!(f, "ifindex {i}"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    #[error("no interface {0}")]
    NoSuchInterface(String),
    #[error("netlink: {0}")]
    Netlink(#[from] rtnetlink::Error),
    #[error(transparent)]
    Io(#[from] crate::error::IoError),
    #[error(transparent)]
    Sys(#[from] crate::sys::SysError),
}

/// An interface as netlink reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    pub name: String,
    pub mac: Option<[u8; 6]>,
    /// `veth`, `vxlan`, `bridge`, ...
    pub kind: Option<String>,
}

impl Link {
    pub fn is_veth(&self) -> bool {
        self.kind.as_deref() == Some("veth")
    }
}

fn to_link(m: &LinkMessage) -> Link {
    let mut l = Link { index: m.header.index, name: String::new(), mac: None, kind: None };
    for a in &m.attributes {
        match a {
            LinkAttribute::IfName(n) => l.name = n.clone(),
            LinkAttribute::Address(b) if b.len() == 6 => {
                let mut mac = [0u8; 6];
                mac.copy_from_slice(b);
                l.mac = Some(mac);
            }
            LinkAttribute::LinkInfo(infos) => {
                for i in infos {
                    if let LinkInfo::Kind(k) = i {
                        l.kind = Some(match k {
                            InfoKind::Veth => "veth".to_string(),
                            InfoKind::Vxlan => "vxlan".to_string(),
                            InfoKind::Bridge => "bridge".to_string(),
                            other => format!("{other:?}").to_lowercase(),
                        });
                    }
                }
            }
            _ => {}
        }
    }
    l
}

/// Runs `f` with an rtnetlink handle on a thread inside `netns` (or the
/// caller's namespace), on a runtime of its own.
pub fn in_netns<T: Send>(
    netns: Option<&Path>,
    f: impl AsyncFnOnce(rtnetlink::Handle) -> Result<T, NetlinkError> + Send,
) -> Result<T, NetlinkError> {
    crate::sys::run_in_netns(netns, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .map_err(|source| NetlinkError::Io(IoError::new("netlink runtime", source)))?;
        rt.block_on(async {
            let (conn, handle, _) = rtnetlink::new_connection()
                .map_err(|source| NetlinkError::Io(IoError::new("netlink socket", source)))?;
            let task = tokio::spawn(conn);
            let r = f(handle).await;
            task.abort();
            r
        })
    })?
}

/// Every interface in the namespace.
pub async fn links(h: &rtnetlink::Handle) -> Result<Vec<Link>, NetlinkError> {
    let msgs: Vec<LinkMessage> = h.link().get().execute().try_collect().await?;
    Ok(msgs.iter().map(to_link).collect())
}

/// One interface by name or index.
pub async fn link(h: &rtnetlink::Handle, iface: &IfaceRef) -> Result<Link, NetlinkError> {
    let all = links(h).await?;
    let found = match iface {
        IfaceRef::Name(n) => all.into_iter().find(|l| &l.name == n),
        IfaceRef::Index(i) => all.into_iter().find(|l| l.index == *i),
    };
    found.ok_or_else(|| NetlinkError::NoSuchInterface(iface.to_string()))
}
