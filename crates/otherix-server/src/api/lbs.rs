//! Load balancers: CRUD, and views with the computed pool's health.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use otherix_core::selector::Selector;
use otherix_proto::{CreateLbRequest, ErrorBody, LoadBalancer, ProbeKind, UpdateLbRequest, Vm};
use otherix_store::LbRecord;
use time::OffsetDateTime;

use super::{ApiPath, Body};
use crate::auth::Principal;
use crate::catalog::{LbEntry, Model};
use crate::error::ApiError;
use crate::lb::{node_ready, view, Verdicts};
use crate::state::AppState;

const DEFAULT_INTERVAL_MS: u64 = 5_000;
const DEFAULT_TIMEOUT_MS: u64 = 2_000;
const MIN_INTERVAL_MS: u64 = 200;

/// `tcp` or `http:/path` → (kind, path).
fn parse_health(s: &str) -> Result<(ProbeKind, Option<String>), ApiError> {
    match s {
        "tcp" => Ok((ProbeKind::Tcp, None)),
        _ => match s.strip_prefix("http:") {
            Some(path)
                if path.starts_with('/') && path.len() <= 1024 && !path.contains(char::is_whitespace) =>
            {
                Ok((ProbeKind::Http, Some(path.to_string())))
            }
            _ => Err(ApiError::Invalid(format!(
                "invalid health check {s:?}: expected `tcp` or `http:/path`"
            ))),
        },
    }
}

/// Checks an LB's settings as a whole (after defaults or an update).
fn validate(lb: &LbRecord) -> Result<(), ApiError> {
    if lb.port == 0 || lb.health_port == Some(0) {
        return Err(ApiError::Invalid("port 0 is not a valid port".into()));
    }
    lb.selector
        .parse::<Selector>()
        .map_err(|e| ApiError::Invalid(e.to_string()))?;
    if lb.interval_ms < MIN_INTERVAL_MS {
        return Err(ApiError::Invalid(format!(
            "interval must be at least {MIN_INTERVAL_MS}ms"
        )));
    }
    if lb.timeout_ms == 0 || lb.timeout_ms >= lb.interval_ms {
        return Err(ApiError::Invalid(format!(
            "timeout ({}ms) must be positive and below the interval ({}ms)",
            lb.timeout_ms, lb.interval_ms
        )));
    }
    if lb.rise == 0 || lb.fall == 0 || lb.rise > 100 || lb.fall > 100 {
        return Err(ApiError::Invalid(
            "rise and fall must be between 1 and 100".into(),
        ));
    }
    Ok(())
}

/// The LB as the catalog has it now (the caller synced after writing).
async fn render(state: &AppState, lb: &LbRecord, detail: bool) -> Result<LoadBalancer, ApiError> {
    state.catalog.sync().await?;
    Ok(render_now(state, lb, detail))
}

/// The LB as the catalog has it now.
fn render_now(state: &AppState, lb: &LbRecord, detail: bool) -> LoadBalancer {
    let m = state.catalog.read();
    let now = OffsetDateTime::now_utc();
    match m.lb(&lb.name) {
        Some(entry) => view_of(state, &m, entry, now, detail),
        None => view(lb, &[], &Verdicts::of(lb, &[]), &|_: &Vm| true, now, detail),
    }
}

fn view_of(state: &AppState, m: &Model, lb: &LbEntry, now: OffsetDateTime, detail: bool) -> LoadBalancer {
    let name = lb.record.name.as_str();
    view(
        &lb.record,
        &m.pool(lb),
        &|vm: &Vm| m.verdict(name, &vm.id),
        &|vm: &Vm| node_ready(m, vm, now, state.settings.node_timeout),
        now,
        detail,
    )
}

