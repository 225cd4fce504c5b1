//! Waking agents when their desired state changes, so that a change reaches
//! a node within a round trip rather than on its next heartbeat.
//!
//! An agent holds `GET /v1/agent/desired/wait?version=V` open (mutual TLS),
//! `V` being the version of the desired state its last heartbeat got. The
//! answer comes as soon as the node's desired state has another version, or
//! after [`HOLD`] with `changed: false`; either way the agent heartbeats for
//! the state itself. Heartbeats stay the only way state moves: a lost or
//! refused wait only costs the wait's speed-up.
//!
//! Every API write that can change a desired state (see [`concerns_nodes`]:
//! networks, VMs, LBs, nodes, heartbeats) and was not refused marks the
//! store changed; one task
//! then recomputes every node's desired version from one snapshot and
//! publishes the map, and each waiter compares its own node's entry. Brokering,
//! users, grants and the like never wake anyone: at a thousand credentials a
//! second they would keep the task busy for nothing. Changes that come while it computes are folded into one more
//! round, so a burst of writes costs one computation, not one per waiter.
//!
//! What this buys: in a live migration, the FDB entries on every member
//! follow the handover within milliseconds (see `docs/benchmarks.md`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::Response;
use axum::Json;
use otherix_proto::agent::DesiredWait;
use otherix_proto::ErrorBody;
use serde::Deserialize;
use tokio::sync::watch;

use super::ApiQuery;
use crate::desired;
use crate::error::ApiError;
use crate::state::AppState;

/// How long a wait is held before it is answered `changed: false`; well
/// under the client's request timeout (60 s).
pub const HOLD: Duration = Duration::from_secs(25);

/// The desired version of every node, as of the latest change.
#[derive(Debug, Default, Clone)]
struct Versions {
    of: Arc<BTreeMap<String, u64>>,
    /// The change count `of` was computed after.
    generation: u64,
    /// The control plane is stopping: answer every wait now.
    closed: bool,
}

/// Change notices in, desired versions out. Shared through [`AppState`].
#[derive(Debug)]
pub struct Wake {
    /// Bumped on every write.
    changes: watch::Sender<u64>,
    versions: watch::Sender<Versions>,
}

impl Default for Wake {
    fn default() -> Self {
        Wake {
            changes: watch::Sender::new(0),
            versions: watch::Sender::new(Versions::default()),
        }
    }
}

impl Wake {
    /// Notes that the store may have changed.
    pub fn changed(&self) {
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Answers every wait at once (shutdown: waits must not hold the drain).
    pub fn close(&self) {
        self.versions.send_modify(|v| v.closed = true);
    }
}

/// Starts the task that recomputes the desired versions after each change.
pub fn spawn(state: AppState) {
    let mut changes = state.wake.changes.subscribe();
    tokio::spawn(async move {
        loop {
            let generation = *changes.borrow_and_update();
            match versions(&state).await {
                Ok(of) => state.wake.versions.send_modify(|v| {
                    v.of = Arc::new(of);
                    v.generation = generation;
                }),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot compute desired versions; waits fall back to heartbeats")
                }
            }
            if changes.changed().await.is_err() {
                return;
            }
        }
    });
}

async fn versions(state: &AppState) -> Result<BTreeMap<String, u64>, ApiError> {
    let snap = super::nodes::snapshot(state).await?;
    Ok(snap
        .nodes
        .iter()
        .map(|n| {
            let d = desired::desired_state(&snap, &n.name, state.settings.mtu);
            (n.name.clone(), d.version)
        })
        .collect())
}

/// Marks the store changed after every request that may have changed a
/// node's desired state.
pub async fn note_writes(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let writes = concerns_nodes(req.method(), req.uri().path());
    let resp = next.run(req).await;
    if writes && changed_anything(resp.status()) {
        state.wake.changed();
    }
    resp
}

/// Whether a write answered `status` may have changed the store. A refused
/// one (401 without a node certificate, 403, 409, 413, 429...) changed
/// nothing a desired state reads: waking on it would let anyone who can
/// open a connection keep the recompute of every node's desired state busy
/// (the soak's unauthenticated heartbeat POSTs did, hundreds a second).
fn changed_anything(status: axum::http::StatusCode) -> bool {
    !status.is_client_error()
}

