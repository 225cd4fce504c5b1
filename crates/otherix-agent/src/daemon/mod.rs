//! The node agent daemon (`otherix agent`): enroll, heartbeat, reconcile.
//!
//! ```text
//!            ┌──────────── every --heartbeat-interval (backoff 1 s → 10 s while down) ───┐
//!  start ──▶ identity ──▶ apply saved desired.json ──▶ heartbeat ──▶ save desired ──▶ reconcile
//!  (enroll once)                                          │ fails: keep last desired, reconcile anyway
//!                                      every 250 ms: supervise workloads (restart with backoff)
//! ```
//!
//! - [`Agent::start`] loads the node's identity from the data directory, or enrolls
//!   with the join token (DESIGN.md §4) and saves it. Nothing else happens before the
//!   node has an identity, so a bad token fails fast with the control plane's message.
//! - [`Agent::run`] heartbeats over mutual TLS and converges the node to each answer
//!   with a [`Reconciler`]. The control plane being unreachable is not an error: the
//!   node keeps its last desired state (also across an agent restart, from
//!   `desired.json`), one warning marks the outage, and heartbeats retry with backoff.
//! - Between heartbeats the agent holds a desired-state wait open (`wake`): when the
//!   control plane answers that the node's desired state changed, it heartbeats at once.
//! - Roles are what an admin granted (join token, `otherix node update`), read from
//!   every desired state: while the gateway role is granted the agent runs the ingress
//!   gateway ([`gateway`]) at the granted address — from the start with a saved
//!   certificate, takes the session keys and overlay addresses from every answer, and
//!   reports the open sessions in every heartbeat; while a relay endpoint is granted
//!   (by default port 7444 on a hypervisor's VTEP) it serves the control plane's relay
//!   ([`relay`]) to guests on its bridges. Each serves with its own certificate
//!   ([`serving`]). A grant withdrawn stops the role; one given starts it, within a
//!   heartbeat. `--hypervisor`/`--gateway` only pin the roles: the control plane
//!   refuses the heartbeats of an agent pinned to roles it was not granted.
//! - The node's client certificate is renewed over mutual TLS once two thirds of its
//!   life have passed ([`Identity::renew`]).
//! - Shutdown (the future given to `run`) stops the loop and leaves guests and their
//!   workloads running: an agent upgrade or restart does not disturb them, and the
//!   next agent adopts them. Gateway sessions are the agent's own: they get the
//!   gateway's drain time, then end.
//!
//! The pure parts — interface names ([`names`]), desired state → specs ([`plan`]),
//! guest status ([`status`]), heartbeat backoff ([`backoff`]) — have no IO and are
//! unit-tested; the rest is tested end to end in namespaces.
//!
//! One agent per network namespace: the agent owns every link whose name starts with
//! `oxb`, `oxv`, `oxl` or `oxh` in its namespace. Guest namespaces are host-global, so
//! agents sharing a host may share a `netns_prefix`: an agent removes a guest
//! namespace only when the host end of the guest's veth is in its own namespace.

pub mod backoff;
mod error;
pub mod files;
pub mod gateway;
pub mod health;
pub mod host;
mod identity;
pub mod names;
pub mod plan;
mod reconcile;
pub mod relay;
pub mod reported;
pub mod serving;
pub mod status;
pub mod telemetry;
mod verify;
mod wake;
mod workloads;

use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::pin::Pin;
use std::time::Duration;

use otherix_client::Client;
use otherix_proto::agent::{DeltaError, DesiredState, Heartbeat, NodeRoles, SessionEvent, WHOLE_STATE_EVERY};
use tokio::time::{Instant, MissedTickBehavior};
use tracing::{debug, info, warn};

pub use backoff::{Heartbeats, RetryPolicy, Transition};
pub(crate) use error::one_line;
pub use error::DaemonError;
pub use host::{check_privileges, UnderlayError, VtepError};
pub use identity::Identity;
pub use plan::Underlay;
pub use reconcile::{own_exe_dir, Reconciler, ReconcilerConfig, Round, HANDOVER_PATIENCE, UNRECORDED_GRACE};

use crate::net::Netlink;
use crate::runtime::qemu::{image, AccelChoice, QemuConfig};
use crate::runtime::Backoff;

/// How long one heartbeat may take before it counts as failed.
const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(10);
/// How often workloads are checked between heartbeats.
const SUPERVISE_EVERY: Duration = Duration::from_millis(250);
/// How soon a heartbeat follows one whose round left a handover waiting for its target.
const HANDOVER_RETRY: Duration = Duration::from_millis(250);

/// How the control plane's CA is trusted at first enrollment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Trust {
    /// This PEM file is the cluster CA.
    CaFile(PathBuf),
    /// Whatever CA the server presents, if its fingerprint is this (`sha256:HEX`).
    Fingerprint(String),
}

