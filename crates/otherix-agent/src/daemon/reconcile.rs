//! Converges the node to a desired state: host rules, networks, then guests and their
//! workloads, then removal of whatever is ours and no longer desired.
//!
//! Level-triggered and idempotent: each round reads the kernel, fixes what differs
//! and leaves the rest, so it is safe to run after a crash, a restart, or a manual
//! change, and running it twice changes nothing the second time. One object failing
//! (a network, a guest) is logged and retried next round; it never stops the others.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use otherix_proto::agent::{
    DesiredState, GuestStatus, IncomingMigration, IncomingReady, MigrateTo, MigrationOutcome, MigrationReport,
};
use tracing::{debug, info, warn};

use super::error::one_line;
use super::host::UnderlayError;
use super::names::{HOST_VETH_PREFIX, LINK_PREFIXES, LINK_PREFIX_COMMON};
use super::plan::{forward_of, forwards, plan, PlanError, Underlay};
use super::status::{guest_status, qemu_status, NetView, WorkloadView};
use super::workloads::{GuestLauncher, Workloads};
use crate::filter::{Counters, HostFilter, HostRules, Outcome};
use crate::net::forward::{fmt_macs, ForwardError, Forwarder};
use crate::net::{Change, NetError, Netlink, Netns};
use crate::runtime::qemu::{Forward, Outgoing};
use crate::runtime::{
    Backoff, GuestInfo, GuestRuntime, NetnsRuntime, QemuConfig, QemuRuntime, RuntimeError, Workload,
};

