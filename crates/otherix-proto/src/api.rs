//! Request and response bodies of the control-plane API (`/v1/...`).
//!
//! Request types refuse unknown fields so a typo in a client never silently
//! does something other than what was asked.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

/// The names a request carries, checked as it is read: a body with an invalid
/// name is refused before a handler runs.
pub use otherix_core::{GrantName, InvalidName, LbName, NetworkName, NodeName, UserName, VmName};
use otherix_core::{MacAddr, Subnet};

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use utoipa::ToSchema;

pub use otherix_core::lb::{Health, PoolStatus};

wire_enum! {
    /// Roles, from most to least powerful.
    pub enum Role: "role" {
        /// Everything, including users and tokens.
        Admin = "admin",
        /// Read access, and brokering to the targets its access rules allow.
        User = "user",
        /// Read-only.
        Viewer = "viewer",
    }
}

/// A port an access rule allows: 1 to 65535, or 0 for the guest's serial
/// console (`otherix console`; `--ports console` in the CLI). Only a schema.
pub struct RulePort;

impl utoipa::PartialSchema for RulePort {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::schema::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::Integer)
            .description(Some("A TCP port, or 0: the VM's serial console."))
            .minimum(Some(0))
            .maximum(Some(65535))
            .into()
    }
}

impl ToSchema for RulePort {
    fn name() -> std::borrow::Cow<'static, str> {
        std::borrow::Cow::Borrowed("RulePort")
    }
}

/// A TCP port in a request: 1 to 65535. Only a schema: the fields are
/// `u16` (70000 does not parse) and the handlers refuse 0.
pub struct Port;

impl utoipa::PartialSchema for Port {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::schema::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::Integer)
            .description(Some("A TCP port."))
            .minimum(Some(1))
            .maximum(Some(65535))
            .into()
    }
}

impl ToSchema for Port {
    fn name() -> std::borrow::Cow<'static, str> {
        std::borrow::Cow::Borrowed("Port")
    }
}

/// Every error the API returns: `{"error": {"code": "...", "message": "..."}}`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorDetail {
    /// Stable machine-readable code, e.g. `not_found`, `forbidden`, `subnet_exhausted`.
    pub code: String,
    /// One line for people.
    pub message: String,
}

/// What the CP says about itself; served without authentication.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ServerInfo {
    pub cluster_id: String,
    pub version: String,
    /// `sha256:<hex>` of the cluster CA certificate (DER).
    pub ca_fingerprint: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct WhoAmI {
    /// `user:<name>` or `grant:<name>`.
    pub principal: String,
    pub name: String,
    /// The user's role; none for a grant.
    pub role: Option<Role>,
    /// For a grant with `--max-connections`: its connection budget. A
    /// client keeps no credentials ready for such a grant (each one
    /// brokered is one connection of the budget).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<u32>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct User {
    pub name: String,
    pub role: Role,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub created_at: OffsetDateTime,
    /// What a `user` may broker to. Empty for admins and viewers.
    pub rules: Vec<AccessRule>,
    pub tokens: Vec<TokenInfo>,
}

/// One access rule: VMs matching `selector`, on one of `ports`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct AccessRule {
    pub id: i64,
    /// A label selector that requires at least one label, e.g.
    /// `app=web,tier!=canary`.
    pub selector: String,
    pub ports: Vec<u16>,
    /// Set when the rule allows nothing, saying why: a rule stored before
    /// selectors that require no label (`env!=prod`, `!legacy`, empty) were
    /// refused. Such a rule would admit any VM created without labels, so it
    /// fails closed until an admin replaces it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inert: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TokenInfo {
    pub id: String,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub created_at: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339::option")]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub last_used_at: Option<OffsetDateTime>,
    /// When it stops working; absent or null: never (tokens made before
    /// tokens expired, the first admin's).
    #[serde(default, with = "time::serde::rfc3339::option")]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub expires_at: Option<OffsetDateTime>,
}