#[utoipa::path(post, path = "/v1/lbs", operation_id = "createLb", tag = "lbs", security(("bearer" = [])), request_body = CreateLbRequest,
    responses((status = 201, body = LoadBalancer), (status = 400, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    p: Principal,
    body: Body<CreateLbRequest>,
) -> Result<(StatusCode, Json<LoadBalancer>), ApiError> {
    p.require_admin("create load balancers")?;
    let req = body.read()?;
    let (kind, path) = parse_health(req.health.as_deref().unwrap_or("tcp"))?;
    let lb = LbRecord {
        name: req.name.into_string(),
        port: req.port,
        selector: req
            .selector
            .parse::<Selector>()
            .map_err(|e| ApiError::Invalid(e.to_string()))?
            .to_string(),
        health_kind: kind,
        health_path: path,
        health_port: req.health_port,
        interval_ms: req.interval_ms.unwrap_or(DEFAULT_INTERVAL_MS),
        timeout_ms: req.timeout_ms.unwrap_or(DEFAULT_TIMEOUT_MS),
        rise: req.rise.unwrap_or(2),
        fall: req.fall.unwrap_or(3),
        created_at: OffsetDateTime::now_utc(),
    };
    validate(&lb)?;
    // Grouped with concurrent creates (see `crate::creates`), which bring
    // the catalog up to date once for the group.
    let lb = state.creates.create_lb(&state, lb).await?;
    tracing::info!(lb = %lb.name, selector = %lb.selector, port = lb.port, by = %p.name, "load balancer created");
    if state.catalog.read().lb(&lb.name).is_none() {
        state.catalog.sync().await?;
    }
    Ok((StatusCode::CREATED, Json(render_now(&state, &lb, true))))
}

#[utoipa::path(get, path = "/v1/lbs", operation_id = "listLbs", tag = "lbs", security(("bearer" = [])),
    responses((status = 200, body = Vec<LoadBalancer>)))]
pub async fn list(State(state): State<AppState>, p: Principal) -> Result<Json<Vec<LoadBalancer>>, ApiError> {
    crate::limits::check_list(&state.list_limits, &p, "lb list")?;
    let m = state.catalog.read();
    let now = OffsetDateTime::now_utc();
    Ok(Json(
        m.lbs().map(|lb| view_of(&state, &m, lb, now, false)).collect(),
    ))
}

#[utoipa::path(get, path = "/v1/lbs/{name}", operation_id = "getLb", tag = "lbs", security(("bearer" = [])),
    responses((status = 200, body = LoadBalancer), (status = 404, body = ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    p: Principal,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<LoadBalancer>, ApiError> {
    crate::limits::check_list(&state.list_limits, &p, "lb get")?;
    let m = state.catalog.read();
    let lb = m
        .lb(&name)
        .ok_or_else(|| ApiError::NotFound(format!("load balancer {name:?} not found")))?;
    Ok(Json(view_of(&state, &m, lb, OffsetDateTime::now_utc(), true)))
}

#[utoipa::path(patch, path = "/v1/lbs/{name}", operation_id = "updateLb", tag = "lbs", security(("bearer" = [])), request_body = UpdateLbRequest,
    responses((status = 200, body = LoadBalancer), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn update(
    State(state): State<AppState>,
    p: Principal,
    ApiPath(name): ApiPath<String>,
    body: Body<UpdateLbRequest>,
) -> Result<Json<LoadBalancer>, ApiError> {
    p.require_admin("change load balancers")?;
    let req = body.read()?;
    let mut lb = state.store.lb(&name).await?;
    if let Some(port) = req.port {
        lb.port = port;
    }
    if let Some(sel) = req.selector {
        lb.selector = sel
            .parse::<Selector>()
            .map_err(|e| ApiError::Invalid(e.to_string()))?
            .to_string();
    }
    if let Some(h) = req.health {
        let (kind, path) = parse_health(&h)?;
        lb.health_kind = kind;
        lb.health_path = path;
    }
    if req.health_port.is_some() {
        lb.health_port = req.health_port;
    }
    lb.interval_ms = req.interval_ms.unwrap_or(lb.interval_ms);
    lb.timeout_ms = req.timeout_ms.unwrap_or(lb.timeout_ms);
    lb.rise = req.rise.unwrap_or(lb.rise);
    lb.fall = req.fall.unwrap_or(lb.fall);
    validate(&lb)?;
    let lb = state.store.update_lb(&lb).await?;
    tracing::info!(lb = %lb.name, by = %p.name, "load balancer updated");
    Ok(Json(render(&state, &lb, true).await?))
}

#[utoipa::path(delete, path = "/v1/lbs/{name}", operation_id = "deleteLb", tag = "lbs", security(("bearer" = [])),
    responses((status = 204), (status = 404, body = ErrorBody)))]
pub async fn delete(
    State(state): State<AppState>,
    p: Principal,
    ApiPath(name): ApiPath<String>,
) -> Result<StatusCode, ApiError> {
    p.require_admin("delete load balancers")?;
    state.store.delete_lb(&name).await?;
    tracing::info!(lb = %name, by = %p.name, "load balancer deleted");
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_specs_parse() {
        assert_eq!(parse_health("tcp").unwrap(), (ProbeKind::Tcp, None));
        assert_eq!(
            parse_health("http:/healthz").unwrap(),
            (ProbeKind::Http, Some("/healthz".to_string()))
        );
        assert!(parse_health("http:healthz").is_err());
        assert!(parse_health("udp").is_err());
    }
}
