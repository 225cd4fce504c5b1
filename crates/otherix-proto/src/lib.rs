//! The Otherix wire protocol, and nothing else: the JSON types every `/v1/`
//! endpoint speaks (`api`, re-exported at the top), the agent protocol
//! (`agent`: enrollment, heartbeat, desired state) and the relay's line
//! protocol between the control plane and an agent (`relay`). Types, and
//! the hashes both ends compute of a desired state (`digest`); serde, with
//! utoipa schemas for the OpenAPI document. The client is
//! `otherix-client`, the server `otherix-server`.

#[macro_use]
pub mod enums;
pub mod agent;
pub mod api;
pub mod delta;
pub mod digest;
pub mod relay;
pub mod resume;

pub use api::*;
pub use enums::UnknownWord;
