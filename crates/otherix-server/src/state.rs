//! What every handler can reach ([`AppState`]) and the control plane's
//! tunables ([`Settings`], validated once at start).

use std::sync::Arc;

use otherix_proto::ServerInfo;
use otherix_store::Store;

use crate::keys::SessionKeys;
use crate::pki::ClusterCa;

/// What every handler can reach: one pointer to [`Shared`], so that the
/// copies every request makes (each middleware and extractor takes its
/// own) cost one reference count, not one for each of its twenty parts.
#[derive(Clone, Debug)]
pub struct AppState(Arc<Shared>);

impl AppState {
    pub fn new(shared: Shared) -> AppState {
        AppState(Arc::new(shared))
    }
}

impl std::ops::Deref for AppState {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// The parts of [`AppState`].
#[derive(Debug)]
pub struct Shared {
    pub store: Store,
    pub info: Arc<ServerInfo>,
    pub ca: Arc<ClusterCa>,
    pub settings: Arc<Settings>,
    pub keys: Arc<SessionKeys>,
    /// Recent connections per LB backend, for power-of-two choices.
    pub recent: Arc<crate::lb::RecentConnections>,
    pub relay: Arc<crate::relay::RelayState>,
    /// Writes the audit trail in batches.
    pub audit: crate::audit::AuditWriter,
    /// Credentials brokered to VMs since the last summary line.
    pub brokered: Arc<crate::brokered::Tally>,
    /// The read model, and every node's desired state.
    pub catalog: Arc<crate::catalog::Catalog>,
    /// Per-principal broker rate limits.
    pub limits: Arc<crate::limits::BrokerLimits>,
    /// Per-node limits on heartbeats, waits and certificate calls.
    pub node_limits: Arc<crate::limits::NodeLimits>,
    /// Per-principal limits on the reads that walk a whole table.
    pub list_limits: Arc<crate::limits::BrokerLimits>,
    /// Held while VMs are chosen a node and written: a create group from
    /// its choice to its write, a batch until the catalog holds it, a
    /// heartbeat's pass over pending VMs (one at a time: the other
    /// heartbeats skip it, and the next places what arrived meanwhile).
    /// What was written but is not in the catalog yet counts through
    /// [`crate::creates::InTransit`].
    pub scheduling: Arc<tokio::sync::Mutex<()>>,
    /// VM creates grouped into shared transactions (see [`crate::creates`]).
    pub creates: Arc<crate::creates::CreateGroups>,
    /// Heartbeats' writes grouped into shared transactions (see
    /// [`crate::groups`]).
    pub heartbeat_writes: Arc<crate::groups::Groups<otherix_store::HeartbeatWrites, ()>>,
    /// Set while this replica has been cut off from its store longer than
    /// the replicas' timeout (see [`crate::replicas`]): the others took it
    /// for stopped, so it serves nothing — every API call is answered 503
    /// `replica_unavailable`, which sends clients and agents to another.
    pub fenced: Arc<std::sync::atomic::AtomicBool>,
    /// This replica's clock against the database's: it mints only while
    /// they agree (see [`crate::clock`]).
    pub clock: Arc<crate::clock::ClockCheck>,
    /// Addresses nodes have called from: only they may use the
    /// connections reserved for nodes (see [`crate::serve`]).
    pub node_sources: Arc<crate::serve::NodeSources>,
    /// The web console's signed-in browsers (see [`crate::console`]).
    pub console: Arc<crate::console::session::Sessions>,
}

/// Tunables of the control plane, validated once at start.
#[derive(Clone, Debug)]
pub struct Settings {
    /// A node whose last heartbeat is older than this is NotReady.
    pub node_timeout: time::Duration,
    /// MTU of guest and overlay interfaces: the underlay's minus VXLAN's 50.
    pub mtu: u32,
    /// Session signing keys rotate this often.
    pub key_rotation: time::Duration,
    /// Credentials live this long.
    pub credential_ttl: time::Duration,
    /// API tokens live this long unless their creation asks otherwise.
    pub token_ttl: time::Duration,
    /// Audit events are kept this long.
    pub audit_retention: time::Duration,
    /// Node, gateway and relay certificates are valid this long; agents
    /// renew them at two thirds.
    pub node_cert_validity: time::Duration,
    /// A gateway keeps an overlay its coverage no longer needs at most
    /// this long while its sessions there drain.
    pub max_drain: time::Duration,
    /// Broker calls per second each principal may make (0: no limit), and
    /// the burst above it.
    pub broker_rate: f64,
    pub broker_burst: f64,
    /// Relay sessions end this long after they opened, busy or not.
    pub max_session: std::time::Duration,
    /// Most sessions one principal may have open (gateways' and the
    /// relay's); the broker refuses past it, the relay too. 0: no limit.
    pub max_sessions_per_principal: usize,
    /// How long a connection to a node's relay endpoint is kept ready for
    /// the node's next relay session (`relay_ready`); zero: none.
    pub relay_ready_keep: std::time::Duration,
    /// How long a resumable relay session whose client went away waits for
    /// a resume (`otherix_proto::resume`); zero: relay sessions do not
    /// resume.
    pub relay_resume_grace: std::time::Duration,
    /// Most bytes each end of a resumable relay session keeps
    /// unacknowledged.
    pub relay_resume_buffer: usize,
}

/// API tokens live 90 days unless `--token-ttl` or the request says.
pub const DEFAULT_TOKEN_TTL: time::Duration = time::Duration::days(90);

/// The longest an API token may be asked to live: ten years.
pub const MAX_TOKEN_TTL: time::Duration = time::Duration::days(3650);

impl Default for Settings {
    fn default() -> Self {
        Settings {
            node_timeout: time::Duration::seconds(10),
            mtu: 1450,
            key_rotation: time::Duration::hours(1),
            credential_ttl: otherix_core::credential::DEFAULT_TTL,
            token_ttl: DEFAULT_TOKEN_TTL,
            audit_retention: time::Duration::days(90),
            node_cert_validity: crate::pki::NODE_CERT_VALIDITY,
            max_drain: time::Duration::hours(12),
            broker_rate: 500.0,
            broker_burst: 1000.0,
            max_session: std::time::Duration::from_secs(12 * 3600),
            max_sessions_per_principal: 1000,
            relay_ready_keep: crate::relay_ready::KEEP,
            relay_resume_grace: otherix_proto::resume::DEFAULT_GRACE,
            relay_resume_buffer: otherix_proto::resume::DEFAULT_BUFFER,
        }
    }
}
