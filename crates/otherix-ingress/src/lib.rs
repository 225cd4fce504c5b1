//! The Otherix ingress gateway (DESIGN §5, §6): accepts TLS, reads the
//! `GET /v1/connect` upgrade request, verifies the credential offline,
//! enforces single use, checks that the credential's IP still belongs to its
//! MAC on the overlay, dials the guest from this node's overlay address and
//! splices raw bytes both ways.
//!
//! Where the bytes go comes only from the verified credential. The agent
//! runs the gateway when its node has the gateway role: it implements
//! [`Overlay`] with netlink, replaces the keys with [`Gateway::set_keys`]
//! after each heartbeat, sets the cluster id with [`Gateway::set_issuer`]
//! once it knows it, and reports [`Gateway::sessions`] back.
//!
//! Files, in the order a connection meets them: `gateway` (accept loop,
//! limits, shutdown), `connection` (the checks, the dial, the session),
//! `read_ahead` (large reads under TLS), `splice`, `spare` (their buffers),
//! then `refused` (the one place refusals become HTTP responses), `replay`
//! (single use across restarts), `metrics`, `config`, `overlay`, `tls`. Open
//! sessions (what revocations end, what the per-principal limit counts) are
//! kept in a [`live::Live`], which the control plane's relay uses too.

pub mod gateway;
mod read_ahead;
mod spare;
mod splice;
mod tls;

pub mod live;

pub use gateway::{
    credential_status, ConfigError, Counters, Fault, Gateway, GatewayConfig, GatewayError, Overlay, Refused,
    DEFAULT_MAX_SESSION, REFUSAL_CODES,
};
/// Also the agent's relay endpoint splices with it.
pub use splice::{splice, End as SpliceEnd, Outcome as SpliceOutcome};
pub use tls::{server_config, server_config_with_resolver};