/// Everything the agent is told at start. Validated once by [`Agent::start`].
#[derive(Clone)]
pub struct Config {
    /// Control plane URLs, `https://host:port`: one, or the replicas of
    /// one cluster (the agent heartbeats to the next when one stops
    /// answering).
    pub servers: Vec<String>,
    /// This node's name (a DNS label); the certificate carries it.
    pub node: otherix_core::NodeName,
    /// Join token; needed only while the node has no identity.
    pub join_token: Option<String>,
    /// Trust for the first contact; needed only while the node has no identity.
    pub trust: Option<Trust>,
    /// Roles pinned on the command line (`--hypervisor`, `--gateway`): sent in
    /// every heartbeat, which the control plane refuses unless they are exactly
    /// what was granted. `None`: run whatever was granted.
    pub roles: Option<NodeRoles>,
    /// Identity, last desired state and workload logs (see [`files`]).
    pub data_dir: PathBuf,
    /// VXLAN tunnel endpoint; default: the local address of the route to the CP.
    pub vtep: Option<Ipv4Addr>,
    pub heartbeat_interval: Duration,
    /// With the gateway role: longest credential lifetime (`exp` less the
    /// earlier of `iat` and `nbf`) the gateway accepts
    /// (`--max-credential-lifetime`).
    pub max_credential_lifetime: Duration,
    /// Gateway and relay sessions end this long after they opened
    /// (`--max-session`), busy or not.
    pub max_session: Duration,
    /// With the gateway role: most sessions one principal may have open
    /// through it (default 500, a twentieth of its connections; at most
    /// half); its replay-cache share is ten times this.
    pub gateway_max_sessions_per_principal: usize,
    /// With the gateway role: most connections it holds at once, in any
    /// stage (`--gateway-max-connections`, 10,000; past it `503`) ...
    pub gateway_max_connections: usize,
    /// ... and from one source address (`--gateway-max-connections-per-source`,
    /// 1,000; past it closed at once), so one host holding half-open
    /// handshakes cannot fill it.
    pub gateway_max_connections_per_source: usize,
    /// The relay endpoint's connections at once (`--relay-max-connections`,
    /// 10,000) ...
    pub relay_max_connections: usize,
    /// ... and from one source address — one control-plane replica —
    /// (`--relay-max-connections-per-source`, 5,000: any one leaves room for
    /// the others).
    pub relay_max_connections_per_source: usize,
    /// The gateway's and the relay endpoint's TLS handshakes must be done
    /// within this of the accept (`--handshake-timeout`, 5 s).
    pub handshake_timeout: Duration,
    /// Networks the relay endpoint accepts connections from besides its
    /// control planes' addresses (`--relay-allow-from`; for a control plane
    /// whose dials leave from another address than the one `--server`
    /// names: NAT, a second interface). Anything else is closed before its
    /// TLS handshake.
    pub relay_allow_from: Vec<otherix_ingress::relay::SourceNet>,
    /// Name prefix of guest network namespaces (`oxg` in production; unique per
    /// agent when several share a host, as in tests).
    pub netns_prefix: String,
    /// First entry of workloads' `PATH`; default: the agent's own directory.
    pub workload_path: Option<PathBuf>,
    /// Where the relay endpoint listens when one is granted ([`relay`]);
    /// `None`: at the granted address. `Off`: never, whatever the grant.
    pub relay: Option<relay::RelayListen>,
    /// Where `/metrics`, `/healthz` and `/readyz` are served, if anywhere.
    pub metrics_listen: Option<SocketAddr>,
    /// The QEMU runtime's accelerator: `Auto` picks KVM where it can run a
    /// stock guest kernel, TCG otherwise.
    pub qemu_accel: AccelChoice,
    /// Where guest images are kept and built (`None`: [`image::default_cache_dir`]).
    pub image_cache: Option<PathBuf>,
    /// The QEMU binary ([`QEMU`], looked up in `PATH`, normally).
    pub qemu_binary: PathBuf,
    /// Most bytes a second a QEMU guest's outgoing migration sends.
    pub qemu_migration_bandwidth: Option<u64>,
    /// Longest a QEMU guest stands still at an outgoing migration's
    /// switchover (QEMU's `downtime-limit`).
    pub qemu_migration_downtime: Duration,
    /// Floor of the retransmission timeout of the gateway's and the relay
    /// endpoint's connections to guests (`--guest-rto-min`;
    /// [`otherix_ingress::Limits::guest_rto_min`]); `None`: the kernel's.
    pub guest_rto_min: Option<Duration>,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The join token is a secret: say whether there is one, never what it is.
        f.debug_struct("Config")
            .field("servers", &self.servers)
            .field("node", &self.node)
            .field("join_token", &self.join_token.as_ref().map(|_| "<redacted>"))
            .field("trust", &self.trust)
            .field("roles", &self.roles)
            .field("data_dir", &self.data_dir)
            .field("vtep", &self.vtep)
            .field("heartbeat_interval", &self.heartbeat_interval)
            .field("max_credential_lifetime", &self.max_credential_lifetime)
            .field("max_session", &self.max_session)
            .field(
                "gateway_max_sessions_per_principal",
                &self.gateway_max_sessions_per_principal,
            )
            .field("gateway_max_connections", &self.gateway_max_connections)
            .field(
                "gateway_max_connections_per_source",
                &self.gateway_max_connections_per_source,
            )
            .field("relay_max_connections", &self.relay_max_connections)
            .field(
                "relay_max_connections_per_source",
                &self.relay_max_connections_per_source,
            )
            .field("handshake_timeout", &self.handshake_timeout)
            .field("relay_allow_from", &self.relay_allow_from)
            .field("netns_prefix", &self.netns_prefix)
            .field("workload_path", &self.workload_path)
            .field("relay", &self.relay)
            .field("metrics_listen", &self.metrics_listen)
            .finish()
    }
}

impl Config {
    /// The gateway's connection limits: the shared defaults with this
    /// agent's caps, handshake deadline and session bound.
    pub fn gateway_limits(&self) -> otherix_ingress::Limits {
        let mut limits = otherix_ingress::Limits::default();
        limits.max_session = self.max_session;
        limits.handshake_timeout = self.handshake_timeout;
        limits.max_connections = self.gateway_max_connections;
        limits.max_connections_per_source = self.gateway_max_connections_per_source;
        limits.guest_rto_min = self.guest_rto_min;
        limits
    }

