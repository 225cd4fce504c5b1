//! Keeping agents and the catalog current between heartbeats.
//!
//! **Waits.** An agent holds `GET /v1/agent/desired/wait?version=V` open
//! (mutual TLS), `V` being the version of the desired state its last
//! heartbeat got. The answer comes as soon as the catalog has computed
//! another version for that node, or after [`HOLD`] with `changed: false`;
//! either way the agent heartbeats for the state itself. Only the nodes a
//! change concerns get another version (see `catalog`), so only they are
//! woken. Heartbeats stay the only way state moves: a lost or refused wait
//! only costs the wait's speed-up.
//!
//! **Writes.** Every API write that was not refused brings the catalog up
//! to date before it is answered ([`catch_up_after`], in the request's
//! middleware), so that whoever wrote reads it back at once — a `vm
//! create` followed by a `connect` finds the VM. Brokering writes nothing
//! the catalog holds and is left alone: at thousands of credentials a
//! second the catch-up would be pure cost.

use std::time::Duration;

use axum::extract::State;
use axum::http::Method;
use axum::Json;
use otherix_proto::agent::DesiredWait;
use otherix_proto::ErrorBody;
use serde::Deserialize;

use super::ApiQuery;
use crate::error::ApiError;
use crate::state::AppState;

/// How long a wait is held before it is answered `changed: false`; well
/// under the client's request timeout (60 s).
pub const HOLD: Duration = Duration::from_secs(25);

/// Catches the catalog up after a write (`writes`: [`may_change_catalog`]
/// of the request) answered `status`, if it may have changed the store.
pub async fn catch_up_after(state: &AppState, writes: bool, status: axum::http::StatusCode) {
    if writes && changed_anything(status) {
        if let Err(e) = state.catalog.sync().await {
            // The background poll catches up within a second.
            tracing::warn!(error = %e, "catalog did not catch up after a write");
        }
    }
}

/// Whether a write answered `status` may have changed the store. A refused
/// one (401 without a node certificate, 403, 409, 413, 429...) changed
/// nothing: catching up on it would let anyone who can open a connection
/// keep the catalog busy (the soak's unauthenticated heartbeat POSTs did).
fn changed_anything(status: axum::http::StatusCode) -> bool {
    !status.is_client_error()
}

/// Whether a request may write what the catalog holds. The broker only
/// audits and counts a grant's uses; heartbeats and VM creates (single, in
/// their group, and batches) catch up themselves before they answer.
pub fn may_change_catalog(method: &Method, path: &str) -> bool {
    !matches!(*method, Method::GET | Method::HEAD)
        && !matches!(
            path,
            "/v1/broker" | "/v1/agent/heartbeat" | "/v1/vms" | "/v1/vm-batches"
        )
}

/// The largest version a wait takes: 2^53 - 1, the largest integer a JSON
/// number holds exactly.
const MAX_VERSION: u64 = 9_007_199_254_740_991;

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct WaitQuery {
    /// The version of the desired state the node has.
    #[param(minimum = 0, maximum = 9007199254740991.0)]
    version: u64,
}

/// Answers once the node's desired state is no longer `version`, or after
/// 25 s. Only over mutual TLS, for the node the certificate names.
#[utoipa::path(get, path = "/v1/agent/desired/wait", operation_id = "waitDesiredState", tag = "agent", params(WaitQuery),
    responses((status = 200, body = DesiredWait), (status = 401, body = ErrorBody)))]
pub async fn wait(
    State(state): State<AppState>,
    super::nodes::AgentNode { node, .. }: super::nodes::AgentNode,
    ApiQuery(q): ApiQuery<WaitQuery>,
) -> Result<Json<DesiredWait>, ApiError> {
    // Versions count changes from 1: one past what a JSON number holds
    // exactly was never handed out.
    if q.version > MAX_VERSION {
        return Err(ApiError::Invalid(format!(
            "version {} is out of range: at most {MAX_VERSION}",
            q.version
        )));
    }
    let now = state.catalog.wait(&node.name, q.version, HOLD).await;
    Ok(Json(DesiredWait {
        changed: now != q.version,
        version: now,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_catch_the_catalog_up_but_brokering_heartbeats_and_vm_creates_do_not() {
        for (method, path) in [
            (Method::DELETE, "/v1/vms/web01"),
            (Method::PATCH, "/v1/vms/web01/labels"),
            (Method::POST, "/v1/networks"),
            (Method::PATCH, "/v1/lbs/web"),
            (Method::DELETE, "/v1/nodes/node1"),
            (Method::POST, "/v1/users"),
            (Method::POST, "/v1/grants/acme/revoke"),
            (Method::POST, "/v1/agent/enroll"),
        ] {
            assert!(may_change_catalog(&method, path), "{method} {path}");
        }
        for (method, path) in [
            (Method::GET, "/v1/vms"),
            (Method::GET, "/v1/agent/desired/wait"),
            (Method::POST, "/v1/broker"),
            (Method::POST, "/v1/agent/heartbeat"),
            // They catch up themselves, once per group.
            (Method::POST, "/v1/vms"),
            (Method::POST, "/v1/vm-batches"),
        ] {
            assert!(!may_change_catalog(&method, path), "{method} {path}");
        }
    }

    #[test]
    fn refused_writes_cost_no_catch_up() {
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
        // A server error may have left a change behind: catch up, to be safe.
        assert!(changed_anything(StatusCode::INTERNAL_SERVER_ERROR));
    }
}
