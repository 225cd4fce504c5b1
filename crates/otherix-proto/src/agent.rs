//! The agent ↔ control-plane protocol: join tokens, enrollment, heartbeat and
//! the node's desired state (DESIGN §6).
//!
//! The heartbeat is level-triggered: each answer describes the node's whole
//! desired state, with a `version` that changes whenever the content does —
//! the state itself, `unchanged`, or a change against the version the agent
//! applied ([`crate::delta`]). The agent reconciles the kernel and its
//! guests to it, idempotently.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use otherix_core::{Ipv4Cidr, MacAddr, NodeName, Subnet};

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use utoipa::ToSchema;

use crate::api::VmState;
pub use crate::delta::{DeltaError, DesiredDelta, GuestChange, OverlayChange};

/// `POST /v1/join-tokens` (admin): a token that enrolls exactly one node,
/// under this name, with these roles. A node is what the token granted,
/// never what it later asserts.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateJoinTokenRequest {
    /// The node's name (a DNS label; not `localhost`, `control-plane` or all digits).
    pub node: NodeName,
    /// Validity in seconds (default 3600).
    #[serde(default)]
    pub ttl_seconds: Option<u64>,
    #[serde(default)]
    pub hypervisor: bool,
    /// Gateway role at this advertised `IP:PORT`.
    #[serde(default)]
    pub gateway: Option<String>,
    /// Relay endpoint: `IP:PORT`, `off`, or absent for the default (a
    /// hypervisor's VTEP, port 7444).
    #[serde(default)]
    pub relay: Option<String>,
    /// The node's VTEP, when it is not the address its connections come
    /// from (NAT); absent: the source address of its mutual-TLS connection.
    #[serde(default)]
    pub vtep: Option<String>,
    /// Replace the enrolled node of this name: its certificates are revoked
    /// when the token is used.
    #[serde(default)]
    pub replace: bool,
}

/// A join token: shown once, single use, short-lived.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct JoinToken {
    pub id: String,
    pub token: String,
    /// The node it enrolls, and what that node may be.
    #[serde(default)]
    pub node: String,
    #[serde(default)]
    pub roles: NodeRoles,
    #[serde(default)]
    pub replace: bool,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub expires_at: OffsetDateTime,
}

/// `POST /v1/agent/enroll`: the agent's CSR, authorized by a join token.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EnrollRequest {
    pub join_token: String,
    /// Must be the name the token was created for.
    pub node: NodeName,
    /// PEM PKCS#10 certificate signing request for the node's own key.
    pub csr_pem: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct EnrollResponse {
    pub node: String,
    /// The node's client certificate (clientAuth only, SAN
    /// `NODE.nodes.otherix`), signed by the cluster CA.
    pub cert_pem: String,
    pub ca_pem: String,
}

/// What the node does. In a join token, `node get` and the desired state:
/// what an admin granted (`relay` there is the endpoint the CP dials). In a
/// heartbeat: what the agent was pinned to on its command line, checked
/// against the grant.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NodeRoles {
    /// Hosts guests.
    pub hypervisor: bool,
    /// Serves ingress at this advertised `host:port`.
    #[serde(default)]
    pub gateway: Option<String>,
    /// Accepts relay connections from the CP (mutual TLS) at this `ip:port`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub relay: Option<String>,
}

/// One guest as the agent sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct GuestStatus {
    pub vm_id: String,
    pub state: VmState,
    #[serde(default)]
    pub reason: Option<String>,
    /// A running QEMU guest's accelerator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accelerator: Option<crate::api::Accelerator>,
}