/// `POST /v1/users/{name}/tokens`: how long the new token lives.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateTokenRequest {
    /// Seconds it lives (1 to ten years); absent: the server's
    /// `--token-ttl` (90 days unless set).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 315_360_000)]
    pub ttl_seconds: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateUserRequest {
    pub name: UserName,
    pub role: Role,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AllowRequest {
    pub selector: String,
    /// At least one; 0 allows the serial console of the VMs it selects.
    #[schema(value_type = Vec<RulePort>, min_items = 1)]
    pub ports: Vec<u16>,
}

/// A new API token. The secret is in this answer only; the CP keeps a hash.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CreatedToken {
    pub id: String,
    pub user: String,
    pub token: String,
    /// When it stops working.
    #[serde(default, with = "time::serde::rfc3339::option")]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub expires_at: Option<OffsetDateTime>,
}

wire_enum! {
    /// The kinds of network.
    pub enum NetworkType: "network type" {
        /// Cross-node L2 over VXLAN.
        Overlay = "overlay",
        /// A host-local Linux bridge on each of its nodes: isolated segments
        /// sharing one subnet, so a VM can move between them.
        Bridge = "bridge",
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Network {
    pub name: String,
    pub id: String,
    #[serde(rename = "type")]
    pub kind: NetworkType,
    pub subnet: Subnet,
    /// VXLAN network identifier (overlays only).
    pub vni: Option<u32>,
    /// The first of `nodes` (by name); kept for clients that know one node.
    pub node: Option<String>,
    /// The nodes a bridge network exists on, each with a bridge of its own
    /// (bridges only; empty for overlays).
    #[serde(default)]
    pub nodes: Vec<String>,
    /// First address of the subnet, reserved for the node side (on every
    /// node of a bridge network).
    #[schema(value_type = String, format = Ipv4)]
    pub node_address: Ipv4Addr,
    /// How many VMs have a NIC on it.
    pub vms: u32,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub created_at: OffsetDateTime,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateNetworkRequest {
    pub name: NetworkName,
    #[serde(rename = "type")]
    pub kind: NetworkType,
    pub subnet: String,
    /// One node of a bridge network (the older form of `nodes`).
    #[serde(default)]
    pub node: Option<NodeName>,
    /// The nodes a bridge network exists on (with `node`, if both are given).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<NodeName>,
}

/// `POST /v1/networks/{name}/nodes`: a bridge network also exists on `node`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AddNetworkNodeRequest {
    pub node: NodeName,
}

wire_enum! {
    /// Where a VM is in its life.
    pub enum VmState: "vm state" {
        /// Created; not yet running on a node.
        Pending = "pending",
        Running = "running",
        Failed = "failed",
        Migrating = "migrating",
    }
}

wire_enum! {
    /// What a guest is on its node.
    pub enum Runtime: "runtime" {
        /// A network namespace running the VM's `exec` command (the default).
        Netns = "netns",
        /// A Linux VM under QEMU, booted from a guest image.
        Qemu = "qemu",
    }
}

// Written out: `wire_enum!` takes only doc comments on the enum.
#[allow(clippy::derivable_impls)]
impl Default for Runtime {
    fn default() -> Self {
        Self::Netns
    }
}

wire_enum! {
    /// How a QEMU guest's CPU runs.
    pub enum Accelerator: "accelerator" {
        /// Hardware virtualization.
        Kvm = "kvm",
        /// QEMU's own translator: slower, runs anywhere.
        Tcg = "tcg",
    }
}

/// A QEMU guest's machine (`vm create --runtime qemu`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Machine {
    /// Guest memory in MiB (64 to 65536).
    #[schema(minimum = 64, maximum = 65536)]
    pub memory_mib: u32,
    /// Virtual CPUs (1 to 64).
    #[schema(minimum = 1, maximum = 64)]
    pub cpus: u32,
    /// The guest image (a name in the nodes' image cache).
    pub image: String,
    /// Public keys put in the guest's root `authorized_keys`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ssh_keys: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Vm {
    pub name: String,
    pub id: String,
    pub network: String,
    /// The node it runs on, once scheduled.
    pub node: Option<String>,
    pub labels: BTreeMap<String, String>,
    /// The NIC's MAC, locally administered, allocated by the CP.
    pub mac: MacAddr,
    /// The NIC's lease address, allocated by the CP.
    #[schema(value_type = String, format = Ipv4)]
    pub ip: Ipv4Addr,
    pub state: VmState,
    /// Why the VM is `failed` (or pending), when known.
    pub reason: Option<String>,
    /// The workload command run inside the guest.
    pub exec: Option<String>,
    #[serde(default)]
    pub runtime: Runtime,
    /// A QEMU guest's machine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine: Option<Machine>,
    /// The accelerator a running QEMU guest got on its node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accelerator: Option<Accelerator>,
    /// While a QEMU guest migrates: the migration's id, and the port its
    /// target's incoming QEMU listens on once it does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration_port: Option<u16>,
    /// While `migrating`: the node it is moving to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migrate_to: Option<String>,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub created_at: OffsetDateTime,
}

/// `POST /v1/vms/{name}/console`: nothing to say yet (an object, so that
/// options can come without breaking callers).
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ConsoleRequest {}

/// `POST /v1/vms/{name}/migrate`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MigrateVmRequest {
    /// The hypervisor node to move to.
    pub to: NodeName,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateVmRequest {
    pub name: VmName,
    pub network: NetworkName,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub node: Option<NodeName>,
    #[serde(default)]
    pub exec: Option<String>,
    /// `netns` (the default) or `qemu`.
    #[serde(default)]
    pub runtime: Option<Runtime>,
    /// QEMU only: guest memory in MiB (default 256).
    #[serde(default)]
    #[schema(minimum = 64, maximum = 65536)]
    pub memory_mib: Option<u32>,
    /// QEMU only: virtual CPUs (default 1).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 64)]
    pub cpus: Option<u32>,
    /// QEMU only: the guest image (default `default`).
    #[serde(default)]
    pub image: Option<String>,
    /// QEMU only: public keys for root's `authorized_keys` in the guest.
    #[serde(default)]
    pub ssh_keys: Vec<String>,
}

/// `POST /v1/vm-batches`: several VMs created together, all or none
/// (`vm create NAME --count N`).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateVmBatchRequest {
    /// 1 to 1000 VMs, each as `POST /v1/vms` takes it.
    #[schema(min_items = 1, max_items = 1000)]
    pub vms: Vec<CreateVmRequest>,
}