/// Whether a request may change some node's desired state: a write to what
/// `desired::desired_state` reads. Missing an endpoint here only costs that
/// change the wake (nodes still get it with their next heartbeat).
pub fn concerns_nodes(method: &Method, path: &str) -> bool {
    const PREFIXES: [&str; 5] = [
        "/v1/networks",
        "/v1/vms",
        "/v1/lbs",
        "/v1/nodes",
        "/v1/agent/heartbeat",
    ];
    !matches!(*method, Method::GET | Method::HEAD)
        && PREFIXES.iter().any(|p| {
            path.strip_prefix(p)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
        })
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct WaitQuery {
    /// The version of the desired state the node has.
    version: u64,
}

/// Answers once the node's desired state is no longer `version`, or after
/// 25 s. Only over mutual TLS, for the node the certificate names.
#[utoipa::path(get, path = "/v1/agent/desired/wait", tag = "agent", params(WaitQuery),
    responses((status = 200, body = DesiredWait), (status = 401, body = ErrorBody)))]
pub async fn wait(
    State(state): State<AppState>,
    super::nodes::AgentNode { node, .. }: super::nodes::AgentNode,
    ApiQuery(q): ApiQuery<WaitQuery>,
) -> Result<Json<DesiredWait>, ApiError> {
    // Versions computed before the writes this node has already seen (its
    // own heartbeat's, above all) would look like a change: skip them.
    let seen = *state.wake.changes.borrow();
    let mut versions = state.wake.versions.subscribe();
    let deadline = tokio::time::Instant::now() + HOLD;
    loop {
        {
            let v = versions.borrow_and_update();
            if v.closed {
                break;
            }
            if let Some(&now) = v.of.get(&node.name).filter(|_| v.generation >= seen) {
                if now != q.version {
                    return Ok(Json(DesiredWait {
                        changed: true,
                        version: now,
                    }));
                }
            }
        }
        tokio::select! {
            r = versions.changed() => if r.is_err() { break },
            () = tokio::time::sleep_until(deadline) => break,
        }
    }
    Ok(Json(DesiredWait {
        changed: false,
        version: q.version,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_writes_to_what_desired_states_read_wake_nodes() {
        for (method, path) in [
            (Method::POST, "/v1/agent/heartbeat"),
            (Method::POST, "/v1/vms"),
            (Method::DELETE, "/v1/vms/web01"),
            (Method::PATCH, "/v1/vms/web01/labels"),
            (Method::POST, "/v1/vms/web01/migrate"),
            (Method::POST, "/v1/networks"),
            (Method::PATCH, "/v1/lbs/web"),
            (Method::DELETE, "/v1/nodes/node1"),
        ] {
            assert!(concerns_nodes(&method, path), "{method} {path}");
        }
        for (method, path) in [
            (Method::GET, "/v1/vms"),
            (Method::GET, "/v1/agent/desired/wait"),
            (Method::POST, "/v1/broker"),
            (Method::POST, "/v1/users"),
            (Method::POST, "/v1/grants"),
            (Method::POST, "/v1/agent/enroll"),
            (Method::POST, "/v1/agent/gateway-cert"),
            (Method::POST, "/v1/vmsx"),
        ] {
            assert!(!concerns_nodes(&method, path), "{method} {path}");
        }
    }

    #[test]
    fn refused_writes_wake_no_one() {
        use axum::http::StatusCode;
        for refused in [
            StatusCode::UNAUTHORIZED,
            StatusCode::FORBIDDEN,
            StatusCode::CONFLICT,
            StatusCode::PAYLOAD_TOO_LARGE,
            StatusCode::TOO_MANY_REQUESTS,
        ] {
            assert!(!changed_anything(refused), "{refused}");
        }
        for answered in [StatusCode::OK, StatusCode::CREATED, StatusCode::NO_CONTENT] {
            assert!(changed_anything(answered), "{answered}");
        }
        // A server error may have left a change behind: wake, to be safe.
        assert!(changed_anything(StatusCode::INTERNAL_SERVER_ERROR));
    }

    #[test]
    fn changes_are_counted_and_close_is_seen_by_later_subscribers() {
        let wake = Wake::default();
        let rx = wake.changes.subscribe();
        wake.changed();
        wake.changed();
        assert_eq!(*rx.borrow(), 2);
        wake.close();
        assert!(wake.versions.subscribe().borrow().closed);
    }
}