/// `POST /v1/agent/heartbeat` (mutual TLS).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Heartbeat {
    pub node: String,
    /// Roles the agent was pinned to (`--hypervisor`, `--gateway`); absent
    /// when it follows its grant. Roles are never taken from here: pinned
    /// roles that differ from the grant are refused (409 `roles_mismatch`).
    #[serde(default)]
    pub roles: Option<NodeRoles>,
    /// The node's underlay address as the agent sees it. It must be the
    /// address the heartbeat comes from, or the one an admin set (409
    /// `vtep_mismatch` otherwise).
    pub vtep: String,
    /// Version of the desired state the agent last applied fully.
    #[serde(default)]
    pub applied_version: Option<u64>,
    /// The guests' states: all of them, or only those that changed since
    /// the last answered heartbeat (an agent sends every state at its start
    /// and every [`GUESTS_WHOLE_SET_EVERY`]). The control plane reads only
    /// the states listed: a guest not listed keeps the state it holds, as a
    /// verdict not listed stands.
    #[serde(default)]
    pub guests: Vec<GuestStatus>,
    /// Open gateway sessions per overlay network name.
    #[serde(default)]
    pub sessions: BTreeMap<String, u32>,
    /// Health verdicts of the LB backends this node probes: all of them,
    /// or with [`health_changes_only`](Self::health_changes_only) those
    /// that changed since the last answered heartbeat.
    #[serde(default)]
    pub health: Vec<HealthReport>,
    /// `health` lists only changed verdicts: every other verdict this node
    /// reported stands, probed as of this heartbeat. An agent sends the
    /// whole set at its start and now and then; one that does not say so
    /// sends it every time.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub health_changes_only: bool,
    /// The agent's own network namespace name (`/run/netns/NAME`), if any:
    /// the netns runtime hands migrating guests' veths over to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns: Option<String>,
    /// Networks (names) this node has realized: overlays and, despite the
    /// field's name (kept for compatibility), bridge networks.
    #[serde(default)]
    pub ready_overlays: Vec<String>,
    /// Outcomes of migrations this node was asked to carry out (as source).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub migrations: Vec<MigrationReport>,
    /// QEMU guests this node waits to receive (as a migration's target):
    /// the port its incoming QEMU listens on, at its VTEP.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub incoming: Vec<IncomingReady>,
    /// Identifies this run of the node's gateway (random, new at each start).
    /// When it changes, sessions the CP still lists as open there ended with
    /// the previous run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_epoch: Option<String>,
    /// Gateway sessions started and ended since the last answered heartbeat,
    /// oldest first (at most [`MAX_SESSION_EVENTS`]; the rest follow).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub session_events: Vec<SessionEvent>,
    /// Byte counts of the gateway's open sessions that moved since the last
    /// answered heartbeat (at most [`MAX_SESSION_BYTES`]; the rest follow):
    /// the sessions list shows them live. A session's own end report
    /// carries its final counts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub session_bytes: Vec<SessionBytes>,
    /// Agent version.
    #[serde(default)]
    pub version: String,
    /// The agent understands an `unchanged` answer: when its
    /// `applied_version` is current, the CP answers with the version alone.
    /// An agent that does not say so always gets the whole state.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub accepts_unchanged: bool,
    /// The agent applies a [`DesiredDelta`] against its `applied_version`
    /// (which it still holds): the CP answers with what changed since, when
    /// it knows that version, and the whole state otherwise.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub accepts_delta: bool,
    /// With `accepts_delta`: the agent applies a delta's
    /// [`guests`](DesiredDelta::guests), so when only guests or health
    /// checks of its own part changed it gets those guests, not the own
    /// part whole.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub accepts_guest_changes: bool,
    /// The agent reads revocations naming one session
    /// ([`Revocation::session`]). An agent that does not say so refused
    /// any unknown field of a revocation (the whole answer with it): the CP
    /// sends it such entries without the field
    /// ([`without_one_session_revocations`]), which end every session of
    /// that principal to that VM and port, as before.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reads_one_session_revocations: bool,
}

/// How often an agent sending [`Heartbeat::health_changes_only`] sends
/// every verdict instead: a bound on how long the CP and a node can
/// disagree about one (a report the CP dropped, a CP restored from a backup).
pub const HEALTH_WHOLE_SET_EVERY: std::time::Duration = std::time::Duration::from_secs(300);

/// How often an agent sends every guest's state rather than those that
/// changed ([`Heartbeat::guests`]): a bound on how long the CP and a node
/// can disagree about one (a report the CP dropped, a CP restored from a
/// backup, a replica that did not know the VM yet).
pub const GUESTS_WHOLE_SET_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

/// How often an agent that [`accepts_delta`](Heartbeat::accepts_delta)
/// takes the whole desired state instead: a bound on how long a state built
/// from changes could differ from the control plane's, whatever went wrong.
pub const WHOLE_STATE_EVERY: std::time::Duration = std::time::Duration::from_secs(300);

/// Most session events one heartbeat carries.
pub const MAX_SESSION_EVENTS: usize = 2_000;

/// Most byte-count reports one heartbeat carries: the longest-unreported
/// sessions go first, the rest with the next heartbeats.
pub const MAX_SESSION_BYTES: usize = 2_000;

/// An open session's byte counts so far (totals since it opened, not
/// increments: a report lost or repeated changes nothing).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionBytes {
    /// The session's id (its credential's `jti`).
    pub session: String,
    /// Client → guest.
    pub bytes_up: u64,
    /// Guest → client.
    pub bytes_down: u64,
}

/// A gateway session's start or end, as the gateway saw it. `session` is the
/// credential's `jti`: single use, so one id per session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "event", rename_all = "snake_case", deny_unknown_fields)]
pub enum SessionEvent {
    Start {
        session: String,
        #[serde(with = "time::serde::rfc3339")]
        #[schema(value_type = String, format = DateTime)]
        at: OffsetDateTime,
        /// `user:NAME` or `grant:NAME`: the credential's subject.
        principal: String,
        vm: String,
        port: u16,
        /// The overlay network the session crosses.
        network: String,
        /// The credential the session was opened with (spent, single use):
        /// the control plane records a start only if it issued this
        /// credential to the reporting gateway, and takes the session's id,
        /// principal, VM and port from it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        credential: Option<String>,
    },
    End {
        session: String,
        #[serde(with = "time::serde::rfc3339")]
        #[schema(value_type = String, format = DateTime)]
        at: OffsetDateTime,
        principal: String,
        vm: String,
        port: u16,
        network: String,
        /// Client → guest.
        bytes_up: u64,
        /// Guest → client.
        bytes_down: u64,
        duration_ms: u64,
        /// `closed`, `idle timeout`, or the error that ended it.
        reason: String,
        /// As in `Start`: the end of a session the control plane never saw
        /// start is recorded only with it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        credential: Option<String>,
    },
}