    /// The relay endpoint's connection limits, likewise.
    pub fn relay_limits(&self) -> otherix_ingress::Limits {
        let mut limits = otherix_ingress::Limits::default();
        limits.max_session = self.max_session;
        limits.handshake_timeout = self.handshake_timeout;
        limits.max_connections = self.relay_max_connections;
        limits.max_connections_per_source = self.relay_max_connections_per_source;
        limits.guest_rto_min = self.guest_rto_min;
        limits
    }

    /// Checks everything that can be checked without the network.
    pub fn validate(&self) -> Result<(), DaemonError> {
        let bad = |m: String| Err(DaemonError::Config(m));
        if self.servers.is_empty() {
            return bad("--server names no control plane".into());
        }
        for server in &self.servers {
            if let Err(e) = otherix_client::Endpoint::parse(server) {
                return bad(e.to_string());
            }
        }
        if self.heartbeat_interval.is_zero() {
            return bad("--heartbeat-interval must be positive".into());
        }
        if !(Duration::from_secs(1)..=Duration::from_secs(24 * 3600)).contains(&self.max_credential_lifetime)
        {
            return bad("--max-credential-lifetime must be between 1s and 24h".into());
        }
        let prefix_ok = !self.netns_prefix.is_empty()
            && self.netns_prefix.len() <= 32
            && self
                .netns_prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !prefix_ok {
            return bad(format!(
                "invalid --netns-prefix {:?}: 1 to 32 letters, digits, '-' or '_'",
                self.netns_prefix
            ));
        }
        // A share above half the gateway's slots would let two principals
        // fill it (its replay share, ten times this, is then at most half of
        // its replay cache too).
        // The caps and deadlines of both servers, checked as they will run.
        for (server, limits) in [("gateway", self.gateway_limits()), ("relay", self.relay_limits())] {
            if let Err(e) = limits.validate(server) {
                return bad(e.to_string());
            }
        }
        let slots = self.gateway_max_connections;
        if !otherix_core::credential::share_fits(self.gateway_max_sessions_per_principal, slots) {
            return bad(format!(
                "--gateway-max-sessions-per-principal {} must be between 1 and {} (half of the gateway's {slots} connections); \
                 a principal that needs more should use several identities or a gateway of its own",
                self.gateway_max_sessions_per_principal,
                slots / 2
            ));
        }
        if let Some(gw) = self.roles.as_ref().and_then(|r| r.gateway.as_ref()) {
            if gw.parse::<std::net::SocketAddr>().is_err() {
                return bad(format!("invalid --gateway {gw:?}: expected IP:PORT"));
            }
        }
        Ok(())
    }
}

/// Descriptors an agent holds besides its gateway and relay connections
/// (netlink, its control-plane connections, logs, the metrics listener,
/// the runtime), with room to spare.
const FIXED_DESCRIPTORS: u64 = 256;

impl Config {
    /// Fits the gateway's and the relay endpoint's connection caps to an
    /// open-files limit of `nofile`: each of their connections holds two
    /// descriptors (the client's or the CP's, and the guest's), so caps
    /// above what the limit allows would fail with `Too many open files`
    /// before they engage. Shrinks both in proportion (and what depends on
    /// them: per-source caps, the per-principal share) and says what it
    /// did, or returns `None` when they fit.
    pub fn fit_to_descriptors(&mut self, nofile: u64) -> Option<String> {
        let usable = usize::try_from(nofile.saturating_sub(FIXED_DESCRIPTORS) / 2).unwrap_or(usize::MAX);
        let total = self
            .gateway_max_connections
            .saturating_add(self.relay_max_connections);
        if total <= usable {
            return None;
        }
        let scaled = |cap: usize| ((cap as u128 * usable as u128 / total.max(1) as u128) as usize).max(2);
        let (gateway, relay) = (
            scaled(self.gateway_max_connections),
            scaled(self.relay_max_connections),
        );
        let default_share = otherix_core::credential::default_share(self.gateway_max_connections);
        self.gateway_max_connections = gateway;
        self.gateway_max_connections_per_source = self.gateway_max_connections_per_source.min(gateway);
        self.relay_max_connections = relay;
        self.relay_max_connections_per_source = self.relay_max_connections_per_source.min(relay);
        // The default share (a twentieth of the cap) follows the cap. A
        // share the operator chose that no longer fits is cut to the most
        // that does (half the cap), as the per-source caps are cut to the
        // cap — not to the default's twentieth: the gateway's replay share
        // is ten times this, and at a twentieth one busy principal's new
        // connections were refused after a few thousand in five minutes.
        let share = self.gateway_max_sessions_per_principal;
        if share == default_share {
            self.gateway_max_sessions_per_principal = otherix_core::credential::default_share(gateway);
        } else if !otherix_core::credential::share_fits(share, gateway) {
            self.gateway_max_sessions_per_principal = (gateway / 2).max(1);
        }
        Some(format!(
            "open files limit {nofile}: gateway connections capped at {gateway} \
             ({} per source, {} per principal), relay at {relay} ({} per source); \
             raise LimitNOFILE for more",
            self.gateway_max_connections_per_source,
            self.gateway_max_sessions_per_principal,
            self.relay_max_connections_per_source
        ))
    }
}

/// An agent with an identity, ready to run.
#[derive(Debug)]
pub struct Agent {
    config: Config,
    identity: Identity,
    client: Client,
    enrolled_now: bool,
}

impl Agent {
    /// Validates `config`, then loads the node's identity or enrolls to get one.
    /// Fails with the control plane's message if it refuses the join token.
    pub async fn start(config: Config) -> Result<Agent, DaemonError> {
        config.validate()?;
        files::ensure_dir(&config.data_dir)?;
        let (identity, enrolled_now) = match identity::load(&config.data_dir, &config.node)? {
            Some(id) => {
                info!(node = %id.node, dir = %config.data_dir.display(), "reusing the saved node identity");
                (id, false)
            }
            None => (identity::enroll(&config).await?, true),
        };
        let client = identity.client(&config.servers)?;
        Ok(Agent {
            config,
            identity,
            client,
            enrolled_now,
        })
    }