/// Why a guest was not handed over to its target node (retried next round;
/// the reason goes to the control plane in the migration report).
#[derive(Debug, thiserror::Error)]
enum HandoverError {
    /// The guest cannot be planned here, so there is no veth to move.
    #[error(transparent)]
    Plan(PlanError),
    /// The target's namespace cannot be opened (the target node's agent
    /// has not reported it, or it went away).
    #[error(transparent)]
    Netns(#[from] NetError),
    /// Moving the veth failed.
    #[error(transparent)]
    Move(#[from] RuntimeError),
}

impl HandoverError {
    /// Whether the target only is not ready yet (its namespace or its bridge for
    /// the network is missing): nothing moved, and the target is expected to get
    /// there, e.g. a node that just lost its last guest of an overlay tears the
    /// bridge down and builds it again once the migration back makes it a member.
    fn target_not_ready(&self) -> bool {
        matches!(
            self,
            Self::Netns(_) | Self::Move(RuntimeError::TargetBridgeMissing { .. })
        )
    }
}

/// The usual [`ReconcilerConfig::handover_patience`]: how long a handover waits
/// for a target that is not ready before it reports the migration failed (and the
/// control plane rolls it back).
pub const HANDOVER_PATIENCE: Duration = Duration::from_secs(15);

/// How long a QEMU guest's migration stream may run before the source
/// cancels it (the guest keeps running on the source).
pub const QEMU_MIGRATION_TIMEOUT: Duration = Duration::from_secs(120);

/// How a [`Reconciler`] names and runs guests.
#[derive(Clone, Debug)]
pub struct ReconcilerConfig {
    /// Name prefix of guest namespaces. Agents on one host may share it: a guest
    /// namespace with it that the desired state does not name is deleted only if its
    /// veth's host end is in this agent's namespace (see `Reconciler::owns`).
    pub netns_prefix: String,
    /// Where workload logs (`{vm_id}.log`) and command records go.
    pub guest_dir: PathBuf,
    /// Put first in workloads' `PATH` (the agent's own directory, for `otherix guest`).
    pub workload_path: Option<PathBuf>,
    /// Workload restart policy.
    pub backoff: Backoff,
    /// How long a guest namespace may stay without its record before this agent
    /// takes it for a crash leftover and removes it ([`UNRECORDED_GRACE`] normally).
    /// Another agent sharing the prefix creates the namespace and writes the record
    /// in two steps: a namespace seen in between is being built, not left over.
    pub unrecorded_grace: Duration,
    /// How long a handover waits for a target that is not ready before it
    /// reports the migration failed ([`HANDOVER_PATIENCE`] normally).
    pub handover_patience: Duration,
    /// The QEMU runtime's directories and accelerator.
    pub qemu: QemuConfig,
}

/// What one round did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Round {
    /// Kernel objects created, changed or deleted.
    pub changes: usize,
    /// Objects that could not be converged (logged; retried next round).
    pub errors: usize,
}

impl Round {
    /// Counts what one guest's convergence did, and says what the guest's
    /// network looks like: ready, or failed with why (logged, retried next
    /// round). `what`: "guest", "QEMU guest".
    fn tally<C, E: std::error::Error>(
        &mut self,
        g: &crate::daemon::plan::GuestPlan,
        what: &str,
        done: Result<Vec<C>, E>,
    ) -> NetView {
        match done {
            Ok(changes) => {
                self.changes += changes.len();
                NetView::Ready
            }
            Err(e) => {
                self.errors += 1;
                let reason = one_line(&e);
                warn!(vm_id = %g.vm_id, vm = %g.name, error = %reason, "{what} not converged; retrying next round");
                NetView::Failed(reason)
            }
        }
    }
}

/// The node's reconciler: owns the guest runtime and the workloads.
pub struct Reconciler {
    node: Netlink,
    runtime: NetnsRuntime,
    /// QEMU guests (`GuestSpec::qemu`): VMs on taps, beside the namespaces.
    qemu: QemuRuntime,
    /// Desired guests that are QEMU guests.
    qemu_ids: BTreeSet<String>,
    workloads: Workloads,
    guest_dir: PathBuf,
    /// Desired guests (in desired order) with the outcome of their last `ensure`.
    guests: Vec<(String, NetView, bool)>,
    /// Networks (overlays and bridge networks) realized without error in the last
    /// round: a migration hands a guest over to this node only once it has its network.
    ready_networks: Vec<String>,
    /// The outcome of every handover the last desired state asked for.
    migrations: Vec<MigrationReport>,
    /// QEMU guests this node waits to receive, with their incoming port.
    incoming: Vec<IncomingReady>,
    /// Whether the last round moved a guest's veth (report it at once).
    handed_over_now: bool,
    /// Handovers waiting for a target that is not ready, since when.
    waiting_for_target: BTreeMap<String, Instant>,
    applied: Option<u64>,
    /// Guest namespaces without a record, with when this agent first saw them so.
    unrecorded: BTreeMap<String, Instant>,
    unrecorded_grace: Duration,
    handover_patience: Duration,
    /// The node's packet filter (its nftables table).
    filter: HostFilter,
    /// The filter's drop counters as last read.
    dropped: Counters,
    /// The relay's resumable sessions: a guest handed over to another node
    /// moves only once they went ahead of it ([`RELAY_SETTLE`] at most).
    relay_sessions: Option<std::sync::Arc<otherix_ingress::relay::RelaySessions>>,
    /// Puts in and takes away the forwarding of frames for guests that left.
    forwarder: Forwarder,
    /// Per overlay VXLAN device with our `clsact` qdisc, the MACs it
    /// forwards (none yet: made ready for a handover).
    forwarding: BTreeMap<String, BTreeSet<[u8; 6]>>,
    /// Whether a round cleared what a previous run of the agent may have
    /// left on the overlay devices (the first round does).
    forwarding_cleared: bool,
}

/// How long a handover waits for the guest's relay sessions to go ahead of
/// it to the target (each hands its frozen connection over through the
/// control plane that carries it) before the guest moves anyway.
pub const RELAY_SETTLE: Duration = Duration::from_secs(10);

/// The usual [`ReconcilerConfig::unrecorded_grace`].
pub const UNRECORDED_GRACE: Duration = Duration::from_secs(30);

impl Reconciler {
    /// A reconciler working in the namespace of `node` (the agent's own, normally).
    pub fn new(node: Netlink, config: ReconcilerConfig) -> Result<Self, RuntimeError> {
        let runtime = NetnsRuntime::new(node.clone(), config.netns_prefix)?;
        let qemu = QemuRuntime::new(node.clone(), config.qemu);
        let filter = HostFilter::new(node.netns().map(str::to_owned));
        let forwarder = Forwarder::new(node.clone());
        let launcher = GuestLauncher::new(config.workload_path.as_deref());
        Ok(Self {
            node,
            runtime,
            qemu,
            qemu_ids: BTreeSet::new(),
            workloads: Workloads::new(launcher, config.backoff),
            guest_dir: config.guest_dir,
            guests: Vec::new(),
            ready_networks: Vec::new(),
            migrations: Vec::new(),
            incoming: Vec::new(),
            handed_over_now: false,
            waiting_for_target: BTreeMap::new(),
            applied: None,
            unrecorded: BTreeMap::new(),
            unrecorded_grace: config.unrecorded_grace,
            handover_patience: config.handover_patience,
            filter,
            dropped: Counters::default(),
            relay_sessions: None,
            forwarder,
            forwarding: BTreeMap::new(),
            forwarding_cleared: false,
        })
    }

    /// This reconciler sharing `sessions` with the relay endpoint: it tells
    /// them which guests are being handed over, and moves a guest only once
    /// its sessions went ahead of it.
    pub fn with_relay_sessions(
        mut self,
        sessions: std::sync::Arc<otherix_ingress::relay::RelaySessions>,
    ) -> Self {
        self.relay_sessions = Some(sessions);
        self
    }