/// Longest identifier-like string a node may send (names, ids, versions,
/// addresses, the session epoch).
pub const MAX_NODE_FIELD: usize = 128;
/// Longest free-text reason a node may send; longer ones are cut.
pub const MAX_NODE_REASON: usize = 512;

/// Why a heartbeat's strings were refused: the field, and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("heartbeat field {field}: {problem}")]
pub struct BadNodeString {
    pub field: &'static str,
    pub problem: String,
}

/// An identifier-like string a node sent: at most [`MAX_NODE_FIELD`] bytes
/// and no control character (a newline would forge a log line, an escape
/// sequence would reach an admin's terminal). Refused otherwise.
fn check_field(field: &'static str, value: &str) -> Result<(), BadNodeString> {
    if value.len() > MAX_NODE_FIELD {
        return Err(BadNodeString {
            field,
            problem: format!("{} bytes; at most {MAX_NODE_FIELD}", value.len()),
        });
    }
    if value.chars().any(char::is_control) {
        return Err(BadNodeString {
            field,
            problem: "contains control characters".into(),
        });
    }
    Ok(())
}

/// A free-text reason a node sent, made safe to store, log and print:
/// control characters escaped, cut to [`MAX_NODE_REASON`] bytes.
pub fn tame_reason(reason: &str) -> String {
    let mut out = String::with_capacity(reason.len().min(MAX_NODE_REASON));
    for c in reason.chars() {
        let piece: String = if c.is_control() {
            c.escape_default().collect()
        } else {
            c.to_string()
        };
        if out.len() + piece.len() > MAX_NODE_REASON {
            out.push('…');
            break;
        }
        out.push_str(&piece);
    }
    out
}

impl Heartbeat {
    /// Checks every identifier-like string the node sent (refusing the
    /// heartbeat if one is too long or holds control characters) and tames
    /// every free-text reason in place: what a node sends is stored,
    /// logged and shown to admins, and a node never decides how much.
    pub fn check_strings(&mut self) -> Result<(), BadNodeString> {
        check_field("node", &self.node)?;
        check_field("vtep", &self.vtep)?;
        check_field("version", &self.version)?;
        if let Some(netns) = &self.netns {
            check_field("netns", netns)?;
        }
        if let Some(epoch) = &self.session_epoch {
            check_field("session_epoch", epoch)?;
        }
        if let Some(roles) = &self.roles {
            for a in roles.gateway.iter().chain(&roles.relay) {
                check_field("roles", a)?;
            }
        }
        for net in self.sessions.keys().chain(&self.ready_overlays) {
            check_field("network", net)?;
        }
        for g in &mut self.guests {
            check_field("guests.vm_id", &g.vm_id)?;
            if let Some(r) = &mut g.reason {
                *r = tame_reason(r);
            }
        }
        for h in &mut self.health {
            check_field("health.lb", &h.lb)?;
            check_field("health.vm_id", &h.vm_id)?;
            if let Some(r) = &mut h.reason {
                *r = tame_reason(r);
            }
        }
        for i in &self.incoming {
            check_field("incoming.vm_id", &i.vm_id)?;
            check_field("incoming.migration", &i.migration)?;
        }
        for m in &mut self.migrations {
            check_field("migrations.vm_id", &m.vm_id)?;
            if let Some(r) = &mut m.reason {
                *r = tame_reason(r);
            }
        }
        for b in &self.session_bytes {
            check_field("session_bytes.session", &b.session)?;
        }
        for e in &mut self.session_events {
            match e {
                SessionEvent::Start {
                    session,
                    principal,
                    vm,
                    network,
                    credential,
                    ..
                } => {
                    for (field, v) in [
                        ("session_events.session", &*session),
                        ("session_events.principal", &*principal),
                        ("session_events.vm", &*vm),
                        ("session_events.network", &*network),
                    ] {
                        check_field(field, v)?;
                    }
                    check_credential(credential.as_deref())?;
                }
                SessionEvent::End {
                    session,
                    principal,
                    vm,
                    network,
                    reason,
                    credential,
                    ..
                } => {
                    for (field, v) in [
                        ("session_events.session", &*session),
                        ("session_events.principal", &*principal),
                        ("session_events.vm", &*vm),
                        ("session_events.network", &*network),
                    ] {
                        check_field(field, v)?;
                    }
                    check_credential(credential.as_deref())?;
                    *reason = tame_reason(reason);
                }
            }
        }
        Ok(())
    }
}

