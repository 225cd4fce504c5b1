//! What the gateway needs from the node's overlays, as a trait: the agent
//! implements it with netlink, tests with a map they control.

use std::future::Future;
use std::net::Ipv4Addr;

/// The overlay side of a gateway node.
pub trait Overlay: Send + Sync + 'static {
    /// A failure to look (the agent's netlink error); the gateway logs it
    /// and refuses with `503 neighbor_lookup_failed`.
    type Error: std::error::Error + Send + 'static;

    /// The MAC the kernel's neighbor table of overlay `network` holds for
    /// `ip` (the agent reads its static neighbor entry on the overlay
    /// bridge), `Ok(None)` when there is no entry. `Err` is a failure to
    /// look (netlink), not an answer.
    fn neighbor_mac(
        &self,
        network: &str,
        ip: Ipv4Addr,
    ) -> impl Future<Output = Result<Option<[u8; 6]>, Self::Error>> + Send;

    /// Where dials to guests of overlay `network` leave from: this node's
    /// own address on it and the overlay's device; `None` when this node is
    /// not (yet) a member.
    fn dial_source(&self, network: &str) -> Option<DialSource>;
}

/// Where a dial to a guest leaves from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DialSource {
    /// This node's own address on the overlay: the dial's source address.
    pub address: Ipv4Addr,
    /// The overlay's device (the agent's `oxb{vni}` bridge): the dial is
    /// bound to it (`SO_BINDTODEVICE`), so no route through another
    /// interface can take it elsewhere.
    pub device: String,
}