/// The VMs a batch created, in the order asked.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct VmBatch {
    pub vms: Vec<Vm>,
}

/// Change labels: set some, remove others (`vm label NAME k=v k2-`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LabelVmRequest {
    #[serde(default)]
    pub set: BTreeMap<String, String>,
    #[serde(default)]
    pub remove: Vec<String>,
}

/// `POST /v1/broker`: access to one `(VM, port)` (or `lb/NAME`).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BrokerRequest {
    /// A VM name, or `lb/NAME`.
    #[schema(pattern = "^(lb/)?[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")]
    pub target: String,
    #[schema(value_type = Port)]
    pub port: u32,
    /// For `lb/NAME`: backends (VM names) not to choose, e.g. one the
    /// gateway just could not dial.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exclude: Vec<String>,
}

wire_enum! {
    /// How a client reaches a guest.
    pub enum Transport: "transport" {
        /// TLS to an ingress gateway on the guest's overlay.
        Gateway = "gateway",
        /// A WebSocket to the control plane's relay (bridge VMs).
        Relay = "relay",
    }
}

/// How to reach the target: where to connect and what to present there.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct BrokerResponse {
    pub transport: Transport,
    /// `https://gateway:port` or `wss://cp:port/v1/relay`.
    pub endpoint: String,
    /// Single-use PASETO v4.public credential.
    pub credential: String,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub expires_at: OffsetDateTime,
    /// The VM the connection will reach.
    pub vm: String,
    pub port: u16,
    /// For `gateway`: the gateway's node. The client verifies the gateway's
    /// certificate by `NODE.gateway.otherix`, which only that node's gateway
    /// certificate carries (not merely any certificate of the cluster CA for
    /// the endpoint's address).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// How long the credential had left when it was minted, in
    /// milliseconds: `expires_at` less the control plane's clock then. A
    /// client holding a credential for later counts it on its own monotonic
    /// clock from the answer's arrival, whatever its wall clock says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_in_ms: Option<u64>,
    /// The credential was counted against a grant's connection budget
    /// (`--max-connections`): the budget counts credentials brokered, so a
    /// client must broker only for a connection it is making now, never
    /// keep one ready.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub budgeted: bool,
    /// For `gateway`: the SHA-256 fingerprints (`sha256:HEX`) of the
    /// gateway serving certificates the control plane currently stands
    /// behind for `node` — issued to it, not revoked (the node deleted or
    /// replaced since), not expired; two while a renewal is under way. The
    /// client presents the credential only to a gateway whose certificate
    /// is one of them: a replaced or deleted machine's old certificate
    /// still carries the name and chains to the CA. A client refuses a
    /// gateway answer without it (a control plane older than the client).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway_certs: Option<Vec<String>>,
}

