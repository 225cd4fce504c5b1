//! Otherix ingress: the two servers through which bytes reach guests, side
//! by side, and what they share.
//!
//! - [`gateway`] (DESIGN §5, §6): accepts TLS, reads the `GET /v1/connect`
//!   upgrade request, verifies the credential offline, enforces single use,
//!   checks that the credential's IP still belongs to its MAC on the
//!   overlay, dials the guest from this node's overlay address and splices.
//!   Where the bytes go comes only from the verified credential. The agent
//!   runs it when its node has the gateway role: it implements [`Overlay`]
//!   with netlink, replaces the keys with [`Gateway::set_keys`] after each
//!   heartbeat, sets the cluster id with [`Gateway::set_issuer`] once it
//!   knows it, and reports [`Gateway::sessions`] back.
//! - [`relay`] (DESIGN §6): the relay endpoint the agent runs while its node
//!   has one granted. Only the control plane may call it (mutual TLS); it
//!   dials the guest a `RELAY <vm_id> <port>` line names, by VM id, among
//!   the guests on this node's bridges ([`relay::targets`]).
//!
//! Shared by both, at the top: `config` (the [`Limits`] of a connection,
//! [`ConfigError`]), [`listener`] (the accept loop, the connection limit,
//! and the [`listener::Rebinding`] the agent rebinds them with after every
//! heartbeat attempt), `dial` (from one of this node's addresses), `splice`
//! with `read_ahead` and `spare` (its buffers), [`tls`] (serving
//! certificates: PEM to a certified key, the [`tls::CertSlot`] renewal swaps
//! them in), and [`live`]: the open sessions (what revocations end, what the
//! per-principal limit counts), which the control plane's relay uses too.

mod config;
mod dial;
pub mod gateway;
pub mod listener;
mod read_ahead;
pub mod relay;
mod spare;
mod splice;
pub mod tls;

pub mod live;

pub use config::{
    ConfigError, Limits, DEFAULT_GUEST_RTO_MIN, DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_SOURCE, DEFAULT_MAX_SESSION,
};
pub use gateway::{
    credential_status, Counters, DialSource, Fault, Gateway, GatewayConfig, GatewayError, Overlay, Refused,
    REFUSAL_CODES,
};
/// The gateway's TLS configurations (the relay's is [`relay::server_config`]).
pub use tls::{server_config, server_config_with_resolver};