    /// Converges to `desired`. `underlay` is where VXLAN leaves (needed by overlays).
    pub async fn apply(
        &mut self,
        desired: &DesiredState,
        underlay: &Result<Underlay, UnderlayError>,
    ) -> Round {
        let plan = plan(desired, underlay, self.runtime.prefix());
        let mut round = Round::default();
        let mut ready_networks = Vec::new();
        // Relay sessions to guests about to leave start going ahead of them.
        if let Some(sessions) = &self.relay_sessions {
            sessions.set_handovers(otherix_ingress::relay::handovers(desired));
        }

        // Guests that moved to another node first, before anything slower
        // (the packet filter runs a program): frames for them reach the node
        // they left until their FDB entry follows.
        for o in &plan.overlays {
            if let Ok(spec) = &o.spec {
                match self.node.repoint_fdb(&spec.vxlan, &spec.desired_fdb()).await {
                    Ok(changes) => round.changes += changes.len(),
                    Err(e) => {
                        debug!(network = %o.network, error = %one_line(&e), "fdb not repointed ahead; the overlay's round does it")
                    }
                }
            }
        }

        // The drop counters first: reading them also finds a table someone
        // removed, which this round then puts back.
        self.read_filter_counters().await;
        // Host rules before any network: a bridge is never up without them. They
        // match our devices by prefix, so they hold for links still to be made.
        if !plan.is_empty() {
            self.converge_filter(Some(&plan.host_rules), &mut round).await;
        }

        for o in &plan.overlays {
            let result = match &o.spec {
                Ok(spec) => self.node.reconcile_overlay(spec).await.map_err(|e| one_line(&e)),
                Err(reason) => Err(one_line(reason)),
            };
            match result {
                Ok(changes) => {
                    round.changes += changes.len();
                    ready_networks.push(o.network.clone());
                }
                Err(error) => {
                    round.errors += 1;
                    warn!(network = %o.network, kind = "overlay", %error, "network not converged; retrying next round");
                }
            }
        }
        for b in &plan.bridges {
            let result = match &b.spec {
                Ok(spec) => self
                    .node
                    .reconcile_bridge_network(spec)
                    .await
                    .map_err(|e| one_line(&e)),
                Err(reason) => Err(one_line(reason)),
            };
            match result {
                Ok(changes) => {
                    round.changes += changes.len();
                    ready_networks.push(b.network.clone());
                }
                Err(error) => {
                    round.errors += 1;
                    warn!(network = %b.network, kind = "bridge", %error, "network not converged; retrying next round");
                }
            }
        }

        // Guests already on the node, with the processes running in them.
        let existing: Option<Vec<GuestInfo>> = match self.runtime.list().await {
            Ok(list) => Some(list),
            Err(e) => {
                round.errors += 1;
                warn!(error = %one_line(&e), "cannot list guests; workloads and removals wait for the next round");
                None
            }
        };
        let pids_of: BTreeMap<&str, &[i32]> = existing
            .iter()
            .flatten()
            .filter_map(|g| g.id.as_deref().map(|id| (id, g.pids.as_slice())))
            .collect();

        let handovers: BTreeMap<&str, &MigrateTo> = desired
            .guests
            .iter()
            .filter_map(|g| g.migrate_to.as_ref().map(|m| (g.vm_id.as_str(), m)))
            .collect();
        let incomings: BTreeMap<&str, &IncomingMigration> = desired
            .guests
            .iter()
            .filter_map(|g| g.incoming.as_ref().map(|i| (g.vm_id.as_str(), i)))
            .collect();
        let mut migrations = Vec::new();
        let mut incoming_reports = Vec::new();
        let mut handed_over_now = false;

        let now = Instant::now();
        let mut guests = Vec::with_capacity(plan.guests.len());
        let mut qemu_ids = BTreeSet::new();
        for g in &plan.guests {
            if let Ok(spec @ crate::runtime::GuestSpec { qemu: Some(q), .. }) = &g.spec {
                qemu_ids.insert(g.vm_id.clone());
                if let Some(inc) = incomings.get(g.vm_id.as_str()) {
                    // A migration's target: an incoming QEMU waits for the stream.
                    let outcome = match underlay {
                        Ok(u) => {
                            let from = super::plan::source_vtep(desired, &g.vm_id);
                            self.qemu.ensure_incoming(spec, q, &inc.key.0, u.vtep, from).await
                        }
                        Err(e) => Err(RuntimeError::Qemu {
                            id: g.vm_id.clone(),
                            reason: format!("no underlay to receive on: {}", one_line(e)),
                        }),
                    };
                    let net = match outcome {
                        Ok((changes, port)) => {
                            round.changes += changes.len();
                            if let Some(port) = port {
                                // Said at once: the source streams only once the CP knows it.
                                handed_over_now |= !changes.is_empty();
                                incoming_reports.push(IncomingReady {
                                    vm_id: g.vm_id.clone(),
                                    migration: inc.migration.clone(),
                                    port,
                                });
                            }
                            NetView::Ready
                        }
                        Err(e) => {
                            round.errors += 1;
                            let reason = one_line(&e);
                            warn!(vm_id = %g.vm_id, vm = %g.name, from = %inc.from, error = %reason, "cannot receive the QEMU guest");
                            NetView::Failed(reason)
                        }
                    };
                    guests.push((g.vm_id.clone(), net, false));
                    continue;
                }
                if let Some(to) = handovers.get(g.vm_id.as_str()) {
                    // A migration's source: QEMU streams the guest to the target's.
                    let forward = forward_of(desired, &g.vm_id).map(|(device, mac)| Forward {
                        forwarder: self.forwarder.clone(),
                        device,
                        mac,
                    });
                    let outcome = match &to.qemu {
                        None => Ok(Outgoing::Active("waiting for the target's incoming QEMU".into())),
                        Some(m) => {
                            self.qemu
                                .migrate_out(
                                    &g.vm_id,
                                    &m.migration,
                                    &m.address,
                                    &m.key.0,
                                    QEMU_MIGRATION_TIMEOUT,
                                    forward,
                                    underlay.as_ref().ok().map(|u| u.vtep),
                                )
                                .await
                        }
                    };
                    // Pinned while under way; once it ended, the round's own
                    // convergence keeps it (moved) or takes it away (failed).
                    if matches!(outcome, Ok(Outgoing::Completed | Outgoing::Failed(_))) {
                        self.end_switchover(&g.vm_id).await;
                    }
                    match outcome {
                        Ok(Outgoing::Active(status)) => {
                            debug!(vm_id = %g.vm_id, to = %to.node, %status, "QEMU migration under way");
                            self.waiting_for_target.entry(g.vm_id.clone()).or_insert(now);
                        }
                        Ok(Outgoing::Completed) => {
                            self.waiting_for_target.remove(&g.vm_id);
                            handed_over_now = true;
                            migrations.push(migration(&g.vm_id, None));
                        }
                        Ok(Outgoing::Failed(reason)) => {
                            self.waiting_for_target.remove(&g.vm_id);
                            round.errors += 1;
                            migrations.push(migration(&g.vm_id, Some(reason)));
                        }
                        Err(e) => {
                            self.waiting_for_target.remove(&g.vm_id);
                            round.errors += 1;
                            let reason = one_line(&e);
                            warn!(vm_id = %g.vm_id, to = %to.node, error = %reason, "QEMU migration failed");
                            migrations.push(migration(&g.vm_id, Some(reason)));
                        }
                    }
                    guests.push((g.vm_id.clone(), NetView::Ready, false));
                    continue;
                }
                // A migration rolled back: its switchover ends before `ensure`
                // cancels it, so that no forward lands after.
                self.end_switchover(&g.vm_id).await;
                let net = round.tally(g, "QEMU guest", self.qemu.ensure(spec, q).await);
                guests.push((g.vm_id.clone(), net, false));
                continue;
            }
            let spec = match (&g.spec, handovers.get(g.vm_id.as_str())) {
                (Ok(spec), None) => spec,
                (spec, Some(to)) => {
                    // Handed over (or being handed over) to another node: never start
                    // or stop its workload here again, and never recreate its veth.
                    self.workloads.release(&g.vm_id);
                    let outcome = match spec {
                        Ok(spec) => self.hand_over(spec, to, forward_of(desired, &g.vm_id)).await,
                        Err(reason) => Err(HandoverError::Plan(reason.clone())),
                    };
                    let (net, report) = match outcome {
                        Ok(moved) => {
                            self.waiting_for_target.remove(&g.vm_id);
                            handed_over_now |= moved;
                            (NetView::Ready, migration(&g.vm_id, None))
                        }
                        Err(e) if e.target_not_ready() && self.patient(&g.vm_id, now) => {
                            // Not a failure yet: the report stays out of the heartbeat
                            // (the control plane keeps waiting) and the next round retries.
                            round.errors += 1;
                            let reason = one_line(&e);
                            info!(vm_id = %g.vm_id, vm = %g.name, to = %to.node, %reason, "handover waits for its target");
                            guests.push((g.vm_id.clone(), NetView::Failed(reason), false));
                            continue;
                        }
                        Err(e) => {
                            self.waiting_for_target.remove(&g.vm_id);
                            round.errors += 1;
                            let reason = one_line(&e);
                            warn!(vm_id = %g.vm_id, vm = %g.name, to = %to.node, error = %reason, "guest not handed over; retrying next round");
                            (NetView::Failed(reason.clone()), migration(&g.vm_id, Some(reason)))
                        }
                    };
                    migrations.push(report);
                    guests.push((g.vm_id.clone(), net, false));
                    continue;
                }
                (Err(e), None) => {
                    round.errors += 1;
                    let reason = one_line(e);
                    warn!(vm_id = %g.vm_id, vm = %g.name, error = %reason, "guest cannot be realized");
                    guests.push((g.vm_id.clone(), NetView::Failed(reason), false));
                    continue;
                }
            };
            let net = round.tally(g, "guest", self.runtime.ensure(spec).await);
            let log = self.guest_dir.join(format!("{}.log", g.vm_id));
            let workload = Workload::for_guest(spec, log);
            // Start (or adopt) a workload only in a guest that is in place, and only
            // when we know what already runs there.
            if let (NetView::Ready, Some(w), Some(_)) = (&net, &workload, &existing) {
                let running = pids_of.get(g.vm_id.as_str()).copied().unwrap_or_default();
                self.workloads.ensure(w.clone(), &g.name, running, now);
            }
            guests.push((g.vm_id.clone(), net, workload.is_some()));
        }

        // Switchovers of QEMU guests no longer here at all (deleted in the
        // middle of their migration): their forward is not pinned any more.
        for id in self.qemu.switchovers() {
            if !qemu_ids.contains(&id) {
                self.end_switchover(&id).await;
            }
        }

        // Frames still arriving for guests that left go on to them: right
        // after a handover, before it is reported.
        let handed: BTreeSet<String> = migrations
            .iter()
            .filter(|r| r.outcome == MigrationOutcome::Moved)
            .map(|r| r.vm_id.clone())
            .collect();
        self.converge_forwards(&forwards(desired, &handed), &mut round)
            .await;

        // Removal: workloads, guests, then links that are ours and not desired.
        let with_workload: BTreeSet<&str> = plan
            .guests
            .iter()
            .filter(|g| g.spec.as_ref().map_or(true, |s| s.command.is_some()))
            .map(|g| g.vm_id.as_str())
            .collect();
        self.workloads.retain(&with_workload);
        let desired_ids = plan.guest_ids();
        let mut own_netns = None;
        if let Some(existing) = &existing {
            self.unrecorded.retain(|netns, _| {
                existing
                    .iter()
                    .any(|g| g.host_veth.is_none() && &g.netns == netns)
            });
        }
        for g in existing.iter().flatten() {
            if g.id.as_deref().is_some_and(|id| desired_ids.contains(id)) || !self.owns(g, now).await {
                continue;
            }
            if own_netns.is_none() {
                own_netns = Some(super::host::own_netns_name());
            }
            // A guest handed over to this node whose placement has not reached us
            // yet stays (its veth too: see `remove_stale_host_veths`).
            if let (Some(Some(me)), Some(_)) = (&own_netns, &g.host_veth) {
                if self.runtime.handed_to(&g.netns).await.ok().flatten().as_ref() == Some(me) {
                    debug!(vm_id = %g.id.as_deref().unwrap_or("?"), netns = %g.netns, "guest handed over to this node; waiting for its placement");
                    continue;
                }
            }
            match self.runtime.purge(g).await {
                Ok(changes) => {
                    info!(vm_id = %g.id.as_deref().unwrap_or("?"), netns = %g.netns, "guest removed");
                    round.changes += changes.len();
                }
                Err(e) => {
                    round.errors += 1;
                    warn!(netns = %g.netns, error = %one_line(&e), "stale guest not removed; retrying next round");
                }
            }
        }
        // QEMU guests no longer desired end (their taps go with them).
        match self.qemu.list() {
            Ok(found) => {
                for q in found.iter().filter(|q| !desired_ids.contains(q.id.as_str())) {
                    match self.qemu.remove(&q.id).await {
                        Ok(changes) => {
                            info!(vm_id = %q.id, "QEMU guest removed");
                            round.changes += changes.len();
                        }
                        Err(e) => {
                            round.errors += 1;
                            warn!(vm_id = %q.id, error = %one_line(&e), "stale QEMU guest not removed; retrying next round");
                        }
                    }
                }
            }
            Err(e) => {
                round.errors += 1;
                warn!(error = %one_line(&e), "cannot list QEMU guests; removals wait for the next round");
            }
        }
        let keep: Vec<&str> = plan.keep_links.iter().map(String::as_str).collect();
        for prefix in LINK_PREFIXES {
            let removed = if prefix == HOST_VETH_PREFIX {
                self.remove_stale_host_veths(&keep).await
            } else {
                self.node
                    .remove_stale(prefix, &keep)
                    .await
                    .map_err(RuntimeError::from)
            };
            match removed {
                Ok(changes) => round.changes += changes.len(),
                Err(e) => {
                    round.errors += 1;
                    warn!(prefix, error = %one_line(&e), "stale links not removed; retrying next round");
                }
            }
        }

        // Nothing desired: the table goes once no link of ours is left (a guest
        // handed over to this node hangs on its veth before its placement arrives).
        if plan.is_empty() {
            match self.node.links_with_prefix(LINK_PREFIX_COMMON).await {
                Ok(links) => {
                    let ours_left = links
                        .iter()
                        .any(|l| LINK_PREFIXES.iter().any(|p| l.name.starts_with(p)));
                    let rules = ours_left.then_some(&plan.host_rules);
                    self.converge_filter(rules, &mut round).await;
                }
                Err(e) => {
                    round.errors += 1;
                    warn!(error = %one_line(&e), "cannot list links; host rules stay until the next round");
                }
            }
        }

        self.waiting_for_target
            .retain(|id, _| handovers.contains_key(id.as_str()));
        self.guests = guests;
        self.qemu_ids = qemu_ids;
        self.incoming = incoming_reports;
        self.ready_networks = ready_networks;
        self.migrations = migrations;
        self.handed_over_now = handed_over_now;
        if round.errors == 0 {
            self.applied = Some(desired.version);
        }
        if round.changes > 0 || round.errors > 0 {
            info!(
                version = desired.version,
                changes = round.changes,
                errors = round.errors,
                "reconciled"
            );
        } else {
            debug!(version = desired.version, "already converged");
        }
        round
    }