/// One `(target, port)` a grant allows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct GrantTarget {
    /// A VM name or `lb/NAME`.
    #[schema(pattern = "^(lb/)?[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")]
    pub target: String,
    #[schema(value_type = Port)]
    pub port: u16,
    /// For a VM: the id of the VM the grant was made for, which the control
    /// plane sets at `grant create`. The grant reaches that VM only, never
    /// another created later under the same name. In a request it may pin
    /// the VM (refused if the name is another VM now). Absent for
    /// `lb/NAME`, and for a VM target of a grant made before grants were
    /// bound to ids whose VM was gone then: such a target reaches nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm_id: Option<String>,
}

impl std::fmt::Display for GrantTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.target, self.port)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateGrantRequest {
    pub name: GrantName,
    /// 1 to 64 targets.
    #[schema(min_items = 1, max_items = 64)]
    pub targets: Vec<GrantTarget>,
    /// At least 1; over a year is cut to a year.
    #[schema(minimum = 1)]
    pub ttl_seconds: u64,
    #[serde(default)]
    #[schema(minimum = 1)]
    pub max_connections: Option<u32>,
}

/// A grant as listed: never its secret.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Grant {
    pub name: String,
    pub id: String,
    pub targets: Vec<GrantTarget>,
    pub created_by: String,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub created_at: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub expires_at: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339::option")]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub last_used_at: Option<OffsetDateTime>,
    pub max_connections: Option<u32>,
    pub connections: u32,
    pub state: GrantState,
}

wire_enum! {
    /// Whether a grant still lets its holder broker.
    pub enum GrantState: "grant state" {
        Active = "active",
        /// Past its expiry.
        Expired = "expired",
        /// Revoked by an admin.
        Revoked = "revoked",
        /// Its `max_connections` are used up.
        Exhausted = "exhausted",
    }
}

/// A new grant; the token is in this answer only.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CreatedGrant {
    pub grant: Grant,
    pub token: String,
}

wire_enum! {
    /// What an audit record records.
    pub enum AuditAction: "audit action" {
        /// A broker decision, allowed or refused.
        Broker = "broker",
        SessionStart = "session_start",
        SessionEnd = "session_end",
        /// A relay session went on over a new connection: the reason says
        /// why the last one ended and which control plane carries it now.
        SessionResume = "session_resume",
        /// Access taken away: a grant or token revoked, a user deleted, a rule removed.
        Revoke = "revoke",
        NodeEnroll = "node_enroll",
        NodeReplace = "node_replace",
        NodeJoinToken = "node_join_token",
        NodeUpdate = "node_update",
        NodeDelete = "node_delete",
        /// A session signing key rotated by request (`otherix keys rotate`).
        KeyRotate = "key_rotate",
    }
}

