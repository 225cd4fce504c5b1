//! Sans-IO core of Otherix ingress: names, labels, selectors, IPAM and MACs.
//!
//! Everything here is pure: no sockets, no clock, no randomness. Callers pass
//! in `now` and random bytes, so every rule is testable without IO.

pub mod connect;
pub mod conns;
pub mod credential;
pub mod ipam;
pub mod labels;
pub mod lb;
pub mod mac;
pub mod names;
pub mod node;
pub mod rate;
#[cfg(feature = "schema")]
mod schema;
pub mod selector;

pub use ipam::{allocate, CidrError, IpamError, Ipv4Cidr, Subnet, SubnetError};
pub use labels::{
    parse_label, parse_label_change, validate_label_key, validate_label_value, validate_labels, LabelChange,
    LabelError, Labels,
};
pub use mac::{MacAddr, MacError};
pub use names::{
    validate_name, GrantName, InvalidName, LbName, NameError, NetworkName, NodeName, UserName, VmName,
};
pub use selector::{Requirement, RequiresNoLabel, Selector, SelectorError};