impl SessionEvent {
    pub fn session(&self) -> &str {
        match self {
            SessionEvent::Start { session, .. } | SessionEvent::End { session, .. } => session,
        }
    }

    /// Who reached what: principal, VM, port and network, to overwrite.
    pub fn target_mut(&mut self) -> (&mut String, &mut String, &mut u16, &mut String) {
        match self {
            SessionEvent::Start {
                principal,
                vm,
                port,
                network,
                ..
            }
            | SessionEvent::End {
                principal,
                vm,
                port,
                network,
                ..
            } => (principal, vm, port, network),
        }
    }

    /// The credential the session was opened with, if the report carries it.
    pub fn credential(&self) -> Option<&str> {
        match self {
            SessionEvent::Start { credential, .. } | SessionEvent::End { credential, .. } => {
                credential.as_deref()
            }
        }
    }
}

/// A session report's credential: at most a token's length, and only the
/// characters of a PASETO (base64url and dots).
fn check_credential(credential: Option<&str>) -> Result<(), BadNodeString> {
    let Some(c) = credential else { return Ok(()) };
    if c.len() > otherix_core::credential::MAX_TOKEN_LEN {
        return Err(BadNodeString {
            field: "session_events.credential",
            problem: format!("longer than {} bytes", otherix_core::credential::MAX_TOKEN_LEN),
        });
    }
    if !c
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        return Err(BadNodeString {
            field: "session_events.credential",
            problem: "not a credential (base64url and dots only)".into(),
        });
    }
    Ok(())
}

/// The node's desired state: the heartbeat's answer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct DesiredState {
    /// Changes whenever anything below does.
    pub version: u64,
    pub node: String,
    /// What an admin granted this node: the agent serves the gateway and
    /// the relay at these addresses, and only while they are granted.
    #[serde(default)]
    pub roles: NodeRoles,
    /// MTU for guest and overlay interfaces (underlay MTU minus VXLAN's 50).
    pub mtu: u32,
    pub overlays: Vec<OverlayState>,
    pub bridges: Vec<BridgeState>,
    pub guests: Vec<GuestState>,
    /// Public session keys that will sign soon or may still have live
    /// credentials; gateways verify credentials with them, offline.
    #[serde(default)]
    pub session_keys: Vec<SessionPublicKey>,
    /// The cluster id: credentials must carry it as `iss`. Empty from a
    /// control plane that predates it (then gateways do not check `iss`).
    #[serde(default)]
    pub cluster_id: String,
    /// Health checks of LB backends placed on this node.
    #[serde(default)]
    pub health_checks: Vec<HealthCheck>,
    /// Access taken away lately (gateway nodes only): a gateway refuses the
    /// credentials these cover and ends the sessions opened with them.
    #[serde(default)]
    pub revocations: Vec<Revocation>,
    /// Guests that just left this node for another: frames still arriving
    /// here for their MACs go back out of the overlay towards where they
    /// are now, until every member has repointed (or a bounded time).
    /// Sorted; absent when empty, so a state without any keeps its JSON.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub forwards: Vec<Forward>,
    /// The answer to a heartbeat whose `applied_version` is `version`, from
    /// an agent that `accepts_unchanged`: nothing but `version` and `node`
    /// is set, and the agent keeps the state it has.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unchanged: bool,
    /// The answer to a heartbeat from an agent that `accepts_delta`: what
    /// changed since the version it applied ([`DesiredState::apply`]);
    /// nothing but `version` and `node` is set beside it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta: Option<DesiredDelta>,
    /// With a whole state or a delta: the digest of the state the node is
    /// to hold once it has taken this answer ([`DesiredState::digest`] at
    /// the VTEP it reported). An agent that computes another from what it
    /// built asks for the whole state. Absent from a control plane that
    /// predates it (then the agent takes the whole state every
    /// [`WHOLE_STATE_EVERY`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<u64>,
}

/// Access taken away: credentials of `principal` issued at or before `before`
/// (narrowed to one API token, one VM, one port and one session where
/// given) are refused, and sessions opened with them end with reason
/// `revoked` (`ended by an admin` for an entry naming one session). Kept in
/// desired states until every credential it covers has expired.
///
/// Unknown fields are ignored (no `deny_unknown_fields`): an entry a newer
/// control plane narrows further must still be read, and it keeps every
/// field an older reader matches on, so that reader ends more, never less.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, ToSchema)]
pub struct Revocation {
    /// `user:NAME` or `grant:NAME` (a credential's `sub`).
    pub principal: String,
    /// Only credentials brokered with this API token id (a credential's `tok`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// Only credentials for this VM id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm_id: Option<String>,
    /// Only credentials for this port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// Only the credential with this `jti`: one session (an admin ended
    /// it). Such an entry still names the session's VM and port, which a
    /// reader that predates this field matches on instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// Credentials issued (`iat`) at or before this instant are covered.
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub before: OffsetDateTime,
}

