//! Errors that stop the agent from starting. Once running, the agent never exits on
//! an error: it logs, keeps the node on its last desired state, and retries.

use std::io;
use std::path::PathBuf;

use otherix_client::ClientError;

use super::serving::CertRequestError;
use crate::net::NetError;
use crate::runtime::RuntimeError;

/// Why the agent could not start. Variants say who must act: the operator (flags,
/// privileges, a fresh join token), the control plane (it refused), or the host.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DaemonError {
    /// Operator: the process lacks the capabilities netlink and namespaces need.
    #[error("the node agent needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to manage netlink and network namespaces")]
    NotPrivileged,

    /// Operator: a flag is missing or malformed.
    #[error("{0}")]
    Config(String),

    /// Operator: first start without a join token.
    #[error("node {node} is not enrolled yet ({dir} holds no identity) and no --join-token or --join-token-file was given\nhint: create one with `otherix node join-token create` and pass it with --join-token-file FILE (or OTHERIX_AGENT_JOIN_TOKEN)")]
    MissingJoinToken { node: String, dir: PathBuf },

    /// Operator: first start without a way to trust the cluster CA.
    #[error("first enrollment needs the cluster CA: pass --ca-fingerprint sha256:... (printed by `otherix server`) or --ca-file")]
    MissingTrust,

    /// Control plane: it refused the enrollment (bad, expired or used join token, bad CSR).
    #[error("enrollment refused by {server}: {message}")]
    EnrollRefused { server: String, message: String },

    /// The control plane could not be reached or spoke nonsense.
    #[error(transparent)]
    Client(#[from] ClientError),

    /// Host: the saved identity is unusable (incomplete, unreadable, another node's).
    #[error("node identity in {dir}: {reason}")]
    Identity { dir: PathBuf, reason: String },

    /// Host: a file operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    /// Operator or host: the gateway role cannot be built (a flag out of
    /// range, the replay file unreadable).
    #[error("gateway: {0}")]
    Gateway(#[from] otherix_ingress::GatewayError),

    /// Host: the node's key or its certificate request could not be made.
    /// (Boxed: a certificate request's own error may be a failure to save.)
    #[error(transparent)]
    Certificate(Box<CertRequestError>),

    #[error(transparent)]
    Net(#[from] NetError),

    #[error(transparent)]
    Runtime(#[from] RuntimeError),
}

impl From<CertRequestError> for DaemonError {
    fn from(e: CertRequestError) -> Self {
        DaemonError::Certificate(Box::new(e))
    }
}

impl DaemonError {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        DaemonError::Io {
            op,
            path: path.into(),
            source,
        }
    }
}

/// Error chains flattened onto one line, for logs and guest status reasons.
pub(crate) fn one_line(err: &dyn std::error::Error) -> String {
    let mut out = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out.replace('\n', " ")
}
