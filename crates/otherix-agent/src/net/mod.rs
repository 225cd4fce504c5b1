//! Netlink operations on bridges, VXLAN devices, addresses, FDB and neighbor tables.
//!
//! Everything goes through [`Netlink`], a cheap-to-clone rtnetlink handle. A handle is
//! bound to one network namespace for its whole life: the kernel ties a netlink socket
//! to the namespace of the thread that *created* it, whichever thread later polls it.
//! [`Netlink::connect`] uses the calling thread's namespace; [`Netlink::connect_in`]
//! creates the socket on a short-lived thread that first `setns`-es into a named
//! namespace (see [`netns`]), then hands the socket back to the caller's tokio runtime.
//! This is how the agent drives a guest's namespace without moving any of its own
//! threads, and how tests drive "node" namespaces from the root namespace.
//!
//! Operations come in two flavours:
//! - primitives (`ensure_bridge`, `add_fdb`, `neighbor_mac`, ...), each idempotent: no
//!   error when the kernel is already in the desired state;
//! - declarative entry points ([`Netlink::reconcile_overlay`],
//!   [`Netlink::reconcile_bridge_network`], [`Netlink::remove_stale`]) that converge
//!   the kernel to a spec: add what is missing, remove what is extra.
//!
//! Both return the list of [`Change`]s they made; an empty list means the kernel
//! already matched, which is what the idempotency tests pin.
//!
//! Nothing here shells out to `ip` or `bridge`: rtnetlink covers everything we need,
//! including `bridge fdb append ... self permanent` (a raw `RTM_NEWNEIGH` with
//! `NLM_F_APPEND`, built in `fdb.rs`) and single-entry neighbor lookups.

mod addr;
mod change;
mod error;
mod fdb;
pub mod forward;
mod link;
mod names;
mod neigh;
pub mod netns;
mod reconcile;
mod route;

use std::net::Ipv4Addr;

use futures::StreamExt;
use rtnetlink::packet_core::{NetlinkMessage, NetlinkPayload};
use rtnetlink::packet_route::RouteNetlinkMessage;

pub use change::Change;
pub use error::NetError;
pub use fdb::{FdbEntry, FLOOD_MAC};
pub use link::{Link, LinkWant, VxlanInfo, VxlanSpec};
pub use names::{fmt_mac, validate_ifname, IFNAME_MAX};
pub use neigh::NeighborEntry;
pub use netns::Netns;
pub use reconcile::{BridgeSpec, OverlaySpec, VXLAN_PORT};

/// An IPv4 address with its prefix length, as carried by an interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IfAddr {
    pub ip: Ipv4Addr,
    pub prefix: u8,
}

impl IfAddr {
    pub fn new(ip: Ipv4Addr, prefix: u8) -> Self {
        Self { ip, prefix }
    }
}

impl std::fmt::Display for IfAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.ip, self.prefix)
    }
}

/// An rtnetlink connection bound to one network namespace.
///
/// Cloning is cheap and shares the connection. The background task that drives the
/// socket ends by itself once the last clone is dropped.
#[derive(Clone, Debug)]
pub struct Netlink {
    handle: rtnetlink::Handle,
    /// Namespace label for error messages: `None` for "wherever the creating thread was".
    netns: Option<String>,
}

impl Netlink {
    /// Connects in the calling thread's current network namespace.
    ///
    /// Must be called from within a tokio runtime: the connection is driven by a task
    /// spawned on it.
    pub fn connect() -> Result<Self, NetError> {
        let rt = tokio::runtime::Handle::try_current().map_err(|_| NetError::NoRuntime)?;
        let (conn, handle, _) = rtnetlink::new_connection().map_err(|source| NetError::Connect {
            netns: "current".into(),
            source,
        })?;
        rt.spawn(conn);
        Ok(Self { handle, netns: None })
    }

    /// Connects inside the named namespace `ns`, without moving the calling thread.
    ///
    /// The socket is created on a helper thread that has `setns`-ed into `ns` (the
    /// socket then belongs to `ns` for good) and is registered with the caller's tokio
    /// runtime, which drives it from then on.
    pub fn connect_in(ns: &Netns) -> Result<Self, NetError> {
        let rt = tokio::runtime::Handle::try_current().map_err(|_| NetError::NoRuntime)?;
        let rt2 = rt.clone();
        let created = ns.run(move || {
            // Registering the socket with the reactor needs a runtime context; this
            // thread is not a runtime thread, so enter the caller's runtime explicitly.
            let _guard = rt2.enter();
            rtnetlink::new_connection()
        })?;
        let (conn, handle, _) = created.map_err(|source| NetError::Connect {
            netns: ns.name().to_owned(),
            source,
        })?;
        rt.spawn(conn);
        Ok(Self {
            handle,
            netns: Some(ns.name().to_owned()),
        })
    }

    /// The namespace this handle was opened in, if it was opened by name.
    pub fn netns(&self) -> Option<&str> {
        self.netns.as_deref()
    }

    /// The raw rtnetlink handle, for operations this module does not wrap.
    pub fn handle(&self) -> &rtnetlink::Handle {
        &self.handle
    }

    /// `link` qualified with the namespace, for errors and [`Change`]s.
    pub(crate) fn at(&self, link: &str) -> String {
        match &self.netns {
            Some(ns) => format!("{link} (netns {ns})"),
            None => link.to_owned(),
        }
    }

    fn err(&self, op: &'static str, link: &str, source: rtnetlink::Error) -> NetError {
        NetError::Netlink {
            op,
            link: self.at(link),
            source,
        }
    }

    /// Sends a request that the kernel only acknowledges, with explicit `flags`.
    ///
    /// rtnetlink's request builders fix their flags (`NLM_F_EXCL` or `NLM_F_REPLACE`);
    /// FDB appends need `NLM_F_APPEND`, hence this escape hatch.
    async fn ack_request(&self, msg: RouteNetlinkMessage, flags: u16) -> Result<(), rtnetlink::Error> {
        let mut req = NetlinkMessage::from(msg);
        req.header.flags = flags;
        let mut handle = self.handle.clone();
        let mut responses = handle.request(req)?;
        while let Some(resp) = responses.next().await {
            if let NetlinkPayload::Error(e) = resp.payload {
                if e.code.is_some() {
                    return Err(rtnetlink::Error::NetlinkError(e));
                }
            }
        }
        Ok(())
    }
}

/// The positive errno carried by a netlink error reply, if that is what `e` is.
pub(crate) fn errno(e: &rtnetlink::Error) -> Option<i32> {
    match e {
        rtnetlink::Error::NetlinkError(msg) => msg.code.map(|c| -c.get()),
        _ => None,
    }
}
