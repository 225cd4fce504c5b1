//! Otherix node agent: the Linux networking layer, the guest runtime, and the daemon.
//!
//! - [`net`] speaks rtnetlink to build what DESIGN.md §3 describes: Linux bridges,
//!   VXLAN devices with a statically programmed FDB (no flood-and-learn), permanent
//!   neighbor entries, and named network namespaces. Every operation is idempotent and
//!   reports what it changed, so the agent's sync loop can run it level-triggered.
//! - [`runtime`] realizes guests. Its first implementation, `netns`, makes a guest a
//!   network namespace with a veth whose host end sits on the network's bridge, and
//!   runs the guest's workload inside it under a restart-with-backoff [`runtime::Supervisor`].
//! - [`filter`] is the node's packet filter, one nftables table the agent owns
//!   like its links: VXLAN only from the cluster's VTEPs, guests kept from the
//!   node's own services and from other networks' guests.
//! - [`daemon`] is `otherix agent`: it enrolls the node, heartbeats to the control plane
//!   over mutual TLS, and reconciles networks, guests and workloads to the desired state.
//!
//! All of it needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) at run time, and the
//! filter the `nft` tool (Debian package `nftables`).

pub mod daemon;
pub mod filter;
pub mod net;
mod program;
pub mod runtime;
