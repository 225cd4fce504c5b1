//! Why a connection is refused, and the one place a refusal becomes an HTTP
//! response: a plain status, `Content-Type: text/plain`, `Connection: close`
//! and a one-line body, sent before any byte reaches a guest.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::Duration;

use otherix_core::connect::{Part, RequestError};
use otherix_core::credential::{Kind, Refusal};

/// Whose fault a refusal is, so logs and clients can tell what may help.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The client sent a bad request or a credential that cannot be used.
    Client,
    /// The guest named by the credential cannot be reached.
    Target,
    /// This gateway cannot serve right now (limits, overlay not ready).
    Gateway,
}

/// A refused connection. Each variant has a stable [`code`](Refused::code)
/// that logs and the refusal counters use.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Refused {
    /// The request head is not a valid connect request.
    #[error(transparent)]
    Request(#[from] RequestError),
    /// The request head did not arrive in time.
    #[error("request head not received within {0:?}")]
    HeadTimeout(Duration),
    /// The credential failed verification or was used before.
    #[error(transparent)]
    Credential(#[from] Refusal),
    /// The (validly signed) credential does not name an IPv4 target and MAC.
    #[error("credential does not name a gateway target: {0}")]
    BadTarget(&'static str),
    /// The overlay's neighbor entry for the IP holds another MAC: the
    /// credential is stale and the IP now belongs to another guest.
    #[error("target changed: {ip} is no longer {mac}")]
    TargetChanged {
        /// The credential's IP.
        ip: Ipv4Addr,
        /// The credential's MAC.
        mac: String,
    },
    /// The overlay has no neighbor entry for the IP: the guest is gone.
    #[error("target changed: {ip} has no neighbor entry on network {network}")]
    NoNeighbor {
        /// The credential's IP.
        ip: Ipv4Addr,
        /// The credential's network.
        network: String,
    },
    /// This node has no address on the credential's network (not a member yet).
    #[error("this gateway is not on network {network}; retry shortly")]
    NotOnNetwork {
        /// The credential's network.
        network: String,
    },
    /// Reading the neighbor table failed.
    #[error("cannot read the neighbor table of network {network}")]
    NeighborLookup {
        /// The credential's network.
        network: String,
    },
    /// Connecting to the guest failed.
    #[error("cannot connect to {vm} at {addr}: {reason}")]
    DialFailed {
        /// The credential's VM name.
        vm: String,
        /// The address dialed.
        addr: SocketAddrV4,
        /// The OS's reason.
        reason: String,
    },
    /// Connecting to the guest took too long.
    #[error("no answer from {vm} at {addr} within {timeout:?}")]
    DialTimeout {
        /// The credential's VM name.
        vm: String,
        /// The address dialed.
        addr: SocketAddrV4,
        /// The dial timeout in force.
        timeout: Duration,
    },
    /// The gateway is at its connection limit.
    #[error("gateway is at its connection limit; retry shortly")]
    TooManyConnections,
    /// The used credential could not be recorded in the replay file; the
    /// gateway fails closed rather than open a replay window.
    #[error("cannot record the credential as used; retry shortly")]
    ReplayLog,
    /// The principal has its share of this gateway's sessions open.
    #[error("{principal} has {limit} sessions open through this gateway, its most; close some and retry")]
    PrincipalSessions {
        /// The credential's `sub`.
        principal: String,
        /// The per-principal session limit in force.
        limit: usize,
    },
}

/// Every code [`Refused::code`] returns, in the order metrics list them.
pub const REFUSAL_CODES: &[&str] = &[
    // The request head.
    "head_too_large",
    "bad_request_line",
    "not_get",
    "wrong_path",
    "wrong_version",
    "invalid_header",
    "missing_upgrade",
    "missing_connection_upgrade",
    "missing_authorization",
    "malformed_authorization",
    "duplicate_authorization",
    "head_timeout",
    // The credential.
    "malformed",
    "unknown_key",
    "key_expired",
    "bad_signature",
    "wrong_issuer",
    "wrong_audience",
    "lifetime_too_long",
    "expired",
    "not_yet_valid",
    "replayed",
    "replay_cache_full",
    "principal_replay_share",
    "revoked",
    "grant_expired",
    "bad_target",
    // The target.
    "target_changed",
    "no_neighbor",
    "not_on_network",
    "neighbor_lookup_failed",
    "dial_failed",
    "dial_timeout",
    // The gateway.
    "too_many_connections",
    "replay_log_failed",
    // The principal's share.
    "principal_session_cap",
    // A code this list does not know yet (a new core variant).
    "other",
];

impl Refused {
    /// Stable code for logs and metrics labels; one of [`REFUSAL_CODES`].
    pub fn code(&self) -> &'static str {
        match self {
            Refused::Request(e) => e.code(),
            Refused::HeadTimeout(_) => "head_timeout",
            Refused::Credential(r) => r.code(),
            Refused::BadTarget(_) => "bad_target",
            Refused::TargetChanged { .. } => "target_changed",
            Refused::NoNeighbor { .. } => "no_neighbor",
            Refused::NotOnNetwork { .. } => "not_on_network",
            Refused::NeighborLookup { .. } => "neighbor_lookup_failed",
            Refused::DialFailed { .. } => "dial_failed",
            Refused::DialTimeout { .. } => "dial_timeout",
            Refused::TooManyConnections => "too_many_connections",
            Refused::ReplayLog => "replay_log_failed",
            Refused::PrincipalSessions { .. } => "principal_session_cap",
        }
    }

    /// The HTTP status: the one place the gateway's refusals become
    /// statuses. `502` and `503` tell the client that brokering again may
    /// help; the others do not.
    pub fn status(&self) -> u16 {
        match self {
            Refused::Request(e) => match e.part() {
                Part::Size => 431,
                Part::Method => 405,
                Part::Target => 404,
                Part::Version => 505,
                Part::Credential => 401,
                _ => 400,
            },
            Refused::HeadTimeout(_) => 408,
            Refused::Credential(r) => credential_status(r),
            Refused::BadTarget(_) => 403,
            Refused::TargetChanged { .. } | Refused::NoNeighbor { .. } => 409,
            Refused::DialFailed { .. } | Refused::DialTimeout { .. } => 502,
            Refused::NotOnNetwork { .. }
            | Refused::NeighborLookup { .. }
            | Refused::TooManyConnections
            | Refused::ReplayLog => 503,
            Refused::PrincipalSessions { .. } => 429,
        }
    }

    /// Whose fault it is.
    pub fn fault(&self) -> Fault {
        match self {
            Refused::Credential(Refusal::ReplayCacheFull) => Fault::Gateway,
            Refused::Request(_)
            | Refused::HeadTimeout(_)
            | Refused::Credential(_)
            | Refused::BadTarget(_)
            | Refused::TargetChanged { .. }
            | Refused::NoNeighbor { .. }
            | Refused::PrincipalSessions { .. } => Fault::Client,
            Refused::DialFailed { .. } | Refused::DialTimeout { .. } => Fault::Target,
            Refused::NotOnNetwork { .. }
            | Refused::NeighborLookup { .. }
            | Refused::TooManyConnections
            | Refused::ReplayLog => Fault::Gateway,
        }
    }

    /// The complete HTTP response: status line, headers, one-line body.
    pub fn response(&self) -> Vec<u8> {
        let status = self.status();
        let mut body: String = self
            .to_string()
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .collect();
        body.push('\n');
        format!(
            "HTTP/1.1 {status} {}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            reason_phrase(status),
            body.len()
        )
        .into_bytes()
    }
}

/// The status a refused credential gets, at the gateway and at the
/// control plane's relay alike (DESIGN §5: 401 for a credential that proves
/// nothing, 403 for one not for here, 409 for a reuse).
pub fn credential_status(r: &Refusal) -> u16 {
    match r.kind() {
        Kind::Invalid => 401,
        Kind::NotHere => 403,
        Kind::Reused => 409,
        Kind::PrincipalShare => 429,
        _ => 503,
    }
}

fn reason_phrase(status: u16) -> &'static str {
    match status {
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        505 => "HTTP Version Not Supported",
        _ => "Error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> Vec<Refused> {
        let ip = Ipv4Addr::new(10, 100, 0, 2);
        let addr = SocketAddrV4::new(ip, 22);
        vec![
            RequestError::TooLarge { limit: 8192 }.into(),
            RequestError::BadRequestLine.into(),
            RequestError::NotGet.into(),
            RequestError::WrongPath.into(),
            RequestError::WrongVersion.into(),
            RequestError::InvalidHeader { line: 2 }.into(),
            RequestError::MissingUpgrade.into(),
            RequestError::MissingConnectionUpgrade.into(),
            RequestError::MissingAuthorization.into(),
            RequestError::MalformedAuthorization.into(),
            RequestError::DuplicateAuthorization.into(),
            Refused::HeadTimeout(Duration::from_secs(10)),
            Refusal::Malformed("x".into()).into(),
            Refusal::UnknownKey { kid: "k9".into() }.into(),
            Refusal::KeyExpired {
                kid: "k1".into(),
                not_after: "t".into(),
            }
            .into(),
            Refusal::BadSignature.into(),
            Refusal::WrongIssuer { iss: "c2".into() }.into(),
            Refusal::WrongAudience { aud: "gw2".into() }.into(),
            Refusal::LifetimeTooLong {
                lifetime_secs: 7200,
                max_secs: 900,
            }
            .into(),
            Refusal::Expired { exp: "t".into() }.into(),
            Refusal::NotYetValid { nbf: "t".into() }.into(),
            Refusal::Replayed.into(),
            Refusal::ReplayCacheFull.into(),
            Refusal::Revoked.into(),
            Refusal::GrantExpired { until: "t".into() }.into(),
            Refused::BadTarget("no MAC"),
            Refused::TargetChanged {
                ip,
                mac: "02:00:00:00:00:01".into(),
            },
            Refused::NoNeighbor {
                ip,
                network: "ov".into(),
            },
            Refused::NotOnNetwork { network: "ov".into() },
            Refused::NeighborLookup { network: "ov".into() },
            Refused::DialFailed {
                vm: "web01".into(),
                addr,
                reason: "Connection refused\n(os error 111)".into(),
            },
            Refused::DialTimeout {
                vm: "web01".into(),
                addr,
                timeout: Duration::from_secs(5),
            },
            Refused::TooManyConnections,
            Refused::ReplayLog,
            Refused::PrincipalSessions {
                principal: "grant:acme".into(),
                limit: 500,
            },
            Refusal::ReplayShareFull { limit: 5_000 }.into(),
        ]
    }

    #[test]
    fn every_refusal_has_a_listed_code_of_its_own() {
        let all = samples();
        let codes: std::collections::BTreeSet<_> = all.iter().map(Refused::code).collect();
        assert_eq!(codes.len(), all.len());
        for code in &codes {
            assert!(REFUSAL_CODES.contains(code), "{code} is not listed");
        }
        assert_eq!(
            REFUSAL_CODES.len(),
            all.len() + 1,
            "every listed code is used, plus `other`"
        );
    }

    #[test]
    fn response_is_plain_http_with_a_one_line_body() {
        for r in samples() {
            let text = String::from_utf8(r.response()).unwrap();
            let (head, body) = text.split_once("\r\n\r\n").unwrap();
            assert!(head.starts_with(&format!("HTTP/1.1 {} ", r.status())), "{head}");
            assert!(head.contains("\r\nContent-Type: text/plain"), "{head}");
            assert!(head.contains("\r\nConnection: close"), "{head}");
            assert!(
                head.contains(&format!("\r\nContent-Length: {}", body.len())),
                "{head}"
            );
            assert_eq!(body.matches('\n').count(), 1, "{body:?}");
            assert!(body.ends_with('\n'));
        }
    }

    #[test]
    fn stale_mac_reads_target_changed() {
        let r = Refused::TargetChanged {
            ip: Ipv4Addr::new(10, 100, 0, 2),
            mac: "02:00:00:00:00:01".into(),
        };
        assert_eq!(r.status(), 409);
        assert_eq!(
            r.to_string(),
            "target changed: 10.100.0.2 is no longer 02:00:00:00:00:01"
        );
    }
}