/// One audited decision or session.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AuditRecord {
    /// The record's place in the trail, increasing as records are written
    /// (0 before it is stored). With `at` it is a page's cursor.
    #[serde(default)]
    pub id: u64,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub at: OffsetDateTime,
    /// `user:NAME` or `grant:NAME`.
    pub principal: String,
    pub action: AuditAction,
    pub target: Option<String>,
    pub port: Option<u16>,
    pub transport: Option<Transport>,
    pub node: Option<String>,
    pub allowed: bool,
    pub reason: Option<String>,
    /// Sessions: bytes client → guest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_up: Option<u64>,
    /// Sessions: bytes guest → client.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_down: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    /// Sessions: the session's id (its credential's `jti`), the same on its
    /// start and end records.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
}

/// `GET /v1/audit`: one page of the trail, ordered by `(at, id)`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AuditPage {
    pub events: Vec<AuditRecord>,
    /// Pass as `after` for the next page; absent when this page holds the
    /// last matching record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
}

/// Where a page of the audit trail ends: the last record's time and id.
/// On the wire it is an opaque token (`after`, `next`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AuditCursor {
    /// Unix milliseconds.
    pub at_ms: i64,
    pub id: u64,
}

impl AuditCursor {
    /// Just before the first record at or after `at`.
    pub fn at_or_after(at: OffsetDateTime) -> AuditCursor {
        AuditCursor {
            at_ms: (at.unix_timestamp_nanos() / 1_000_000) as i64,
            // Ids start at 1.
            id: 0,
        }
    }

    /// Just after `record`.
    pub fn after(record: &AuditRecord) -> AuditCursor {
        AuditCursor {
            at_ms: (record.at.unix_timestamp_nanos() / 1_000_000) as i64,
            id: record.id,
        }
    }
}

impl std::fmt::Display for AuditCursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.at_ms, self.id)
    }
}

/// A cursor that is not one the API handed out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadCursor(pub String);

impl std::fmt::Display for BadCursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "invalid audit cursor {:?}: pass the `next` of a previous page",
            self.0
        )
    }
}

impl std::error::Error for BadCursor {}

impl std::str::FromStr for AuditCursor {
    type Err = BadCursor;
    fn from_str(s: &str) -> Result<AuditCursor, BadCursor> {
        let bad = || BadCursor(s.to_string());
        let (at, id) = s.split_once('.').ok_or_else(bad)?;
        Ok(AuditCursor {
            at_ms: at.parse().map_err(|_| bad())?,
            id: id.parse().map_err(|_| bad())?,
        })
    }
}

/// The error code of a control-plane replica that has lost its database:
/// it did nothing with the request, and another replica may serve it.
pub const REPLICA_UNAVAILABLE: &str = "replica_unavailable";

/// A session open now, as gateways and the relay last reported it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct OpenSession {
    /// The session's id (its credential's `jti`).
    pub id: String,
    /// `user:NAME` or `grant:NAME`.
    pub principal: String,
    /// The VM.
    pub target: String,
    pub port: u16,
    pub transport: Transport,
    /// The gateway node, or the node the relay dials.
    pub node: String,
    /// For a relay session, the control-plane replica that carries it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica: Option<String>,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub started_at: OffsetDateTime,
    /// Client → guest so far, as last reported (a gateway's heartbeat, the
    /// relay every few seconds; 0 until the first report).
    #[serde(default)]
    pub bytes_up: u64,
    /// Guest → client so far, as last reported.
    #[serde(default)]
    pub bytes_down: u64,
    /// When the counts were last reported; absent before the first report.
    #[serde(
        default,
        with = "time::serde::rfc3339::option",
        skip_serializing_if = "Option::is_none"
    )]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub bytes_at: Option<OffsetDateTime>,
}

wire_enum! {
    /// How a health check probes a backend.
    pub enum ProbeKind: "health check kind" {
        /// A TCP connect.
        Tcp = "tcp",
        /// `GET path`, expecting a 2xx status.
        Http = "http",
    }
}