    pub fn node(&self) -> &str {
        &self.identity.node
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Whether this start enrolled the node (rather than reusing its identity).
    pub fn enrolled_now(&self) -> bool {
        self.enrolled_now
    }

    /// Heartbeats and reconciles until `shutdown` completes. Guests keep running after.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), DaemonError> {
        let Agent {
            config,
            mut client,
            mut identity,
            ..
        } = self;
        if host::in_private_mount_namespace() {
            warn!(
                "the agent runs in a private mount namespace (started by `ip netns exec`?): guest \
                 namespaces it mounts are invisible to other tools and to a restarted agent; \
                 enter only the network namespace (e.g. `nsenter --net=/run/netns/NAME`)"
            );
        }
        let nl = Netlink::connect()?;
        // The relay's resumable sessions, shared with the reconciler.
        let relay_sessions = std::sync::Arc::new(otherix_ingress::relay::RelaySessions::default());
        let mut rec = Reconciler::new(
            nl.clone(),
            ReconcilerConfig {
                netns_prefix: config.netns_prefix.clone(),
                guest_dir: config.data_dir.join(files::GUESTS_DIR),
                workload_path: config.workload_path.clone().or_else(own_exe_dir),
                backoff: Backoff::default(),
                unrecorded_grace: UNRECORDED_GRACE,
                handover_patience: HANDOVER_PATIENCE,
                qemu: QemuConfig {
                    state_dir: config.data_dir.join("qemu"),
                    image_cache: config
                        .image_cache
                        .clone()
                        .unwrap_or_else(image::default_cache_dir),
                    accel: config.qemu_accel,
                    binary: config.qemu_binary.clone(),
                    migration_bandwidth: config.qemu_migration_bandwidth,
                    migration_downtime: config.qemu_migration_downtime,
                },
            },
        )?
        .with_relay_sessions(relay_sessions.clone());
        let mut sync = SyncState {
            config: &config,
            nl,
            vtep: config.vtep,
            desired: files::load_desired(&config.data_dir),
            want_whole: false,
            whole_at: None,
            verification: verify::Verification::default(),
        };
        if let Some(d) = &sync.desired {
            info!(
                version = d.version,
                "applying the saved desired state before the first heartbeat"
            );
        }
        sync.refresh_vtep().await;
        sync.reconcile(&mut rec).await;
        // LB health checks of this node's guests, rescheduled after every reconcile.
        let mut prober = health::Prober::new();
        prober.update(sync.desired.as_ref());
        let probe = telemetry::AgentProbe::new(config.heartbeat_interval);
        if let Some(addr) = config.metrics_listen {
            let bound = otherix_telemetry::spawn(addr, probe.clone())
                .await
                .map_err(|e| DaemonError::Config(format!("cannot listen for metrics on {addr}: {e}")))?;
            info!(addr = %bound, "metrics and health endpoints");
        }
        let mut gateway: Option<gateway::GatewayRole> = None;
        let mut relay: Option<relay::RelayRole> = None;
        follow_roles(
            &config,
            &identity,
            &sync,
            &mut gateway,
            &mut relay,
            &relay_sessions,
        )
        .await?;
        probe.set_gateway(gateway.as_ref().map(|g| g.gateway()));
        if let Some(r) = relay.as_mut() {
            r.after_heartbeat(None, sync.vtep).await;
        }

        let mut beats = Heartbeats::new(RetryPolicy::new(config.heartbeat_interval));
        let mut next_beat = Instant::now();
        let mut inflight: Option<InFlight> = None;
        // Session reports the heartbeat in flight carries: given back to the
        // gateway if it fails, so the next one carries them again.
        let mut reports_inflight: Vec<SessionEvent> = Vec::new();
        // Open sessions' byte counts in the heartbeat in flight.
        let mut bytes_inflight: Vec<otherix_proto::agent::SessionBytes> = Vec::new();
        // LB verdicts the CP acknowledged, and those the heartbeat in flight carries.
        let mut acked = health::Acked::default();
        let mut health_inflight = health::Outgoing::default();
        // Guest states likewise.
        let mut guests_acked = reported::Acked::default();
        let mut guests_inflight = reported::Outgoing::default();
        // Heartbeat at once when the control plane says the desired state changed.
        let mut wake = wake::Wake::new(client.clone());
        let mut last_beat = Instant::now();
        // The last answer changed the gateway's revocations: heartbeat again at once.
        let mut revocations_new = false;
        let mut supervise = tokio::time::interval(SUPERVISE_EVERY);
        supervise.set_missed_tick_behavior(MissedTickBehavior::Skip);
        // An outgoing QEMU migration ended: heartbeat (and run a round) at once.
        let qemu_events = rec.qemu().events();
        tokio::pin!(shutdown);

        loop {
            tokio::select! {
                () = &mut shutdown => break,
                result = async { inflight.as_mut().expect("guarded by is_some").await }, if inflight.is_some() => {
                    inflight = None;
                    let answered = result.is_ok();
                    metrics::counter!("otherix_agent_heartbeats_total", "result" => if answered { "ok" } else { "failed" }).increment(1);
                    metrics::histogram!("otherix_agent_heartbeat_duration_seconds").record(last_beat.elapsed().as_secs_f64());
                    if answered {
                        probe.answered();
                    }
                    let reports = std::mem::take(&mut reports_inflight);
                    let bytes = std::mem::take(&mut bytes_inflight);
                    if let (false, Some(gw)) = (answered, gateway.as_ref()) {
                        gw.give_back_reports(reports);
                        gw.give_back_session_bytes(&bytes);
                    }
                    let verdicts = std::mem::take(&mut health_inflight);
                    let states = std::mem::take(&mut guests_inflight);
                    if answered {
                        acked.answered(verdicts, Instant::now());
                        guests_acked.answered(states, Instant::now());
                    }
                    let delay = match result {
                        Ok(desired) => {
                            let (delay, t) = beats.succeeded();
                            if let Transition::Recovered { failures } = t {
                                info!(server = %client.server(), failures, "control plane reachable again");
                            }
                            let version = desired.version;
                            let revocations_held = gateway.as_ref().and(sync.desired.as_ref()).map(|d| d.revocations.clone());
                            sync.accept(desired);
                            // A gateway that was just handed new revocations says so at
                            // once: the revoking call waits for Ready gateways to hold them.
                            revocations_new = revocations_held
                                .is_some_and(|held| sync.desired.as_ref().is_some_and(|d| d.revocations != held));
                            if identity.renewal_due(serving::unix_now()) {
                                match identity.renew(&client, &config.data_dir).await {
                                    Ok(renewed) => match renewed.client_like(&client) {
                                        Ok(c) => {
                                            identity = renewed;
                                            client = c;
                                            wake = wake::Wake::new(client.clone());
                                        }
                                        Err(e) => warn!(error = %e, "cannot use the renewed node certificate"),
                                    },
                                    Err(error) => warn!(%error, "cannot renew the node certificate; retrying after the next heartbeat"),
                                }
                            }
                            wake.watch(version);
                            delay
                        }
                        Err(error) => sync.heartbeat_failed(&mut beats, &error),
                    };
                    sync.reconcile(&mut rec).await;
                    prober.update(sync.desired.as_ref());
                    if answered {
                        follow_roles(&config, &identity, &sync, &mut gateway, &mut relay, &relay_sessions).await?;
                        probe.set_gateway(gateway.as_ref().map(|g| g.gateway()));
                    }
                    // After the reconcile, so the gateway never looks up a bridge not made yet.
                    if let Some(gw) = gateway.as_mut() {
                        match sync.desired.as_ref() {
                            Some(desired) if answered => gw.after_heartbeat(desired, &client).await,
                            // Serving needs no control plane once there is a certificate.
                            _ => gw.listen().await,
                        }
                    }
                    if let Some(r) = relay.as_mut() {
                        r.update(sync.desired.as_ref());
                        r.after_heartbeat(answered.then_some(&client), sync.vtep).await;
                    }
                    // A handover is reported at once: frames for the guest reach the
                    // target only after the control plane repoints the FDB entries.
                    // A handover waiting for its target retries soon, not a whole interval later.
                    let delay = if answered && (rec.handed_over_now() || std::mem::take(&mut revocations_new)) {
                        Duration::ZERO
                    } else if answered && rec.handover_waiting() {
                        delay.min(HANDOVER_RETRY)
                    } else {
                        delay
                    };
                    next_beat = Instant::now() + delay;
                }
                () = wake.changed() => if inflight.is_none() {
                    next_beat = wake::woken_beat(Instant::now(), last_beat);
                },
                // Kept while a heartbeat is in flight (the branch is off then,
                // and `Notify` holds the wake for the next turn). A round
                // first, with the state held: a migration that failed past
                // its switchover has its forward taken away without waiting
                // for the control plane; one that completed is reported by
                // the heartbeat right after.
                () = qemu_events.notified(), if inflight.is_none() => {
                    sync.reconcile(&mut rec).await;
                    next_beat = Instant::now();
                },
                () = tokio::time::sleep_until(next_beat), if inflight.is_none() => {
                    last_beat = Instant::now();
                    sync.refresh_vtep().await;
                    match sync.vtep {
                        Some(vtep) => {
                            let mut hb = heartbeat(&config, vtep, &rec, &prober, gateway.as_ref());
                            // A short answer only when what we applied is what we hold;
                            // a change against it, unless the whole state is due.
                            hb.accepts_unchanged = !sync.want_whole
                                && sync.desired.as_ref().map(|d| d.version) == hb.applied_version;
                            hb.accepts_delta = hb.accepts_unchanged
                                && (sync.verification.verified || sync.whole_at.is_some_and(|t| t.elapsed() < WHOLE_STATE_EVERY));
                            hb.accepts_guest_changes = hb.accepts_delta;
                            // Only the guest states the CP does not hold yet.
                            let states = guests_acked.outgoing(std::mem::take(&mut hb.guests), sync.desired.as_ref(), Instant::now());
                            hb.guests.clone_from(&states.statuses);
                            guests_inflight = states;
                            reports_inflight = hb.session_events.clone();
                            bytes_inflight = hb.session_bytes.clone();
                            // Only the verdicts the CP does not hold yet.
                            let out = acked.outgoing(std::mem::take(&mut hb.health), Instant::now());
                            hb.health.clone_from(&out.reports);
                            hb.health_changes_only = !out.whole;
                            health_inflight = out;
                            let client = client.clone();
                            inflight = Some(Box::pin(async move {
                                match tokio::time::timeout(HEARTBEAT_TIMEOUT, client.heartbeat(&hb)).await {
                                    Ok(answer) => Ok(answer?),
                                    Err(_) => Err(HeartbeatError::NoAnswer(HEARTBEAT_TIMEOUT)),
                                }
                            }));
                        }
                        None => {
                            let delay = sync.heartbeat_failed(&mut beats, &HeartbeatError::VtepUnknown);
                            sync.reconcile(&mut rec).await;
                            next_beat = Instant::now() + delay;
                        }
                    }
                }
                _ = supervise.tick() => rec.supervise(std::time::Instant::now()),
            }
        }
        info!(node = %config.node, "agent stopping; guests keep running");
        if let Some(r) = relay {
            r.stop().await;
        }
        if let Some(mut gw) = gateway {
            // A heartbeat cut short may or may not have delivered its reports;
            // the CP records each session once, so they go again.
            gw.give_back_reports(std::mem::take(&mut reports_inflight));
            gw.stop().await;
            // The sessions that drained: their ends go to the audit trail now,
            // not as "gateway restarted" after the next start.
            if let Some(vtep) = sync.vtep {
                let hb = heartbeat(&config, vtep, &rec, &prober, Some(&gw));
                if !hb.session_events.is_empty() {
                    match tokio::time::timeout(FINAL_HEARTBEAT_TIMEOUT, client.heartbeat(&hb)).await {
                        Ok(Ok(_)) => info!(
                            reports = hb.session_events.len(),
                            "last session reports delivered"
                        ),
                        Ok(Err(e)) => {
                            warn!(error = %e, reports = hb.session_events.len(), "last session reports not delivered")
                        }
                        Err(_) => warn!(
                            reports = hb.session_events.len(),
                            "last session reports not delivered in time"
                        ),
                    }
                }
            }
        }
        Ok(())
    }
}

