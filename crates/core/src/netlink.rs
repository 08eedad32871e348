//! Interface and neighbour lookups over rtnetlink (netlink-packet-route), in
//! the current network namespace or in one given by path: names to ifindexes,
//! MAC addresses, link kinds (is it a veth?) and neighbour entries.

use std::net::IpAddr;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use futures::TryStreamExt;
use netlink_packet_route::link::{InfoKind, LinkAttribute, LinkInfo, LinkMessage};
use netlink_packet_route::neighbour::{NeighbourAddress, NeighbourAttribute};
use nix::sched::{setns, CloneFlags};

#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    #[error("no interface {0}")]
    NoSuchInterface(String),
    #[error("netlink: {0}")]
    Netlink(#[from] rtnetlink::Error),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("entering netns {path}: {source}")]
    Setns { path: PathBuf, source: nix::Error },
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
    std::thread::scope(|s| {
        s.spawn(|| {
            if let Some(p) = netns {
                let file = std::fs::File::open(p)
                    .map_err(|source| NetlinkError::Io { what: format!("opening {}", p.display()), source })?;
                setns(file.as_fd(), CloneFlags::CLONE_NEWNET)
                    .map_err(|source| NetlinkError::Setns { path: p.to_path_buf(), source })?;
            }
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_io()
                .build()
                .map_err(|source| NetlinkError::Io { what: "netlink runtime".into(), source })?;
            rt.block_on(async {
                let (conn, handle, _) = rtnetlink::new_connection()
                    .map_err(|source| NetlinkError::Io { what: "netlink socket".into(), source })?;
                let task = tokio::spawn(conn);
                let r = f(handle).await;
                task.abort();
                r
            })
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

/// Every interface in the namespace.
pub async fn links(h: &rtnetlink::Handle) -> Result<Vec<Link>, NetlinkError> {
    let msgs: Vec<LinkMessage> = h.link().get().execute().try_collect().await?;
    Ok(msgs.iter().map(to_link).collect())
}

/// One interface by name or index.
pub async fn link(h: &rtnetlink::Handle, iface: &crate::tc::IfaceRef) -> Result<Link, NetlinkError> {
    let all = links(h).await?;
    let found = match iface {
        crate::tc::IfaceRef::Name(n) => all.into_iter().find(|l| &l.name == n),
        crate::tc::IfaceRef::Index(i) => all.into_iter().find(|l| l.index == *i),
    };
    found.ok_or_else(|| NetlinkError::NoSuchInterface(iface.to_string()))
}

/// The MAC the neighbour table holds for `ip` on `ifindex`, if resolved.
pub async fn neighbour_mac(h: &rtnetlink::Handle, ifindex: u32, ip: IpAddr) -> Result<Option<[u8; 6]>, NetlinkError> {
    let msgs: Vec<_> = h.neighbours().get().execute().try_collect().await?;
    for m in msgs {
        if m.header.ifindex != ifindex {
            continue;
        }
        let mut dst = None;
        let mut mac = None;
        for a in &m.attributes {
            match a {
                NeighbourAttribute::Destination(NeighbourAddress::Inet(v4)) => dst = Some(IpAddr::V4(*v4)),
                NeighbourAttribute::Destination(NeighbourAddress::Inet6(v6)) => dst = Some(IpAddr::V6(*v6)),
                NeighbourAttribute::LinkLayerAddress(b) if b.len() == 6 => {
                    let mut m6 = [0u8; 6];
                    m6.copy_from_slice(b);
                    mac = Some(m6);
                }
                _ => {}
            }
        }
        if dst == Some(ip) {
            return Ok(mac);
        }
    }
    Ok(None)
}