/// How an LB's backends are probed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct HealthCheckSpec {
    pub kind: ProbeKind,
    /// HTTP path for `http`.
    pub path: Option<String>,
    /// Port probed [default: the LB's port].
    pub port: Option<u16>,
    pub interval_ms: u64,
    pub timeout_ms: u64,
    pub rise: u32,
    pub fall: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateLbRequest {
    pub name: LbName,
    #[schema(value_type = Port)]
    pub port: u16,
    pub selector: String,
    /// `tcp` (default) or `http:/path`.
    #[serde(default)]
    pub health: Option<String>,
    #[serde(default)]
    #[schema(value_type = Option<Port>)]
    pub health_port: Option<u16>,
    #[serde(default)]
    pub interval_ms: Option<u64>,
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    #[serde(default)]
    pub rise: Option<u32>,
    #[serde(default)]
    pub fall: Option<u32>,
}

/// Changes to an LB; absent fields stay as they are.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateLbRequest {
    #[serde(default)]
    #[schema(value_type = Option<Port>)]
    pub port: Option<u16>,
    #[serde(default)]
    pub selector: Option<String>,
    #[serde(default)]
    pub health: Option<String>,
    #[serde(default)]
    #[schema(value_type = Option<Port>)]
    pub health_port: Option<u16>,
    #[serde(default)]
    pub interval_ms: Option<u64>,
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    #[serde(default)]
    pub rise: Option<u32>,
    #[serde(default)]
    pub fall: Option<u32>,
}

/// A load balancer with its computed pool's summary.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct LoadBalancer {
    pub name: String,
    pub port: u16,
    pub selector: String,
    pub health_check: HealthCheckSpec,
    pub status: PoolStatus,
    pub healthy: u32,
    pub total: u32,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub created_at: OffsetDateTime,
    /// Per backend (in `lb get`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub backends: Vec<LbBackend>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct LbBackend {
    pub vm: String,
    pub node: Option<String>,
    #[schema(value_type = String, format = Ipv4)]
    pub ip: Ipv4Addr,
    /// `unknown`: no verdict yet, or a stale one.
    pub health: Health,
    #[serde(with = "time::serde::rfc3339::option")]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub last_probe: Option<OffsetDateTime>,
    #[serde(with = "time::serde::rfc3339::option")]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub last_change: Option<OffsetDateTime>,
    pub reason: Option<String>,
    pub successes: u32,
    pub failures: u32,
    /// Whether it gets new connections.
    pub eligible: bool,
    /// Whether its node is Ready (heartbeat within the node timeout). An
    /// eligible backend on a NotReady node gets new connections only when
    /// no eligible backend is on a Ready node. (Absent from older control
    /// planes, which did not tell: taken as Ready.)
    #[serde(default = "node_ready_by_default")]
    pub node_ready: bool,
}

fn node_ready_by_default() -> bool {
    true
}

wire_enum! {
    /// Where a session signing key is in its life (`otherix keys list`).
    pub enum KeyState: "key state" {
        /// Published to gateways; signs from its `signs_from`.
        Next = "next",
        /// Signs what the broker mints now.
        Current = "current",
        /// A newer key took over; credentials it signed may still be live,
        /// so gateways trust it until `expires_at`.
        Previous = "previous",
        /// Past `expires_at`: no credential it signed is valid, gateways
        /// refuse them (`key_expired`); deleted an hour on.
        Retired = "retired",
    }
}

/// A session signing key: its public facts, never its seed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SessionKeyInfo {
    pub kid: String,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub created_at: OffsetDateTime,
    /// When it signs (or signed) from.
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub signs_from: OffsetDateTime,
    pub state: KeyState,
    /// After this no credential it signed is valid: when a newer key took
    /// over, plus the longest credential life and the clock skew. `null`
    /// while no newer key is made.
    #[serde(with = "time::serde::rfc3339::option")]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub expires_at: Option<OffsetDateTime>,
}

/// The answer to a rotation: the new key (current once the answer is sent)
/// and the keys it retires, each trusted by gateways until its expiry.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct KeyRotation {
    pub key: SessionKeyInfo,
    pub retiring: Vec<SessionKeyInfo>,
}