impl Revocation {
    /// Whether these claims are revoked by this entry.
    pub fn covers(&self, claims: &otherix_core::credential::Claims) -> bool {
        claims.sub == self.principal
            && claims.iat <= self.before
            && self.token.as_ref().is_none_or(|t| claims.tok.as_ref() == Some(t))
            && self.vm_id.as_ref().is_none_or(|v| &claims.vm_id == v)
            && self.port.is_none_or(|p| claims.port == p)
            && self.session.as_ref().is_none_or(|s| &claims.jti == s)
    }

    /// Whether this entry names one session: it ends that session only,
    /// as an admin's "end session" does.
    pub fn is_one_session(&self) -> bool {
        self.session.is_some()
    }
}

/// A desired state (or delta) as JSON, for an agent that predates
/// [`Revocation::session`]: every revocation loses that field, keeping its
/// principal, VM and port — the agent ends every session of those, as an
/// admin's "end session" did before, never fewer. `None` when there is no
/// such field in it (the answer goes as it is); otherwise the JSON again.
/// Pure, so that what an older agent gets is a unit test.
pub fn without_one_session_revocations(json: &[u8]) -> Option<Vec<u8>> {
    const FIELD: &[u8] = b"\"session\":";
    if !json.windows(FIELD.len()).any(|w| w == FIELD) {
        return None;
    }
    let mut value: serde_json::Value = serde_json::from_slice(json).ok()?;
    let mut changed = false;
    strip_sessions(&mut value, &mut changed);
    changed.then(|| serde_json::to_vec(&value).ok()).flatten()
}

/// Removes `session` from the entries of every `revocations` array in `v`.
fn strip_sessions(v: &mut serde_json::Value, changed: &mut bool) {
    match v {
        serde_json::Value::Object(map) => {
            for (key, child) in map.iter_mut() {
                if let (true, serde_json::Value::Array(entries)) = (key == "revocations", &mut *child) {
                    for e in entries {
                        if let Some(entry) = e.as_object_mut() {
                            *changed |= entry.remove("session").is_some();
                        }
                    }
                } else {
                    strip_sessions(child, changed);
                }
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(|i| strip_sessions(i, changed)),
        _ => {}
    }
}

/// One backend of one LB to probe.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, ToSchema)]
pub struct HealthCheck {
    pub lb: String,
    pub vm_id: String,
    /// The guest's network (the probe goes from the node's address on it).
    pub network: String,
    #[schema(value_type = String, format = Ipv4)]
    pub ip: Ipv4Addr,
    pub port: u16,
    pub kind: crate::api::ProbeKind,
    pub path: Option<String>,
    pub interval_ms: u64,
    pub timeout_ms: u64,
    pub rise: u32,
    pub fall: u32,
}

/// A verdict, with when it was probed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HealthReport {
    pub lb: String,
    pub vm_id: String,
    pub health: crate::api::Health,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub probed_at: OffsetDateTime,
    #[serde(default, with = "time::serde::rfc3339::option")]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub changed_at: Option<OffsetDateTime>,
    #[serde(default)]
    pub reason: Option<String>,
    #[serde(default)]
    pub successes: u32,
    #[serde(default)]
    pub failures: u32,
}

/// The public half of a session signing key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SessionPublicKey {
    pub kid: String,
    /// Ed25519 public key, hex.
    pub public: String,
    /// After this instant no credential the key signed can be valid: it
    /// stopped signing, then the longest credential life and the clock
    /// skew passed. Gateways refuse its credentials from then on
    /// (`key_expired`), heard from the control plane since or not. Absent
    /// while no newer key has taken over (and from an older control plane).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "time::serde::rfc3339::option"
    )]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub not_after: Option<OffsetDateTime>,
}

/// One overlay this node is a member of.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct OverlayState {
    pub network: String,
    pub network_id: String,
    pub vni: u32,
    pub subnet: Subnet,
    /// This node's own lease on the overlay.
    pub address: Ipv4Cidr,
    /// The MAC of that lease: the overlay bridge carries it, so the other
    /// members' FDB entries for it point here.
    pub mac: MacAddr,
    /// Unicast FDB entries: each remote guest or member MAC → VTEP hosting it.
    /// The agent also floods broadcast (ARP) to each distinct VTEP here
    /// (head-end replication; no multicast, no learning).
    pub fdb: Vec<FdbEntry>,
    /// Static neighbor entries: every guest and member IP → MAC.
    pub neighbors: Vec<NeighborEntry>,
}

/// A guest that left this node: what arrives on overlay `network` for
/// `mac` is sent on to `vtep`, its host now (the control plane's record of
/// that node's VTEP; the overlay's FDB says the same).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, ToSchema)]
pub struct Forward {
    pub network: String,
    pub mac: MacAddr,
    #[schema(value_type = String, format = Ipv4)]
    pub vtep: Ipv4Addr,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, ToSchema)]
pub struct FdbEntry {
    pub mac: MacAddr,
    #[schema(value_type = String, format = Ipv4)]
    pub vtep: Ipv4Addr,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, ToSchema)]