    /// Makes each overlay device forward exactly the MACs `want` says
    /// ([`crate::net::forward`]). Only what changed since the last round
    /// goes to the kernel; a failure is logged and retried next round, and does
    /// not hold the round back: the forwarding only spares a retransmission.
    async fn converge_forwards(&mut self, want: &BTreeMap<String, BTreeSet<[u8; 6]>>, round: &mut Round) {
        let first = !self.forwarding_cleared;
        self.forwarding_cleared = true;
        let held = &mut self.forwarding;
        // A device no longer wanted goes with its overlay, and its rules too.
        held.retain(|dev, macs| {
            let kept = want.contains_key(dev);
            if !kept && !macs.is_empty() {
                info!(device = %dev, "forwarding for guests that left ended with the overlay");
            }
            kept
        });
        for (dev, macs) in want {
            // What a QEMU guest's switchover pinned is in the kernel too, and
            // stays whatever is asked (`Forwarder::pin`).
            let pinned = self.forwarder.pinned(dev);
            let before = match held.get(dev) {
                Some(b) => Some(b | &pinned),
                None if !pinned.is_empty() => Some(pinned.clone()),
                None => None,
            };
            let target = macs | &pinned;
            // No qdisc is wanted without MACs; one made ready for a handover
            // that did not happen goes.
            let unchanged = match &before {
                None => target.is_empty(),
                Some(b) => !target.is_empty() && *b == target,
            };
            if !first && unchanged && !self.forwarder.unsure(dev) {
                continue;
            }
            let before = before.unwrap_or_default();
            match self.forwarder.converge(dev, macs).await {
                Ok(now) => {
                    if before != now {
                        round.changes += 1;
                        if now.is_empty() {
                            info!(device = %dev, "forwarding for guests that left ended");
                        } else {
                            info!(device = %dev, macs = %fmt_macs(&now), "forwarding frames for guests that left");
                        }
                    }
                    if now.is_empty() {
                        held.remove(dev);
                    } else {
                        held.insert(dev.clone(), now);
                    }
                }
                Err(e) if macs.is_empty() && matches!(e, ForwardError::Unsupported { .. }) => {
                    held.remove(dev);
                }
                Err(e) => {
                    // Retried next round: what is held stays as it was.
                    warn!(device = %dev, error = %one_line(&e), "frames for guests that left not forwarded");
                }
            }
        }
    }

