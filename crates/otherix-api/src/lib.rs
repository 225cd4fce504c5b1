//! Otherix API: the JSON types every `/v1/` endpoint speaks, and a typed HTTPS
//! client for the control plane that pins the cluster CA.

pub mod agent;
pub mod client;
pub mod connect;
pub mod relay;
pub mod tls;
pub mod types;

pub use client::{Client, ClientError};
pub use types::*;