pub struct NeighborEntry {
    #[schema(value_type = String, format = Ipv4)]
    pub ip: Ipv4Addr,
    pub mac: MacAddr,
}

/// A host-local bridge network on this node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct BridgeState {
    pub network: String,
    pub network_id: String,
    pub subnet: Subnet,
    /// The node-side address.
    pub address: Ipv4Cidr,
}

/// A guest this node must run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct GuestState {
    pub vm_id: String,
    pub name: String,
    pub network: String,
    pub network_id: String,
    pub mac: MacAddr,
    pub address: Ipv4Cidr,
    /// Default route.
    #[schema(value_type = String, format = Ipv4)]
    pub gateway: Ipv4Addr,
    pub exec: Option<String>,
    /// A QEMU guest's machine (`None`: the netns runtime).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine: Option<crate::api::Machine>,
    /// Set on a migration's target for a QEMU guest: start an incoming
    /// QEMU and receive the guest from `from`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incoming: Option<IncomingMigration>,
    /// Set on the source node once the target is ready: hand the guest
    /// over (netns runtime: move the host end of its veth into the target's
    /// namespace and onto its overlay bridge), then report it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migrate_to: Option<MigrateTo>,
}

/// Where a migrating guest goes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct MigrateTo {
    pub node: String,
    /// The target node's network namespace name.
    pub netns: String,
    /// The overlay bridge on the target (`oxb{vni}`).
    pub bridge: String,
    /// A QEMU guest: stream it to the target's incoming QEMU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qemu: Option<QemuMigration>,
}

/// The key both ends of one QEMU migration encrypt and authenticate its
/// stream with (TLS-PSK). Derived by the CP per migration; only the two
/// nodes get it. Never printed.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(transparent)]
#[schema(value_type = String)]
pub struct MigrationKey(pub String);

impl std::fmt::Debug for MigrationKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MigrationKey(..)")
    }
}

/// A source's part of a QEMU migration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct QemuMigration {
    /// This migration's id (a migration of the same VM again gets another).
    pub migration: String,
    /// Where the target's QEMU listens: its VTEP and the port it reported.
    pub address: String,
    pub key: MigrationKey,
}

/// A target's part of a QEMU migration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct IncomingMigration {
    /// The node the guest comes from.
    pub from: String,
    pub migration: String,
    pub key: MigrationKey,
}

/// A target's word: its incoming QEMU for `vm_id` listens on `port`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct IncomingReady {
    pub vm_id: String,
    pub migration: String,
    pub port: u16,
}

wire_enum! {
    /// How a source node's part of a migration went.
    pub enum MigrationOutcome: "migration outcome" {
        /// The guest now hangs off the target.
        Moved = "moved",
        /// It could not be moved; the report says why.
        Failed = "failed",
    }
}

/// A source node's word on one migration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MigrationReport {
    pub vm_id: String,
    pub outcome: MigrationOutcome,
    #[serde(default)]
    pub reason: Option<String>,
}

wire_enum! {
    /// Whether a node heartbeats.
    pub enum NodeStatus: "node status" {
        /// Its last heartbeat is younger than the CP's `--node-timeout`.
        Ready = "Ready",
        NotReady = "NotReady",
    }
}

/// A node as `otherix node list/get` shows it.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Node {
    pub name: String,
    pub roles: NodeRoles,
    pub status: NodeStatus,
    pub vtep: Option<String>,
    pub guests: u32,
    /// Overlay memberships (network names).
    pub overlays: Vec<String>,
    /// Memberships kept only while the gateway's open sessions drain.
    #[serde(default)]
    pub draining: Vec<String>,
    pub agent_version: Option<String>,
    #[serde(with = "time::serde::rfc3339::option")]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub last_heartbeat: Option<OffsetDateTime>,
    /// Why the node's last heartbeat was refused (roles or VTEP it asserted
    /// that were not granted); cleared by the next accepted one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_reason: Option<String>,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub created_at: OffsetDateTime,
}

/// `PATCH /v1/nodes/{name}` (admin): change what a node may be. Absent
/// fields stay as they are.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateNodeRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hypervisor: Option<bool>,
    /// `IP:PORT` grants the gateway role there; `none` withdraws it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
    /// `IP:PORT`, `off`, or `auto` (a hypervisor's VTEP, port 7444).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub relay: Option<String>,
    /// `IP`, or `auto` (the address the node's connections come from).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vtep: Option<String>,
}

wire_enum! {
    /// What a node certificate is for; each certificate has exactly one purpose.
    pub enum CertPurpose: "certificate purpose" {
        /// The node's client certificate for the CP (clientAuth): renewal.
        Node = "node",
        /// The gateway's serving certificate (serverAuth) for its granted address.
        Gateway = "gateway",
        /// The relay endpoint's serving certificate (serverAuth) for its granted address.
        Relay = "relay",
    }
}