/// Starts and stops the gateway and relay roles to follow what is granted
/// (the latest desired state; pinned roles win for the gateway until the
/// control plane's answer says otherwise — it refuses a pinned agent whose
/// pins differ from the grant).
async fn follow_roles(
    config: &Config,
    identity: &Identity,
    sync: &SyncState<'_>,
    gateway: &mut Option<gateway::GatewayRole>,
    relay: &mut Option<relay::RelayRole>,
    relay_sessions: &std::sync::Arc<otherix_ingress::relay::RelaySessions>,
) -> Result<(), DaemonError> {
    let granted = sync.desired.as_ref().map(|d| d.roles.clone()).unwrap_or_default();
    let want_gateway: Option<SocketAddr> = match &config.roles {
        Some(pinned) => pinned.gateway.as_deref(),
        None => granted.gateway.as_deref(),
    }
    .and_then(servable);
    if gateway.as_ref().map(|g| g.address()) != want_gateway {
        if let Some(mut old) = gateway.take() {
            info!(addr = %old.address(), "gateway role withdrawn or moved; draining its sessions");
            // Draining takes up to the drain timeout: not in the sync loop.
            tokio::spawn(async move { old.stop().await });
        }
        if let Some(listen) = want_gateway {
            info!(addr = %listen, "gateway role granted");
            *gateway = Some(
                gateway::GatewayRole::start(
                    listen,
                    config,
                    &identity.ca_pem,
                    sync.nl.clone(),
                    sync.desired.as_ref(),
                )
                .await?,
            );
        }
    }
    let want_relay: Option<SocketAddr> = match config.relay {
        Some(relay::RelayListen::Off) => None,
        _ => granted.relay.as_deref().and_then(servable),
    };
    if relay.as_ref().map(|r| r.granted()) != want_relay {
        if let Some(old) = relay.take() {
            info!(addr = %old.granted(), "relay endpoint withdrawn or moved");
            old.stop().await;
        }
        if let Some(granted) = want_relay {
            info!(addr = %granted, "relay endpoint granted");
            *relay = Some(relay::RelayRole::start(
                config.relay,
                granted,
                identity,
                &config.data_dir,
                sync.desired.as_ref(),
                config.relay_limits(),
                &config.servers,
                config.relay_allow_from.clone(),
                relay_sessions.clone(),
            ));
        }
    }
    Ok(())
}