    /// Makes the node's table enforce `rules`, or removes it (`None`).
    async fn converge_filter(&mut self, rules: Option<&HostRules>, round: &mut Round) {
        let result = match rules {
            Some(rules) => self.filter.ensure(rules).await.map(|(outcome, unsafe_names)| {
                if outcome == Outcome::Written {
                    for name in unsafe_names {
                        warn!(bridge = %name.escape_default(), "bridge name is no safe nft string; its network gets no allowance in the host rules");
                    }
                }
                outcome
            }),
            None => self.filter.remove().await,
        };
        match result {
            Ok(Outcome::Unchanged) => {}
            Ok(Outcome::Written) => {
                round.changes += 1;
                if let Some(r) = rules {
                    info!(
                        vteps = r.vteps.len(),
                        bridges = r.bridges.len(),
                        "host rules applied"
                    );
                }
            }
            Ok(Outcome::Removed) => {
                round.changes += 1;
                info!("host rules removed: nothing of ours left on the node");
            }
            Err(e) => {
                round.errors += 1;
                warn!(error = %one_line(&e), "host rules not converged; retrying next round");
            }
        }
    }

    /// Reads the host rules' drop counters into the metrics, and logs what they
    /// counted since the last round.
    async fn read_filter_counters(&mut self) {
        let (total, grew) = match self.filter.counters().await {
            Ok(Some(read)) => read,
            Ok(None) => return,
            Err(e) => {
                debug!(error = %one_line(&e), "host rule counters not read");
                return;
            }
        };
        self.dropped = total;
        metrics::counter!("otherix_agent_vxlan_dropped_total").absolute(total.vxlan_dropped);
        metrics::counter!("otherix_agent_guest_dropped_total", "to" => "node")
            .absolute(total.guest_to_node_dropped);
        metrics::counter!("otherix_agent_guest_dropped_total", "to" => "other_network")
            .absolute(total.guest_between_networks_dropped);
        if grew.vxlan_dropped > 0 {
            warn!(
                packets = grew.vxlan_dropped,
                total = total.vxlan_dropped,
                "dropped VXLAN from sources that are no VTEP of this node's overlays"
            );
        }
        if grew.guest_to_node_dropped > 0 {
            info!(
                packets = grew.guest_to_node_dropped,
                total = total.guest_to_node_dropped,
                "dropped guests' packets to the node's own addresses"
            );
        }
        if grew.guest_between_networks_dropped > 0 {
            info!(
                packets = grew.guest_between_networks_dropped,
                total = total.guest_between_networks_dropped,
                "dropped guests' packets routed towards another network"
            );
        }
    }

