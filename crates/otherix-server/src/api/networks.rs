//! Networks: overlays (VXLAN, cross-node) and bridges (a host-local bridge
//! on each of their nodes).

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use otherix_core::ipam::Subnet;
use otherix_proto::{AddNetworkNodeRequest, CreateNetworkRequest, ErrorBody, Network, NetworkType, NodeName};
use otherix_store::NewNetwork;
use time::OffsetDateTime;

use super::{ApiPath, Body};
use crate::auth::Principal;
use crate::error::ApiError;
use crate::random;
use crate::state::AppState;

#[utoipa::path(get, path = "/v1/networks", operation_id = "listNetworks", tag = "networks", security(("bearer" = [])),
    responses((status = 200, body = Vec<Network>)))]
pub async fn list(State(state): State<AppState>, _p: Principal) -> Result<Json<Vec<Network>>, ApiError> {
    Ok(Json(state.store.networks().await?))
}

#[utoipa::path(get, path = "/v1/networks/{name}", operation_id = "getNetwork", tag = "networks", security(("bearer" = [])),
    responses((status = 200, body = Network), (status = 404, body = ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    _p: Principal,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<Network>, ApiError> {
    Ok(Json(state.store.network(&name).await?))
}

#[utoipa::path(post, path = "/v1/networks", operation_id = "createNetwork", tag = "networks", security(("bearer" = [])), request_body = CreateNetworkRequest,
    responses((status = 201, body = Network), (status = 400, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    p: Principal,
    body: Body<CreateNetworkRequest>,
) -> Result<(StatusCode, Json<Network>), ApiError> {
    p.require_admin("create networks")?;
    let req = body.read()?;
    let subnet: Subnet = req
        .subnet
        .parse()
        .map_err(|e| ApiError::Invalid(format!("invalid subnet: {e}")))?;
    let nodes = create_nodes(req.kind, req.node, req.nodes)?;
    let new = NewNetwork {
        name: req.name.into_string(),
        id: random::short_id(),
        kind: req.kind,
        subnet,
        nodes,
    };
    let net = state
        .store
        .create_network(&new, OffsetDateTime::now_utc())
        .await?;
    tracing::info!(network = %net.name, kind = %net.kind, subnet = %net.subnet, vni = ?net.vni, nodes = ?net.nodes, by = %p.name, "network created");
    Ok((StatusCode::CREATED, Json(net)))
}

#[utoipa::path(delete, path = "/v1/networks/{name}", operation_id = "deleteNetwork", tag = "networks", security(("bearer" = [])),
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

/// The node list of a new network from the request's `node` and `nodes`:
/// a bridge needs at least one, an overlay takes none.
fn create_nodes(
    kind: NetworkType,
    node: Option<NodeName>,
    nodes: Vec<NodeName>,
) -> Result<Vec<String>, ApiError> {
    let mut all: Vec<String> = node.into_iter().chain(nodes).map(String::from).collect();
    match kind {
        NetworkType::Bridge if all.is_empty() => Err(ApiError::Invalid(
            "a bridge network lives on nodes: name at least one with `nodes` (--node, repeatable)".into(),
        )),
        NetworkType::Overlay if !all.is_empty() => Err(ApiError::Invalid(
            "an overlay spans nodes and takes no `node`/`nodes` (--node is for bridge networks)".into(),
        )),
        _ => {
            all.sort();
            all.dedup();
            Ok(all)
        }
    }
}

/// A bridge network also exists on a node from now on (admin; idempotent):
/// the node builds a bridge of its own for it, with the network's node-side
/// address, and can host its VMs (or receive them by migration).
#[utoipa::path(post, path = "/v1/networks/{name}/nodes", operation_id = "addNetworkNode", tag = "networks", security(("bearer" = [])),
    request_body = AddNetworkNodeRequest,
    responses((status = 200, body = Network), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn add_node(
    State(state): State<AppState>,
    p: Principal,
    ApiPath(name): ApiPath<String>,
    body: Body<AddNetworkNodeRequest>,
) -> Result<Json<Network>, ApiError> {
    p.require_admin("change networks")?;
    let req = body.read()?;
    let net = state.store.add_network_node(&name, &req.node).await?;
    tracing::info!(network = %name, node = %req.node, by = %p.name, "network node added");
    Ok(Json(net))
}

/// A bridge network no longer exists on a node (admin). Refused while the
/// node hosts VMs of the network, and for its last node.
#[utoipa::path(delete, path = "/v1/networks/{name}/nodes/{node}", operation_id = "removeNetworkNode", tag = "networks", security(("bearer" = [])),
    responses((status = 200, body = Network), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn remove_node(
    State(state): State<AppState>,
    p: Principal,
    ApiPath((name, node)): ApiPath<(String, String)>,
) -> Result<Json<Network>, ApiError> {
    p.require_admin("change networks")?;
    let net = state.store.remove_network_node(&name, &node).await?;
    tracing::info!(network = %name, node = %node, by = %p.name, "network node removed");
    Ok(Json(net))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str) -> NodeName {
        name.parse().unwrap()
    }

    #[test]
    fn a_bridge_needs_nodes_and_an_overlay_takes_none() {
        let err = create_nodes(NetworkType::Bridge, None, vec![]).unwrap_err();
        assert!(err.to_string().contains("at least one"), "{err}");
        let err = create_nodes(NetworkType::Overlay, Some(node("n1")), vec![]).unwrap_err();
        assert!(err.to_string().contains("takes no"), "{err}");
        assert!(create_nodes(NetworkType::Overlay, None, vec![])
            .unwrap()
            .is_empty());
    }

    #[test]
    fn the_old_single_node_and_the_list_merge() {
        let nodes = create_nodes(
            NetworkType::Bridge,
            Some(node("n2")),
            vec![node("n1"), node("n2")],
        )
        .unwrap();
        assert_eq!(nodes, ["n1", "n2"]);
    }
}
