//! Otherix API: the JSON types every `/v1/` endpoint speaks, a typed HTTPS
//! client for the control plane that pins the cluster CA, and the client
//! side of both tunnels (gateway `connect`, WebSocket `relay_tunnel`).

pub mod agent;
pub mod client;
pub mod connect;
pub mod live;
pub mod relay;
pub mod relay_tunnel;
pub mod response_head;
pub mod tls;
pub mod types;

pub use client::{AuditQuery, Client, ClientError};
pub use types::*;