    /// The host rules' drop counters as the last round read them (totals since
    /// this reconciler was made, plus what an adopted table held).
    pub fn dropped(&self) -> Counters {
        self.dropped
    }

    /// Whether a handover whose target is not ready may wait another round
    /// (for [`ReconcilerConfig::handover_patience`] from its first such round).
    fn patient(&mut self, vm_id: &str, now: Instant) -> bool {
        let since = *self.waiting_for_target.entry(vm_id.to_owned()).or_insert(now);
        now.saturating_duration_since(since) < self.handover_patience
    }

    /// Ends guest `id`'s QEMU switchover, if one is recorded: the forward it
    /// put in (pinned until now) is recorded as held, so that this round's
    /// convergence keeps it where the guest moved and takes it away where the
    /// guest runs here again.
    async fn end_switchover(&mut self, id: &str) {
        if let Some((device, mac)) = self.qemu.end_switchover(id).await {
            self.forwarding.entry(device).or_default().insert(mac);
        }
    }

    /// Live migration, source side: moves the host end of the guest's veth into the
    /// target node's namespace and onto its overlay bridge. The guest's namespace, its
    /// workload and its TCP state stay as they are. Idempotent: a veth already in the
    /// target is only made sure of there. Returns whether anything changed.
    ///
    /// `forward` (the overlay device and MAC of the guest, see
    /// [`crate::net::forward`]): made ready before the move and put in the
    /// instant the veth has left, so what still arrives for the guest goes on to
    /// its target rather than waiting for a retransmission. A failure there only
    /// leaves it to the round's [`Reconciler::converge_forwards`].
    async fn hand_over(
        &mut self,
        spec: &crate::runtime::GuestSpec,
        to: &MigrateTo,
        forward: Option<(String, [u8; 6])>,
    ) -> Result<bool, HandoverError> {
        let ns = Netns::open(&to.netns)?;
        if let Some(sessions) = &self.relay_sessions {
            let left = sessions.settle(&spec.id, RELAY_SETTLE).await;
            if left > 0 {
                warn!(vm_id = %spec.id, sessions = left, "relay sessions did not go ahead of their guest in time; it moves anyway");
            }
        }
        let armed = match forward {
            // Only for a veth still here: one already gone was handed over (and
            // forwarded) in an earlier round.
            Some((device, mac)) if matches!(self.node.link(&spec.host_veth).await, Ok(Some(_))) => {
                match self.forwarder.arm(&device, mac).await {
                    Ok(armed) => {
                        // The qdisc is ours now, even if the move fails.
                        self.forwarding.entry(device).or_default();
                        Some(armed)
                    }
                    Err(e) => {
                        warn!(vm_id = %spec.id, %device, error = %one_line(&e), "forwarding for the guest not made ready; it follows the move later");
                        None
                    }
                }
            }
            _ => None,
        };
        let fired = std::cell::Cell::new(None);
        let on_moved = async || {
            if let Some(armed) = &armed {
                fired.set(Some(armed.fire().await));
            }
        };
        let moved = self.runtime.move_host_veth(spec, &ns, &to.bridge, on_moved).await;
        // Recorded even when the target's side then failed: the filter is in, and
        // the round's convergence takes it away while the guest is not reported
        // moved.
        if let (Some(armed), Some(fired)) = (armed, fired.into_inner()) {
            match fired {
                Ok(()) => {
                    let macs = self.forwarding.entry(armed.device().to_owned()).or_default();
                    macs.insert(armed.mac());
                    info!(device = %armed.device(), macs = %fmt_macs(macs), "forwarding frames for guests that left");
                }
                Err(e) => {
                    warn!(vm_id = %spec.id, device = %armed.device(), error = %one_line(&e), "frames for the guest not forwarded at its move; the round retries");
                }
            }
        }
        let changes = moved?;
        if !changes.is_empty() {
            info!(vm_id = %spec.id, to = %to.node, netns = %to.netns, bridge = %to.bridge, "guest handed over");
        }
        Ok(!changes.is_empty())
    }

