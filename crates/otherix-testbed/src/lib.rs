//! Throwaway *worlds* of Linux network namespaces, for integration tests and `otherix dev`.
//!
//! A [`World`] is a set of network namespaces made for one test (or one `otherix dev`
//! run). Everything it creates carries its per-world *prefix*, so worlds of parallel
//! tests never meet, and everything is removed when the world drops — also while a
//! panic unwinds, and, for a world whose process was killed, by the next [`World::new`].
//!
//! ```no_run
//! # fn main() -> otherix_testbed::Result<()> {
//! use std::time::Duration;
//! use otherix_testbed::World;
//!
//! let world = World::new("my test")?; // needs root
//! let cp = world.add_namespace("cp")?;
//! let node = world.add_namespace("node1")?;
//! let server = world.spawn(Some(&cp), "python3", ["-u", "-m", "http.server", "8080"], &[])?;
//! server.wait_for_log("Serving HTTP", Duration::from_secs(10))?;
//! let url = format!("http://{}:8080/", cp.ip());
//! let out = world.exec_ok(&node, &["curl", "-sS", "--max-time", "5", &url])?;
//! # let _ = out;
//! # Ok(())
//! # } // `world` drops: processes killed, namespaces and links deleted, logs removed.
//! ```
//!
//! A long-lived user such as `otherix dev` keeps the `World` alive and must turn Ctrl-C
//! into a normal return (so the world drops): spawned processes run in their own process
//! groups and do not get the terminal's SIGINT themselves.
//!
//! # Names and addresses
//!
//! With prefix `P` (`ox` + 4 hex digits, e.g. `oxa3f1`) and the world's /24 `10.213.N.0/24`
//! (taken from [`FABRIC_RANGE`]):
//!
//! | what | name | address |
//! | --- | --- | --- |
//! | fabric namespace | `P-fab`, holding the bridge `fab0` (MTU 1500) | none |
//! | host leg, host side | link `Ph` in the host namespace | `10.213.N.1/24` |
//! | host leg, fabric side | `v1`, a port of `fab0` | none |
//! | namespace of role `R` | `P-R`, interface `eth0` (MTU 1500), `lo` up | `10.213.N.2`, `.3`, ... `/24` |
//! | its fabric side | `vK` (K = last octet of its address), a port of `fab0` | none |
//! | guest namespaces | made by agents, named [`World::guest_netns_prefix`] + anything (`Pg...`) | the agents' business |
//!
//! No namespace gets a default route, and the host only gains the connected route of the
//! world's /24 through `Ph`: traffic can go between the host and the world's namespaces,
//! and nowhere else.
//!
//! # Files
//!
//! - `/run/otherix-testbed/lock` — taken (`flock`) while a world picks its prefix and /24
//!   and while stale worlds are cleaned, so parallel test processes never collide.
//! - `/run/otherix-testbed/P.world` — the world's *record*: prefix, owner pid (and its
//!   start time, so a reused pid is not mistaken for the owner), /24, hint and log dir.
//! - `$TMPDIR/otherix-testbed/P/` — the world's directory: `world.log` (what the world did)
//!   and one log per spawned process. Removed on drop (its logs copied elsewhere first
//!   after [`World::keep_logs_in`]), kept (and its path printed) when the world drops
//!   during a panic.
//!
//! # Stale worlds
//!
//! [`World::new`] first looks at every record: a world whose owner process is gone (a
//! test run killed by a timeout or `kill -9`) is *stale* and is cleaned up there and then:
//! its processes are killed, its namespaces (`P-*`, `Pg*`) and host links (`P*`) deleted,
//! its record and directory removed. Every process a world spawns carries the environment
//! variable [`WORLD_ENV`]`=P`, which is how processes outside the world's namespaces (and
//! their children) are found again.
//!
//! # Nodes without a world
//!
//! [`fake_node`] is a node that speaks the agent protocol (key and CSR, enrollment,
//! heartbeats over mutual TLS) from the calling process: for tests and benchmarks that
//! need many nodes of a control plane but none of their kernel state.

mod alloc;
pub mod cluster;
mod error;
pub mod fake_node;
pub mod http;
pub mod postgres;
mod proc;
mod sys;
pub mod tools;
mod world;

use std::time::{Duration, Instant};

pub use error::{Error, Result};
pub use proc::Proc;
pub use world::{Ns, World};

/// The range every test and dev world takes its /24 from: `10.213.0.0/16`.
///
/// A world uses `10.213.N.0/24` for some `N` in `1..=254`, and only after checking that
/// the host has no route into it (nor covering it, the default route aside) and that no
/// live world holds it. Nothing else in the project should use this range.
pub const FABRIC_RANGE: &str = "10.213.0.0/16";

/// Where worlds keep their lock file and records (see the crate docs).
pub const STATE_DIR: &str = "/run/otherix-testbed";

/// Environment variable set to the world's prefix in every process a world spawns or
/// execs; teardown and [`World::leftovers`] find processes by it.
pub const WORLD_ENV: &str = "OTHERIX_TESTBED_WORLD";

/// Set to `postgres` (as `.ci/run` does for a second run of the suites that
/// drive a control plane), the control planes tests start keep their store
/// in a PostgreSQL server of their own instead of SQLite in their data
/// directory.
pub const STORE_ENV: &str = "OTHERIX_TEST_STORE";

/// Whether [`STORE_ENV`] asks for PostgreSQL.
pub fn store_on_postgres() -> bool {
    std::env::var(STORE_ENV).is_ok_and(|v| v == "postgres")
}

/// How often [`wait_until`] and the waits of [`Proc`] poll.
const POLL_INTERVAL: Duration = Duration::from_millis(75);

/// Polls `f` every ~75 ms until it returns `Some`, or fails after `timeout` with an error
/// naming `what` ("timed out after 5s waiting for {what}").
///
/// Tests wait for readiness with this instead of sleeping. `f` is called at least once,
/// and once more when the deadline has passed.
pub fn wait_until<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = f() {
            return Ok(value);
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::Timeout {
                what: what.to_owned(),
                after: timeout,
                detail: String::new(),
            });
        }
        std::thread::sleep(POLL_INTERVAL.min(deadline - now));
    }
}
