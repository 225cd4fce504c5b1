//! The OpenAPI document, generated from the handlers' annotations and the
//! API types, served at `/v1/openapi.json`.

use axum::Json;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use super::{audit, broker, grants, info, keys, lbs, networks, nodes, sessions, users, vms, wake};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Otherix ingress control plane",
        description = "Broker access to VMs on private networks. Errors are `{\"error\":{\"code\",\"message\"}}`."
    ),
    paths(
        info::info, info::whoami,
        users::list, users::create, users::get, users::delete,
        users::create_token, users::revoke_token, users::allow, users::disallow,
        networks::list, networks::create, networks::get, networks::delete,
        networks::add_node, networks::remove_node,
        vms::list, vms::create, vms::get, vms::delete, vms::label, vms::migrate,
        broker::broker,
        lbs::create, lbs::list, lbs::get, lbs::update, lbs::delete,
        grants::create, grants::list, grants::get, grants::revoke, audit::list, sessions::list,
        keys::list, keys::rotate,
        nodes::create_join_token, nodes::enroll, nodes::heartbeat, nodes::certificate, nodes::list, nodes::get, nodes::update, nodes::delete,
        wake::wait, info::healthz, info::readyz,
    ),
    modifiers(&BearerAuth),
)]
pub struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

#[utoipa::path(get, path = "/v1/openapi.json", tag = "meta", responses((status = 200, description = "this document")))]
pub async fn document() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}