    /// Whether a guest found under our prefix is this node's to remove.
    ///
    /// Namespaces are host-global, so agents sharing a host (the testbed, `otherix
    /// dev`) may share a prefix, and a migrated guest's namespace outlives its move:
    /// a guest belongs to the node whose namespace holds the host end of its veth.
    /// A namespace without a guest record (a crash between creating it and recording
    /// it) belongs to nobody; it is ours to clean up once nothing runs in it and it
    /// has stayed without a record for the configured grace (until then, another
    /// agent may be about to write the record).
    /// Deletes the host veths no desired guest names, except one whose guest was
    /// handed over to this node and waits for its placement. Its record is read
    /// link by link, now: a veth the source moved in after this round listed its
    /// guests is neither desired nor in that list, and deleting it would take the
    /// guest's `eth0` with it in the middle of its migration.
    async fn remove_stale_host_veths(&self, keep: &[&str]) -> Result<Vec<Change>, RuntimeError> {
        let mut changes = Vec::new();
        let mut me: Option<Option<String>> = None;
        for link in self.node.links_with_prefix(HOST_VETH_PREFIX).await? {
            if keep.contains(&link.name.as_str()) {
                continue;
            }
            if let Some(me) = me.get_or_insert_with(super::host::own_netns_name) {
                if self.runtime.arriving(&link.name, me).await? {
                    debug!(veth = %link.name, "veth handed over to this node; waiting for its guest's placement");
                    continue;
                }
            }
            if self.node.delete_link(&link.name).await? {
                changes.push(Change::LinkDeleted {
                    link: self.node.at(&link.name),
                });
            }
        }
        Ok(changes)
    }

