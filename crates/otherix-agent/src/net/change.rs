//! What a reconcile or an `ensure_*` call changed in the kernel.
//!
//! Operations return the list of changes they made instead of a bare `()`: the sync
//! loop logs them, and an empty list is the definition of "already converged".

use std::fmt;
use std::net::Ipv4Addr;

use super::{fmt_mac, FdbEntry, IfAddr, NeighborEntry};

/// One change made to the kernel's networking state.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Change {
    NetnsCreated {
        netns: String,
    },
    NetnsDeleted {
        netns: String,
    },
    LinkCreated {
        link: String,
    },
    /// Deleted and created again because an immutable property differed.
    LinkRecreated {
        link: String,
        reason: String,
    },
    /// A mutable property (`mtu`, `up`, `controller`, `mac`, `alias`) was set.
    LinkUpdated {
        link: String,
        what: &'static str,
    },
    LinkDeleted {
        link: String,
    },
    LinkMoved {
        link: String,
        to_netns: String,
    },
    AddressAdded {
        link: String,
        addr: IfAddr,
    },
    AddressRemoved {
        link: String,
        addr: IfAddr,
    },
    FdbAdded {
        link: String,
        entry: FdbEntry,
    },
    FdbRemoved {
        link: String,
        entry: FdbEntry,
    },
    NeighborSet {
        link: String,
        entry: NeighborEntry,
    },
    NeighborRemoved {
        link: String,
        entry: NeighborEntry,
    },
    DefaultRouteSet {
        link: String,
        gateway: Ipv4Addr,
    },
    /// A QEMU guest was started (its tap comes with it).
    QemuStarted {
        id: String,
        pid: i32,
    },
    /// A QEMU guest was ended (its tap went with it).
    QemuEnded {
        id: String,
        pid: i32,
    },
}

impl fmt::Display for Change {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Change::NetnsCreated { netns } => write!(f, "created netns {netns}"),
            Change::NetnsDeleted { netns } => write!(f, "deleted netns {netns}"),
            Change::LinkCreated { link } => write!(f, "created {link}"),
            Change::LinkRecreated { link, reason } => write!(f, "recreated {link} ({reason})"),
            Change::LinkUpdated { link, what } => write!(f, "set {what} on {link}"),
            Change::LinkDeleted { link } => write!(f, "deleted {link}"),
            Change::LinkMoved { link, to_netns } => write!(f, "moved {link} to netns {to_netns}"),
            Change::QemuStarted { id, pid } => write!(f, "started QEMU guest {id} (pid {pid})"),
            Change::QemuEnded { id, pid } => write!(f, "ended QEMU guest {id} (pid {pid})"),
            Change::AddressAdded { link, addr } => write!(f, "added {addr} on {link}"),
            Change::AddressRemoved { link, addr } => write!(f, "removed {addr} from {link}"),
            Change::FdbAdded { link, entry } => {
                write!(
                    f,
                    "fdb {} dst {} added on {link}",
                    fmt_mac(&entry.mac),
                    entry.vtep
                )
            }
            Change::FdbRemoved { link, entry } => {
                write!(
                    f,
                    "fdb {} dst {} removed from {link}",
                    fmt_mac(&entry.mac),
                    entry.vtep
                )
            }
            Change::NeighborSet { link, entry } => {
                write!(
                    f,
                    "neighbor {} lladdr {} set on {link}",
                    entry.ip,
                    fmt_mac(&entry.mac)
                )
            }
            Change::NeighborRemoved { link, entry } => {
                write!(
                    f,
                    "neighbor {} lladdr {} removed from {link}",
                    entry.ip,
                    fmt_mac(&entry.mac)
                )
            }
            Change::DefaultRouteSet { link, gateway } => {
                write!(f, "default route via {gateway} dev {link}")
            }
        }
    }
}