/// A granted address the agent will serve on: a concrete unicast `IP:PORT`
/// (the control plane validates grants; this is the agent's own check).
fn servable(addr: &str) -> Option<SocketAddr> {
    match addr.parse::<SocketAddr>() {
        Ok(a) if !a.ip().is_unspecified() && !a.ip().is_multicast() && a.port() != 0 => Some(a),
        _ => {
            warn!(addr, "ignoring a granted address that is no unicast IP:PORT");
            None
        }
    }
}

/// How long a stopping agent tries to deliver its last session reports.
const FINAL_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(3);

/// This node's heartbeat now. Takes the gateway's queued session reports.
fn heartbeat(
    config: &Config,
    vtep: Ipv4Addr,
    rec: &Reconciler,
    prober: &health::Prober,
    gateway: Option<&gateway::GatewayRole>,
) -> Heartbeat {
    Heartbeat {
        node: config.node.to_string(),
        roles: config.roles.clone(),
        vtep: vtep.to_string(),
        applied_version: rec.applied_version(),
        guests: rec.statuses(),
        sessions: gateway.map(|g| g.sessions()).unwrap_or_default(),
        health: prober.reports(),
        // Live migration: where a source may hand guests over to, and the
        // handovers this node made.
        netns: host::own_netns_name(),
        ready_overlays: rec.ready_networks(),
        migrations: rec.migrations(),
        incoming: rec.incoming(),
        session_epoch: gateway.map(|g| g.epoch().to_owned()),
        session_events: gateway.map(|g| g.take_reports()).unwrap_or_default(),
        session_bytes: gateway.map(|g| g.take_session_bytes()).unwrap_or_default(),
        version: env!("CARGO_PKG_VERSION").to_owned(),
        // Set by the caller, which knows what state it holds.
        accepts_unchanged: false,
        accepts_delta: false,
        accepts_guest_changes: false,
        health_changes_only: false,
        reads_one_session_revocations: true,
    }
}

