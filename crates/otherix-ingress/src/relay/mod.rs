//! The relay endpoint (DESIGN §6), which the agent runs while its node has
//! one granted: how the control plane reaches guests on this node's
//! host-local bridges, which no gateway shares an L2 with.
//!
//! ```text
//! CP ──TCP──▶ accept: only from a control plane's address (else closed at once,
//!             `not_control_plane`), within the caps in all and per source
//!    ──mutual TLS, within the handshake deadline──▶ the client certificate chains to the cluster CA
//!                    and names exactly `control-plane.otherix` (a node's does not)
//!    ──"RELAY <vm_id> <port>\n"──▶ vm_id → lease IP of a guest on a bridge of this
//!                    node, from the desired state (never an address from the wire)
//!    ◀──"OK\n" | "ERR <reason>\n"── dial ip:port from the bridge's address
//!    ◀══ splice, half-close both ways (TLS close_notify ⇄ TCP FIN) ══▶ guest
//!    ──"CONSOLE <vm_id>\n"──▶ vm_id → the serial console socket of a QEMU guest
//!                    running on this node (overlay or bridge), from the agent
//!    ◀──"OK\n" | "ERR <reason>\n"── connect the socket
//!    ◀══ splice ══▶ the guest's ttyS0
//! ```
//!
//! The TLS handshake must be done within [`Limits::handshake_timeout`] and
//! the request line arrive within [`Limits::request_timeout`] of the
//! TCP accept (TLS handshake included), and be at most
//! `otherix_proto::relay::MAX_LINE` bytes. The serving certificate is the
//! relay's own (serverAuth only, `NODE.relay.otherix` and the granted
//! address): the CP dials by that name and checks that it issued the
//! certificate to the VM's node and has not revoked it.
//!
//! Files: `endpoint` (accept, request, dial, session), `sources` (which
//! addresses may connect at all), `targets` (which
//! guests may be dialed, from where), `verifier` (the TLS configuration and
//! its control-plane-only client check), `request` (the line protocol).
//! The accept loop, the connection limit, the dial and the splice are the
//! ones the gateway uses.
//!
//! [`Limits::request_timeout`]: crate::Limits::request_timeout
//! [`Limits::handshake_timeout`]: crate::Limits::handshake_timeout

mod endpoint;
mod request;
mod resumable;
mod sources;
mod targets;
mod verifier;

pub use endpoint::{Consoles, Relay};
pub use sources::{ControlPlanes, SourceNet, SourceNetError};
pub use targets::{targets, Target, Targets};
pub use verifier::server_config;
