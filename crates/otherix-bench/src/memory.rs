//! Memory per idle session: the resident set of the gateway agent (gateway
//! sessions) or of the control plane (relay sessions) before and after
//! opening many sessions through it with the client library. Each session
//! echoes one byte (so both directions have carried data, as a real
//! session's have) and then sits idle while the memory is read.

use std::time::{Duration, Instant};

use anyhow::Context;
use otherix_client::tunnel::AnyTunnel;
use otherix_proto::BrokerResponse;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinSet;

use crate::bed::{Bed, ECHO_PORT, RELAY_VM, VM};
use crate::broker::broker_for;
use crate::options::Options;
use crate::{procfs, tools};

/// Broker calls in flight while collecting credentials.
const BROKER_CONCURRENCY: usize = 16;
/// Sessions being opened at once.
const OPEN_CONCURRENCY: usize = 64;
/// Bounds for collecting credentials and for opening sessions.
const PHASE_BUDGET: Duration = Duration::from_secs(120);
/// Open files this process keeps for everything but the sessions.
const SPARE_FILES: u64 = 256;
/// Open files the gateway agent keeps for its own use (replay file, netlink,
/// heartbeats) beyond the ones it has open when the figure starts.
const GATEWAY_SPARE_FILES: u64 = 64;
/// Time for the gateway to settle before its memory is read.
const SETTLE: Duration = Duration::from_secs(2);

#[derive(Debug, Clone)]
pub struct Memory {
    pub requested: usize,
    pub opened: usize,
    pub failed: usize,
    pub first_error: Option<String>,
    /// Why fewer than requested were attempted, if so.
    pub capped: Option<String>,
    pub rss_before: u64,
    pub rss_idle: u64,
    pub rss_closed: u64,
}

impl Memory {
    /// Resident-set growth per open idle session, in bytes.
    pub fn per_session(&self) -> f64 {
        self.rss_idle.saturating_sub(self.rss_before) as f64 / self.opened.max(1) as f64
    }
}

/// Idle sessions through the gateway; the gateway agent's memory.
pub async fn idle_sessions(bed: &Bed, opts: &Options) -> anyhow::Result<Memory> {
    let fit = sessions_that_fit(bed.agent_pid, "the gateway agent", opts.sessions);
    measure(bed, VM, bed.agent_pid, opts.sessions, fit).await
}

/// Idle sessions through the relay; the control plane's memory (it holds
/// two connections per session: the client's WebSocket and the node's TLS).
pub async fn relay_sessions(bed: &Bed, opts: &Options) -> anyhow::Result<Memory> {
    let fit = sessions_that_fit(bed.cp_pid, "the control plane", opts.relay_sessions);
    measure(bed, RELAY_VM, bed.cp_pid, opts.relay_sessions, fit).await
}

async fn measure(
    bed: &Bed,
    vm: &str,
    pid: u32,
    requested: usize,
    (target, capped): (usize, Option<String>),
) -> anyhow::Result<Memory> {
    // Warm-up: the first sessions build lazily made state.
    let warm = collect_grants(bed, vm, 64).await?;
    let (tunnels, _, _) = open_all(bed, warm).await;
    drop(tunnels);
    tokio::time::sleep(SETTLE).await;

    let rss_before = procfs::rss_bytes(pid)?;
    crate::progress(&format!("  brokering {target} credentials for {vm}"));
    let grants = collect_grants(bed, vm, target).await?;
    crate::progress(&format!("  opening {} sessions", grants.len()));
    let (tunnels, failed, first_error) = open_all(bed, grants).await;
    tokio::time::sleep(SETTLE).await;
    let rss_idle = procfs::rss_bytes(pid)?;
    let opened = tunnels.len();
    drop(tunnels);
    tokio::time::sleep(SETTLE).await;
    let rss_closed = procfs::rss_bytes(pid)?;
    Ok(Memory {
        requested,
        opened,
        failed,
        first_error,
        capped,
        rss_before,
        rss_idle,
        rss_closed,
    })
}

/// `wanted`, or fewer if this process (one file per session) or the server
/// `pid` (two: client and guest or node) may not open that many files; with the reason.
fn sessions_that_fit(pid: u32, who: &str, wanted: usize) -> (usize, Option<String>) {
    let mut target = wanted;
    let mut capped = None;
    if let Some((soft, _)) = tools::nofile_limits(std::process::id()) {
        let fits = soft.saturating_sub(SPARE_FILES) as usize;
        if fits < target {
            capped = Some(format!("this process may open {soft} files"));
            target = fits;
        }
    }
    if let (Some((soft, _)), Some(open)) = (tools::nofile_limits(pid), tools::open_files(pid)) {
        let fits = (soft.saturating_sub(open + GATEWAY_SPARE_FILES) / 2) as usize;
        if fits < target {
            capped = Some(format!("{who} may open {soft} files and holds two per session"));
            target = fits;
        }
    }
    (target, capped)
}

/// Up to `n` credentials for `vm`'s echo port, within [`PHASE_BUDGET`].
async fn collect_grants(bed: &Bed, vm: &str, n: usize) -> anyhow::Result<Vec<BrokerResponse>> {
    let deadline = Instant::now() + PHASE_BUDGET;
    let mut grants = Vec::with_capacity(n);
    let mut tasks = JoinSet::new();
    let mut started = 0;
    while grants.len() < n && Instant::now() < deadline {
        while started < n && tasks.len() < BROKER_CONCURRENCY {
            let client = bed.client.clone();
            let vm = vm.to_string();
            tasks.spawn(async move { broker_for(&client, &vm, ECHO_PORT).await });
            started += 1;
        }
        match tasks.join_next().await {
            Some(joined) => grants.push(joined?.context("broker call failed")?),
            None => break,
        }
    }
    Ok(grants)
}

/// Opens a session per credential, [`OPEN_CONCURRENCY`] at a time, each
/// echoing one byte. Returns the open tunnels, the failures and the first
/// failure's reason.
async fn open_all(bed: &Bed, grants: Vec<BrokerResponse>) -> (Vec<AnyTunnel>, usize, Option<String>) {
    let deadline = Instant::now() + PHASE_BUDGET;
    let mut grants = grants.into_iter();
    let mut tasks = JoinSet::new();
    let mut tunnels = Vec::new();
    let (mut failed, mut first_error) = (0, None);
    loop {
        while tasks.len() < OPEN_CONCURRENCY && Instant::now() < deadline {
            let Some(grant) = grants.next() else { break };
            let (ca, url) = (bed.ca_pem.clone(), bed.cluster.url.clone());
            tasks.spawn(async move { open_one(&grant, &url, &ca).await });
        }
        let Some(joined) = tasks.join_next().await else {
            break;
        };
        match joined.map_err(anyhow::Error::from).and_then(|r| r) {
            Ok(t) => tunnels.push(t),
            Err(e) => {
                failed += 1;
                first_error.get_or_insert_with(|| format!("{e:#}"));
            }
        }
    }
    (tunnels, failed, first_error)
}

async fn open_one(grant: &BrokerResponse, cp_url: &str, ca_pem: &str) -> anyhow::Result<AnyTunnel> {
    let mut t = otherix_client::tunnel::open_brokered(grant, cp_url, ca_pem).await?;
    t.write_all(b"x").await?;
    t.flush().await?;
    let mut back = [0u8; 1];
    tokio::time::timeout(Duration::from_secs(10), t.read_exact(&mut back)).await??;
    Ok(t)
}
