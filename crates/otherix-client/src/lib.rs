//! The Otherix client: a typed HTTPS client for the control plane's API
//! that pins the cluster CA ([`Client`]), and the client side of both
//! tunnels ([`tunnel`]: the gateway's and the relay's, over one HTTP/1
//! upgrade). The types it speaks are `otherix-proto`'s.

pub mod client;
pub mod tunnel;

pub use client::{AuditQuery, Client, ClientError, Endpoint};
