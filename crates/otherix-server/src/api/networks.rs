//! Networks: overlays (VXLAN, cross-node) and bridges (one node).

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use otherix_api::{CreateNetworkRequest, ErrorBody, Network, NetworkType};
use otherix_core::ipam::Subnet;
use otherix_core::names::validate_name;
use otherix_store::NewNetwork;
use time::OffsetDateTime;

use super::{ApiError, ApiJson, ApiPath, AppState};
use crate::auth::{random_bytes, Principal};

#[utoipa::path(get, path = "/v1/networks", tag = "networks", security(("bearer" = [])),
    responses((status = 200, body = Vec<Network>)))]
pub async fn list(State(state): State<AppState>, _p: Principal) -> Result<Json<Vec<Network>>, ApiError> {
    Ok(Json(state.store.networks().await?))
}

#[utoipa::path(get, path = "/v1/networks/{name}", tag = "networks", security(("bearer" = [])),
    responses((status = 200, body = Network), (status = 404, body = ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    _p: Principal,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<Network>, ApiError> {
    Ok(Json(state.store.network(&name).await?))
}

#[utoipa::path(post, path = "/v1/networks", tag = "networks", security(("bearer" = [])), request_body = CreateNetworkRequest,
    responses((status = 201, body = Network), (status = 400, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    p: Principal,
    ApiJson(req): ApiJson<CreateNetworkRequest>,
) -> Result<(StatusCode, Json<Network>), ApiError> {
    p.require_admin("create networks")?;
    validate_name(&req.name).map_err(|e| ApiError::Invalid(format!("invalid network name: {e}")))?;
    let subnet: Subnet = req
        .subnet
        .parse()
        .map_err(|e| ApiError::Invalid(format!("invalid subnet: {e}")))?;
    match (req.kind, &req.node) {
        (NetworkType::Bridge, None) => {
            return Err(ApiError::Invalid(
                "a bridge network lives on one node: name it with `node` (--node)".into(),
            ))
        }
        (NetworkType::Overlay, Some(_)) => {
            return Err(ApiError::Invalid(
                "an overlay spans nodes and takes no `node` (--node is for bridge networks)".into(),
            ))
        }
        (_, Some(node)) => {
            validate_name(node).map_err(|e| ApiError::Invalid(format!("invalid node name: {e}")))?;
        }
        _ => {}
    }
    let new = NewNetwork {
        name: req.name,
        id: hex::encode(random_bytes::<8>()),
        kind: req.kind,
        subnet,
        node: req.node,
    };
    let net = state
        .store
        .create_network(&new, OffsetDateTime::now_utc())
        .await?;
    tracing::info!(network = %net.name, kind = %net.kind, subnet = %net.subnet, vni = ?net.vni, by = %p.name, "network created");
    Ok((StatusCode::CREATED, Json(net)))
}

#[utoipa::path(delete, path = "/v1/networks/{name}", tag = "networks", security(("bearer" = [])),
    responses((status = 204), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn delete(
    State(state): State<AppState>,
    p: Principal,
    ApiPath(name): ApiPath<String>,
) -> Result<StatusCode, ApiError> {
    p.require_admin("delete networks")?;
    state.store.delete_network(&name).await?;
    tracing::info!(network = %name, by = %p.name, "network deleted");
    Ok(StatusCode::NO_CONTENT)
}