/// `POST /v1/agent/certificate` (mutual TLS): a certificate for the node's
/// own key. Names and addresses come from the CP's state, never from here.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CertificateRequest {
    pub purpose: CertPurpose,
    pub csr_pem: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CertificateResponse {
    pub cert_pem: String,
    pub ca_pem: String,
}

/// `GET /v1/agent/desired/wait?version=V` (mutual TLS): held open until the
/// node's desired state is no longer version `V` (then heartbeat for it), or
/// about 25 s.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct DesiredWait {
    /// Whether the desired state changed; `false` when the hold ran out.
    pub changed: bool,
    /// The node's desired version now (`V` when unchanged).
    pub version: u64,
}

#[cfg(test)]
mod tests {
    use otherix_core::credential::Claims;
    use time::{Duration, OffsetDateTime};

    use super::Revocation;

    fn claims(sub: &str, tok: Option<&str>, iat: OffsetDateTime) -> Claims {
        Claims {
            iss: "c".into(),
            aud: "gw1".into(),
            sub: sub.into(),
            tok: tok.map(Into::into),
            jti: "00".into(),
            iat,
            nbf: iat,
            exp: iat + Duration::minutes(5),
            vm: "web01".into(),
            vm_id: "vm1".into(),
            net: "lan".into(),
            mac: None,
            ip: "10.0.0.2".into(),
            port: 22,
            until: None,
        }
    }

    #[test]
    fn a_revocation_covers_its_principal_issued_before_it_and_only_within_its_scope() {
        let at = OffsetDateTime::now_utc();
        let whole = Revocation {
            principal: "user:alice".into(),
            token: None,
            vm_id: None,
            port: None,
            session: None,
            before: at,
        };
        let old = claims("user:alice", Some("t1"), at - Duration::seconds(1));
        assert!(whole.covers(&old));
        assert!(
            whole.covers(&claims("user:alice", None, at)),
            "issued at the instant"
        );
        assert!(
            !whole.covers(&claims("user:alice", None, at + Duration::milliseconds(1))),
            "issued after"
        );
        assert!(
            !whole.covers(&claims("user:bob", None, at - Duration::seconds(1))),
            "another principal"
        );

        let token = Revocation {
            token: Some("t1".into()),
            ..whole.clone()
        };
        assert!(token.covers(&old));
        assert!(
            !token.covers(&claims("user:alice", Some("t2"), at - Duration::seconds(1))),
            "another token"
        );
        assert!(
            !token.covers(&claims("user:alice", None, at - Duration::seconds(1))),
            "no token"
        );

        let target = Revocation {
            vm_id: Some("vm1".into()),
            port: Some(22),
            ..whole.clone()
        };
        assert!(target.covers(&old));
        let mut other_port = old.clone();
        other_port.port = 80;
        assert!(!target.covers(&other_port));
        let mut other_vm = old.clone();
        other_vm.vm_id = "vm2".into();
        assert!(!target.covers(&other_vm));
    }

    #[test]
    fn a_one_session_revocation_covers_that_credential_only() {
        let at = OffsetDateTime::now_utc();
        let one = Revocation {
            principal: "user:alice".into(),
            token: None,
            vm_id: Some("vm1".into()),
            port: Some(22),
            session: Some("jti-1".into()),
            before: at,
        };
        assert!(one.is_one_session());
        let mut ended = claims("user:alice", None, at - Duration::seconds(1));
        ended.jti = "jti-1".into();
        assert!(one.covers(&ended));
        // The same principal's other session to the same VM and port goes on.
        let mut sibling = ended.clone();
        sibling.jti = "jti-2".into();
        assert!(!one.covers(&sibling));
        // Its other fields still narrow it: another principal's credential
        // that happens to carry the id (never issued so) is not covered.
        let mut stranger = ended.clone();
        stranger.sub = "user:bob".into();
        assert!(!one.covers(&stranger));
        let mut later = ended.clone();
        later.iat = at + Duration::milliseconds(1);
        assert!(!one.covers(&later), "issued after it");
    }