/// A heartbeat on its way: the desired state, or why there is none.
type InFlight = Pin<Box<dyn Future<Output = Result<DesiredState, HeartbeatError>> + Send>>;

/// Why a heartbeat brought no desired state (the node keeps its last one and
/// retries with backoff): the control plane unreachable, slow or refusing,
/// or this node not knowing its own VTEP yet.
#[derive(Debug, thiserror::Error)]
enum HeartbeatError {
    #[error(transparent)]
    ControlPlane(#[from] otherix_client::ClientError),
    #[error("no answer within {0:?}")]
    NoAnswer(Duration),
    #[error("this node's VTEP address is unknown (no route to the control plane?); pass --vtep")]
    VtepUnknown,
}

/// The sync loop's state between rounds.
struct SyncState<'a> {
    config: &'a Config,
    nl: Netlink,
    vtep: Option<Ipv4Addr>,
    desired: Option<DesiredState>,
    /// Ask for the whole desired state, not an `unchanged` answer.
    want_whole: bool,
    /// When the last whole state came (deltas are taken against a state
    /// not verified only for [`WHOLE_STATE_EVERY`]).
    whole_at: Option<Instant>,
    /// Whether the state held is the one the control plane meant.
    verification: verify::Verification,
}

impl SyncState<'_> {
    /// Re-learns the default VTEP (the route to the CP can change).
    async fn refresh_vtep(&mut self) {
        if self.config.vtep.is_some() {
            return;
        }
        match host::route_source_to(&self.config.servers).await {
            Ok(ip) => {
                if self.vtep != Some(ip) {
                    info!(vtep = %ip, "VTEP address (route source towards the control plane)");
                }
                self.vtep = Some(ip);
            }
            Err(error) => debug!(%error, "cannot determine the VTEP address now"),
        }
    }

    /// A desired state from the control plane: keep it, and save it when it
    /// changed. An `unchanged` answer keeps the one we hold — if it is the
    /// version the control plane named; otherwise the next heartbeat asks
    /// for the whole state.
    fn accept(&mut self, desired: DesiredState) {
        if desired.unchanged {
            if self.desired.as_ref().is_none_or(|d| d.version != desired.version) {
                warn!(version = desired.version, "the control plane says our desired state is current, but we hold another; asking for the whole state");
                self.want_whole = true;
            }
            return;
        }
        let whole = desired.delta.is_none();
        let mut desired = if whole {
            self.whole_at = Some(Instant::now());
            desired
        } else {
            let applied = match self.desired.as_ref() {
                Some(held) => held.apply(&desired),
                None => Err(DeltaError::NotADelta),
            };
            match applied {
                Ok(next) => next,
                Err(error) => {
                    warn!(version = desired.version, %error, "cannot apply the control plane's change to our desired state; asking for the whole state");
                    self.want_whole = true;
                    return;
                }
            }
        };
        // The state held keeps no digest: it is checked here, once (a pass
        // over its entries).
        let named = desired.digest.take();
        let ours = if named.is_some() {
            desired.digest(self.vtep)
        } else {
            0
        };
        if let Some(named) = named {
            let same = named == ours;
            metrics::counter!("otherix_agent_state_digests_total", "answer" => if whole { "whole" } else { "delta" }, "result" => if same { "same" } else { "different" }).increment(1);
            if !same && whole {
                warn!(version = desired.version, named, ours, "the control plane's digest of our whole state is not ours (another version of the control plane?); taking it, and the whole state every few minutes while this lasts");
            }
        }
        if self.verification.check(whole, named, ours) == verify::Verdict::AskWhole {
            warn!(version = desired.version, named, ours, "the state built from the control plane's change is not the one it meant; asking for the whole state");
            self.want_whole = true;
            return;
        }
        self.want_whole = false;
        let changed = self.desired.as_ref().is_none_or(|d| *d != desired);
        if changed {
            info!(
                version = desired.version,
                overlays = desired.overlays.len(),
                bridges = desired.bridges.len(),
                guests = desired.guests.len(),
                "new desired state"
            );
            if let Err(e) = files::save_desired(&self.config.data_dir, &desired) {
                warn!(error = %e, "cannot save the desired state; a restart while the control plane is down would start empty");
            }
        }
        self.desired = Some(desired);
    }

    /// Logs a failed heartbeat (once per outage) and returns the delay to the retry.
    fn heartbeat_failed(&self, beats: &mut Heartbeats, error: &HeartbeatError) -> Duration {
        let (delay, t) = beats.failed();
        let version = self.desired.as_ref().map(|d| d.version);
        if t == Transition::OutageStarted {
            warn!(
                servers = ?self.config.servers,
                %error,
                ?version,
                "heartbeat failed; keeping the node on its last desired state and retrying"
            );
        } else {
            debug!(failures = beats.failures(), %error, ?delay, "heartbeat failed again");
        }
        delay
    }

    /// Converges to the desired state, if there is one yet. Before the first desired
    /// state nothing is touched: an agent that lost its `desired.json` must not tear
    /// down running guests before the control plane has said what it wants.
    async fn reconcile(&self, rec: &mut Reconciler) {
        let Some(desired) = &self.desired else {
            return;
        };
        let underlay = if desired.overlays.is_empty() {
            Err(UnderlayError::NoOverlay)
        } else {
            match self.vtep {
                Some(vtep) => host::find_underlay(&self.nl, vtep).await,
                None => Err(UnderlayError::VtepUnknown),
            }
        };
        let round = rec.apply(desired, &underlay).await;
        if round.errors > 0 {
            metrics::counter!("otherix_agent_reconcile_errors_total").increment(round.errors as u64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Config {
        Config {
            image_cache: None,
            qemu_binary: crate::runtime::qemu::QEMU.into(),
            qemu_migration_bandwidth: None,
            qemu_migration_downtime: crate::runtime::qemu::DEFAULT_MIGRATION_DOWNTIME,
            guest_rto_min: Some(otherix_ingress::DEFAULT_GUEST_RTO_MIN),
            qemu_accel: Default::default(),
            servers: vec!["https://127.0.0.1:7443".into()],
            node: "node1".parse().unwrap(),
            join_token: Some("otxj_secret".into()),
            trust: None,
            roles: Some(NodeRoles {
                hypervisor: true,
                gateway: None,
                relay: None,
            }),
            data_dir: "/tmp/x".into(),
            vtep: None,
            heartbeat_interval: Duration::from_secs(2),
            max_credential_lifetime: Duration::from_secs(900),
            max_session: Duration::from_secs(12 * 3600),
            gateway_max_sessions_per_principal: 500,
            gateway_max_connections: otherix_ingress::DEFAULT_MAX_CONNECTIONS,
            gateway_max_connections_per_source: otherix_ingress::DEFAULT_MAX_CONNECTIONS_PER_SOURCE,
            relay_max_connections: otherix_ingress::DEFAULT_MAX_CONNECTIONS,
            relay_max_connections_per_source: otherix_ingress::DEFAULT_MAX_CONNECTIONS / 2,
            handshake_timeout: otherix_ingress::DEFAULT_HANDSHAKE_TIMEOUT,
            relay_allow_from: Vec::new(),
            netns_prefix: "oxg".into(),
            workload_path: None,
            relay: None,
            metrics_listen: None,
        }
    }

    #[test]
    fn caps_fit_the_open_files_limit_and_the_fitted_config_is_valid() {
        let mut c = config();
        assert_eq!(
            c.fit_to_descriptors(1 << 20),
            None,
            "the defaults fit a large limit"
        );
        assert_eq!(c.gateway_max_connections, 10_000);
        // A service manager's default of 1,024: 384 connections in all.
        let said = c.fit_to_descriptors(1024).expect("fitted");
        assert_eq!(c.gateway_max_connections + c.relay_max_connections, 384);
        assert_eq!(c.gateway_max_connections, 192, "in proportion");
        assert!(c.gateway_max_connections_per_source <= c.gateway_max_connections);
        assert!(c.relay_max_connections_per_source <= c.relay_max_connections);
        assert!(c.gateway_max_sessions_per_principal * 2 <= c.gateway_max_connections);
        assert_eq!(
            c.gateway_max_sessions_per_principal, 9,
            "the default follows the cap"
        );
        assert!(
            said.contains("open files limit 1024") && said.contains("LimitNOFILE"),
            "{said}"
        );
        c.validate().expect("what was fitted starts");
        // Not even the fixed descriptors: the smallest caps, still valid.
        c.fit_to_descriptors(10);
        assert_eq!((c.gateway_max_connections, c.relay_max_connections), (2, 2));
        c.validate().expect("still starts");
    }

    #[test]
    fn a_per_principal_share_that_no_longer_fits_is_cut_to_the_most_that_does() {
        // 20,000 open files (a container's hard limit) and a share of 5,000
        // asked for: the gateway's cap falls to 4,936 and the share to half
        // of it, not to the default's twentieth.
        let mut c = config();
        c.gateway_max_sessions_per_principal = 5_000;
        c.fit_to_descriptors(20_000).expect("fitted");
        assert_eq!(c.gateway_max_connections, 4_936);
        assert_eq!(c.gateway_max_sessions_per_principal, 2_468);
        c.validate().expect("what was fitted starts");
        // The default (a twentieth of the cap) follows the cap.
        let mut c = config();
        c.fit_to_descriptors(20_000).expect("fitted");
        assert_eq!(c.gateway_max_sessions_per_principal, 246);
        // A share that still fits is kept as it was.
        let mut c = config();
        c.gateway_max_sessions_per_principal = 100;
        c.fit_to_descriptors(20_000).expect("fitted");
        assert_eq!(c.gateway_max_sessions_per_principal, 100);
    }

    #[test]
    fn a_valid_config_passes() {
        config().validate().unwrap();
    }

    #[test]
    fn bad_flags_are_refused_before_any_network() {
        type Mutate = fn(&mut Config);
        let cases: [(&str, Mutate); 9] = [
            ("https", |c| c.servers = vec!["http://127.0.0.1:7443".into()]),
            ("https", |c| c.servers.push("http://127.0.0.2:7443".into())),
            ("no control plane", |c| c.servers.clear()),
            ("heartbeat", |c| c.heartbeat_interval = Duration::ZERO),
            ("max-credential-lifetime", |c| {
                c.max_credential_lifetime = Duration::ZERO
            }),
            ("netns-prefix", |c| c.netns_prefix = "a/b".into()),
            ("gateway", |c| {
                c.roles.as_mut().unwrap().gateway = Some("gw:8443".into())
            }),
            (
                "--gateway-max-sessions-per-principal 5001 must be between 1 and 5000",
                |c| c.gateway_max_sessions_per_principal = 5001,
            ),
            ("--gateway-max-sessions-per-principal 0", |c| {
                c.gateway_max_sessions_per_principal = 0
            }),
        ];
        for (what, mutate) in cases {
            let mut c = config();
            mutate(&mut c);
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains(what), "{what}: {err}");
        }
    }

    #[test]
    fn the_join_token_never_shows_in_debug_output() {
        assert!(!format!("{:?}", config()).contains("otxj_secret"));
    }
}
