//! IPv4 addresses on links.

use std::net::IpAddr;

use futures::TryStreamExt;
use rtnetlink::packet_route::address::{AddressAttribute, AddressMessage};
use rtnetlink::packet_route::AddressFamily;
use tracing::info;

use super::{errno, Change, IfAddr, NetError, Netlink};

impl Netlink {
    /// The IPv4 addresses on `link`.
    pub async fn addresses(&self, link: &str) -> Result<Vec<IfAddr>, NetError> {
        let index = self.require_index(link).await?;
        Ok(self
            .address_messages(link, index)
            .await?
            .into_iter()
            .map(|(a, _)| a)
            .collect())
    }

    async fn address_messages(
        &self,
        link: &str,
        index: u32,
    ) -> Result<Vec<(IfAddr, AddressMessage)>, NetError> {
        let msgs: Vec<AddressMessage> = self
            .handle
            .address()
            .get()
            .set_link_index_filter(index)
            .execute()
            .try_collect()
            .await
            .map_err(|e| self.err("dump addresses", link, e))?;
        let mut out = Vec::new();
        for msg in msgs {
            if msg.header.family != AddressFamily::Inet || msg.header.index != index {
                continue;
            }
            // For IPv4, IFA_LOCAL is the interface's own address (IFA_ADDRESS is the
            // peer on point-to-point links).
            let ip = msg.attributes.iter().find_map(|a| match a {
                AddressAttribute::Local(IpAddr::V4(ip)) => Some(*ip),
                _ => None,
            });
            if let Some(ip) = ip {
                out.push((IfAddr::new(ip, msg.header.prefix_len), msg));
            }
        }
        Ok(out)
    }

    /// Ensures `addr` is on `link`. With `exclusive`, every other IPv4 address on the
    /// link is removed (used on our own bridges, whose addresses we fully own).
    ///
    /// Extras are removed before the new address is added: removing a primary address
    /// also removes the secondaries of its subnet, which could take the new one along.
    pub async fn ensure_address(
        &self,
        link: &str,
        addr: Option<IfAddr>,
        exclusive: bool,
    ) -> Result<Vec<Change>, NetError> {
        if let Some(a) = addr {
            if a.prefix > 32 {
                return Err(NetError::InvalidSpec(format!(
                    "prefix of {a} on {link} is over 32"
                )));
            }
        }
        let index = self.require_index(link).await?;
        let current = self.address_messages(link, index).await?;
        let mut changes = Vec::new();
        let mut present = false;
        for (have, msg) in current {
            if Some(have) == addr {
                present = true;
                continue;
            }
            // Same IP with another prefix is a conflict even when not exclusive.
            let conflicting = addr.is_some_and(|a| a.ip == have.ip);
            if exclusive || conflicting {
                match self.handle.address().del(msg).execute().await {
                    Ok(()) => {}
                    Err(e) if errno(&e) == Some(nix::libc::EADDRNOTAVAIL) => {}
                    Err(e) => return Err(self.err("delete address", link, e)),
                }
                info!(link = %self.at(link), addr = %have, "removed address");
                changes.push(Change::AddressRemoved {
                    link: self.at(link),
                    addr: have,
                });
            }
        }
        if let (Some(a), false) = (addr, present) {
            match self
                .handle
                .address()
                .add(index, IpAddr::V4(a.ip), a.prefix)
                .execute()
                .await
            {
                Ok(()) => {}
                Err(e) if errno(&e) == Some(nix::libc::EEXIST) => {}
                Err(e) => return Err(self.err("add address", link, e)),
            }
            info!(link = %self.at(link), addr = %a, "added address");
            changes.push(Change::AddressAdded {
                link: self.at(link),
                addr: a,
            });
        }
        Ok(changes)
    }
}