    #[test]
    fn an_older_agent_gets_one_session_revocations_as_target_revocations_it_can_read() {
        /// `Revocation` as agents before `session` read it.
        #[derive(Debug, serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct Older {
            principal: String,
            token: Option<String>,
            vm_id: Option<String>,
            port: Option<u16>,
            #[serde(with = "time::serde::rfc3339")]
            before: OffsetDateTime,
        }
        #[derive(Debug, serde::Deserialize)]
        struct OlderState {
            revocations: Vec<Older>,
        }
        let at = OffsetDateTime::now_utc();
        let whole = Revocation {
            principal: "grant:acme".into(),
            token: None,
            vm_id: None,
            port: None,
            session: None,
            before: at,
        };
        let state = super::DesiredState {
            node: "gw1".into(),
            revocations: vec![
                whole.clone(),
                Revocation {
                    principal: "user:alice".into(),
                    vm_id: Some("vm1".into()),
                    port: Some(22),
                    session: Some("jti-1".into()),
                    ..whole.clone()
                },
            ],
            ..Default::default()
        };
        let json = serde_json::to_vec(&state).unwrap();
        assert!(
            serde_json::from_slice::<OlderState>(&json).is_err(),
            "an older agent refuses the field"
        );
        let older = super::without_one_session_revocations(&json).expect("rewritten");
        let read: OlderState = serde_json::from_slice(&older).unwrap();
        assert_eq!(read.revocations.len(), 2);
        assert_eq!(
            (read.revocations[1].vm_id.as_deref(), read.revocations[1].port),
            (Some("vm1"), Some(22))
        );
        // Everything else is as it was.
        let mut again: super::DesiredState = serde_json::from_slice(&older).unwrap();
        again.revocations[1].session = Some("jti-1".into());
        assert_eq!(again, state);
        // In a delta too (its own part).
        let delta = serde_json::json!({"version": 2, "node": "gw1", "delta": {"own": {"revocations": [
            serde_json::to_value(&state.revocations[1]).unwrap()
        ]}}});
        let older = super::without_one_session_revocations(&serde_json::to_vec(&delta).unwrap()).unwrap();
        assert!(!String::from_utf8(older).unwrap().contains("jti-1"));
        // Nothing to rewrite: the answer goes as it is.
        let plain = super::DesiredState {
            revocations: vec![whole],
            ..Default::default()
        };
        assert_eq!(
            super::without_one_session_revocations(&serde_json::to_vec(&plain).unwrap()),
            None
        );
    }

    #[test]
    fn a_one_session_revocation_read_as_before_covers_only_what_its_target_covers() {
        // An agent that predates `session` reads the entry without it: it
        // ends the principal's sessions to that VM and port, as it did for
        // an admin's "end session" before, and nothing more.
        let at = OffsetDateTime::now_utc();
        let one = Revocation {
            principal: "user:alice".into(),
            token: None,
            vm_id: Some("vm1".into()),
            port: Some(22),
            session: Some("jti-1".into()),
            before: at,
        };
        let json = serde_json::to_value(&one).unwrap();
        assert_eq!(json["session"], "jti-1");
        let mut older = json.clone();
        older.as_object_mut().unwrap().remove("session");
        let read: Revocation = serde_json::from_value(older).unwrap();
        let mut other_port = claims("user:alice", None, at - Duration::seconds(1));
        other_port.port = 80;
        assert!(!read.covers(&other_port));
        let mut other_vm = claims("user:alice", None, at - Duration::seconds(1));
        other_vm.vm_id = "vm2".into();
        assert!(!read.covers(&other_vm));
        assert!(read.covers(&claims("user:alice", None, at - Duration::seconds(1))));
        // And a reader ignores a field it does not know (this struct no
        // longer refuses them, so the next narrowing is read too).
        let mut newer = json;
        newer["narrower"] = serde_json::json!("x");
        assert_eq!(serde_json::from_value::<Revocation>(newer).unwrap(), one);
    }
}

#[cfg(test)]
mod node_strings {
    use super::*;

    fn heartbeat() -> Heartbeat {
        serde_json::from_value(serde_json::json!({
            "node": "node1",
            "vtep": "10.0.0.1",
            "version": "0.1.0",
        }))
        .unwrap()
    }

    #[test]
    fn identifier_fields_with_control_characters_or_too_long_are_refused() {
        let mut hb = heartbeat();
        assert_eq!(hb.check_strings(), Ok(()));
        hb.version = "0.1.0\u{1b}[2J".into();
        let err = hb.check_strings().unwrap_err();
        assert_eq!(err.field, "version");
        let mut hb = heartbeat();
        hb.vtep = "10.0.0.1\nINFO forged log line".into();
        assert_eq!(hb.check_strings().unwrap_err().field, "vtep");
        let mut hb = heartbeat();
        hb.version = "x".repeat(MAX_NODE_FIELD + 1);
        assert!(hb.check_strings().unwrap_err().problem.contains("at most 128"));
        let mut hb = heartbeat();
        hb.version = "é".repeat(MAX_NODE_FIELD / 2);
        assert_eq!(hb.check_strings(), Ok(()), "non-ASCII within the bound is fine");
    }

    #[test]
    fn reasons_are_escaped_and_cut_not_refused() {
        assert_eq!(
            tame_reason("connect: refused\n\u{1b}[31m"),
            "connect: refused\\n\\u{1b}[31m"
        );
        let long = tame_reason(&"a".repeat(10 * MAX_NODE_REASON));
        assert!(long.len() <= MAX_NODE_REASON + '…'.len_utf8() && long.ends_with('…'));
        let mut hb = heartbeat();
        hb.guests.push(GuestStatus {
            accelerator: None,
            vm_id: "vm1".into(),
            state: crate::api::VmState::Failed,
            reason: Some("exit\n2".into()),
        });
        hb.check_strings().unwrap();
        assert_eq!(hb.guests[0].reason.as_deref(), Some("exit\\n2"));
    }
}