    async fn owns(&mut self, g: &GuestInfo, now: Instant) -> bool {
        match &g.host_veth {
            Some(veth) => matches!(
                self.node.link(veth).await,
                Ok(Some(link)) if link.kind.as_deref() == Some("veth")
            ),
            None => {
                let first = *self.unrecorded.entry(g.netns.clone()).or_insert(now);
                g.pids.is_empty() && now.saturating_duration_since(first) >= self.unrecorded_grace
            }
        }
    }

    /// Restarts exited workloads whose backoff elapsed; checks adopted ones. Cheap:
    /// call it often (every few hundred ms) so restarts are not held to the heartbeat.
    pub fn supervise(&mut self, now: Instant) {
        self.workloads.tick(now);
    }

    /// The status of every desired guest, for the next heartbeat.
    pub fn statuses(&self) -> Vec<GuestStatus> {
        self.guests
            .iter()
            .map(|(id, net, has_workload)| {
                if self.qemu_ids.contains(id) {
                    return qemu_status(id, net, &self.qemu.view(id));
                }
                let w = if *has_workload {
                    self.workloads.view(id)
                } else {
                    WorkloadView::None
                };
                guest_status(id, net, &w)
            })
            .collect()
    }

    /// Networks realized without error in the last round (`Heartbeat.ready_overlays`,
    /// which names bridge networks too).
    pub fn ready_networks(&self) -> Vec<String> {
        self.ready_networks.clone()
    }

    /// Handovers asked for by the last desired state, with their outcome
    /// (`Heartbeat.migrations`); reported until the control plane stops asking.
    pub fn migrations(&self) -> Vec<MigrationReport> {
        self.migrations.clone()
    }

    /// QEMU guests this node waits to receive, with their ports
    /// (`Heartbeat.incoming`).
    pub fn incoming(&self) -> Vec<IncomingReady> {
        self.incoming.clone()
    }

    /// Whether the last round handed a guest over: until the control plane hears of
    /// it, frames for the guest still go to this node, so report it without waiting.
    pub fn handed_over_now(&self) -> bool {
        self.handed_over_now
    }

    /// Whether a handover waits for its target to get ready (retry soon).
    pub fn handover_waiting(&self) -> bool {
        !self.waiting_for_target.is_empty()
    }

    /// The version of the last desired state applied without any error.
    pub fn applied_version(&self) -> Option<u64> {
        self.applied
    }

    /// Pids of the workload of guest `vm_id` (the supervised process, or the processes
    /// adopted after a restart).
    pub fn workload_pids(&self, vm_id: &str) -> Vec<i32> {
        self.workloads.pids(vm_id)
    }

    /// The guest runtime (for inspection and tests).
    pub fn runtime(&self) -> &NetnsRuntime {
        &self.runtime
    }

    /// The QEMU guest runtime (for the serial console, inspection and tests).
    pub fn qemu(&self) -> &QemuRuntime {
        &self.qemu
    }
}

/// `PATH` entry for workloads: the directory of the running executable.
pub fn own_exe_dir() -> Option<PathBuf> {
    std::env::current_exe().ok()?.parent().map(PathBuf::from)
}

/// The heartbeat's word on one handover: moved, or failed with the reason
/// on one line.
fn migration(vm_id: &str, failure: Option<String>) -> MigrationReport {
    let outcome = match failure {
        None => MigrationOutcome::Moved,
        Some(_) => MigrationOutcome::Failed,
    };
    MigrationReport {
        vm_id: vm_id.to_owned(),
        outcome,
        reason: failure,
    }
}
