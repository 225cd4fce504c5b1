//! Host rules: the node's own packet filter, one nftables table (`inet otherix`)
//! the agent owns in its network namespace, as it owns its links.
//!
//! What it enforces (DESIGN §3, "Host filtering"):
//! - VXLAN (UDP to the overlays' port) only from the cluster's VTEPs this node
//!   shares an overlay with; anything else to that port is counted and dropped;
//! - from guest-facing devices (`oxb*`, `oxl*`, `oxh*`) to the node's own
//!   addresses, only answers to what the node opened (the gateway's and relay's
//!   dials, health probes), pings of the node's address on the guest's own network
//!   and IPv6 neighbor discovery: the relay endpoint, metrics, the gateway listener
//!   and every other service of the node are out of a guest's reach;
//! - nothing routed from one guest-facing device into another (another network).
//!
//! [`rules`] renders a [`HostRules`] to one `nft -f` script (pure, unit-tested);
//! [`HostFilter`] converges the kernel to it: it rewrites the table only when the
//! wanted script changed (a steady round runs no `nft` at all: it reads the
//! counters over netlink, [`counters`]), and after a restart it recognizes its
//! own table by the digest in its comment.
//! Replacing the table resets its counters; [`HostFilter`] adds what they held
//! before, so the totals it reports only grow.

mod counters;
mod nft;
pub mod rules;

pub use nft::{Nft, NftError};
pub use rules::{Counters, HostRules, GUEST_PREFIXES, TABLE};

/// What the kernel holds, as far as this filter knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Installed {
    /// Not looked yet (a fresh agent): the table may be there from a previous run.
    Unknown,
    Absent,
    /// Our table with this digest.
    Present(u64),
}

/// What a [`HostFilter`] call did to the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Unchanged,
    Written,
    Removed,
}

/// The agent's table in one namespace, converged on demand.
#[derive(Debug)]
pub struct HostFilter {
    nft: Nft,
    counters: counters::CounterReader,
    installed: Installed,
    /// What the counters held when the table was last replaced (or removed).
    base: Counters,
    /// The totals last reported, to log what grew since.
    last: Counters,
}

impl HostFilter {
    /// The filter of namespace `netns` (`None`: the caller's own).
    pub fn new(netns: Option<String>) -> HostFilter {
        HostFilter {
            counters: counters::CounterReader::new(netns.clone()),
            nft: Nft::new(netns),
            installed: Installed::Unknown,
            base: Counters::default(),
            last: Counters::default(),
        }
    }

    /// Makes the table enforce `rules`; writes only when they changed.
    pub async fn ensure(&mut self, rules: &HostRules) -> Result<(Outcome, Vec<String>), NftError> {
        let rendered = rules.render();
        if self.installed == Installed::Unknown {
            self.installed = self.look().await?;
        }
        if self.installed == Installed::Present(rendered.digest) {
            return Ok((Outcome::Unchanged, rendered.unsafe_names));
        }
        self.keep_counts().await;
        self.nft.apply("apply host rules", rendered.script).await?;
        self.installed = Installed::Present(rendered.digest);
        Ok((Outcome::Written, rendered.unsafe_names))
    }

    /// Removes the table, if there is one.
    pub async fn remove(&mut self) -> Result<Outcome, NftError> {
        if self.installed == Installed::Unknown {
            self.installed = self.look().await?;
        }
        if self.installed == Installed::Absent {
            return Ok(Outcome::Unchanged);
        }
        self.keep_counts().await;
        self.nft
            .apply("remove host rules", rules::removal_script())
            .await?;
        self.installed = Installed::Absent;
        Ok(Outcome::Removed)
    }

    /// Whether the table is (as far as this filter knows) installed.
    pub fn installed(&self) -> bool {
        matches!(self.installed, Installed::Present(_))
    }

    /// The counters' totals since this filter was made (or since the table was
    /// first installed, for a table adopted after a restart), and what grew since
    /// the previous call. `None` while no table is installed.
    pub async fn counters(&mut self) -> Result<Option<(Counters, Counters)>, NftError> {
        if !self.installed() {
            return Ok(None);
        }
        let Some(now) = self.read().await? else {
            // Someone removed it: the next round puts it back.
            self.installed = Installed::Unknown;
            return Ok(None);
        };
        let total = self.base.plus(now);
        let grew = total.since(self.last);
        self.last = total;
        Ok(Some((total, grew)))
    }

    /// Whether the kernel holds our table, and with which digest.
    async fn look(&self) -> Result<Installed, NftError> {
        let listing = self
            .nft
            .list(
                "list host rules",
                &["--terse", "list", "table", "inet", "otherix"],
            )
            .await?;
        Ok(match listing {
            None => Installed::Absent,
            // A table of our name that is not ours (or from an older agent) is
            // replaced like a stale one: digest 0 never matches a rendered one.
            Some(text) => Installed::Present(rules::listed_digest(&text).unwrap_or(0)),
        })
    }

    /// The kernel's counters, `None` without the table (read over netlink:
    /// see [`counters`]).
    async fn read(&mut self) -> Result<Option<Counters>, NftError> {
        self.counters.read().await
    }

    /// Before the table is replaced or removed: its counters go into the base.
    async fn keep_counts(&mut self) {
        if !self.installed() {
            return;
        }
        match self.read().await {
            Ok(Some(now)) => self.base = self.base.plus(now),
            Ok(None) => {}
            Err(e) => tracing::debug!(error = %e, "host rule counters not read before the table is replaced"),
        }
    }
}
