//! Errors of the netlink layer. Each says what failed and on which interface or
//! namespace, and whether the caller (bad input) or the kernel refused.

use std::io;

/// An error from [`crate::net`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NetError {
    /// Caller error: an interface or namespace name the kernel would refuse.
    #[error("invalid name {name:?}: {reason}")]
    InvalidName { name: String, reason: &'static str },

    /// Caller error: a spec that cannot be realized as given.
    #[error("invalid spec: {0}")]
    InvalidSpec(String),

    /// A link the operation needs (an underlay, a bridge to enslave to) is absent.
    #[error("interface {link} not found")]
    LinkNotFound { link: String },

    /// A link with our name exists but is of another kind; it may belong to someone
    /// else, so we refuse to delete it.
    #[error("interface {link} is a {found}, expected a {expected}")]
    WrongKind {
        link: String,
        expected: &'static str,
        found: String,
    },

    /// The kernel refused a netlink request.
    #[error("netlink {op} on {link} failed: {source}")]
    Netlink {
        op: &'static str,
        link: String,
        #[source]
        source: rtnetlink::Error,
    },

    /// The kernel answered with something we could not interpret.
    #[error("unexpected netlink answer for {op} on {link}: {detail}")]
    Unexpected {
        op: &'static str,
        link: String,
        detail: String,
    },

    /// A netlink socket could not be opened.
    #[error("cannot open a netlink socket in netns {netns}: {source}")]
    Connect {
        netns: String,
        #[source]
        source: io::Error,
    },

    /// Caller error: the API needs a tokio runtime and was called outside one.
    #[error("netlink operations need a tokio runtime")]
    NoRuntime,

    /// A named network namespace does not exist.
    #[error("network namespace {netns} does not exist")]
    NetnsNotFound { netns: String },

    /// A namespace operation (create, mount, setns, ...) failed.
    #[error("network namespace {netns}: {op} failed: {source}")]
    Netns {
        netns: String,
        op: &'static str,
        #[source]
        source: io::Error,
    },
}

impl NetError {
    pub(crate) fn netns(netns: &str, op: &'static str, source: impl Into<io::Error>) -> Self {
        NetError::Netns {
            netns: netns.to_owned(),
            op,
            source: source.into(),
        }
    }
}
