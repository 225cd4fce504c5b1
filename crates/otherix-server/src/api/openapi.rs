//! The OpenAPI document, generated from the handlers' annotations and the
//! API types, served at `/v1/openapi.json`.
//!
//! What every operation has in common is added here, in one place, from
//! what the operation is: the answers the server's shared layers give (a
//! bad token's 401, a bad body's 400/413/415, a lost database's 503), the
//! parameters its path names, and the node certificate the agent calls take.
//! The handlers' annotations say what is theirs alone. The document is held
//! to the wire by tests (`tests/router.rs`) and by Schemathesis in CI
//! (`.ci/api-conformance`).

use axum::Json;
use utoipa::openapi::content::ContentBuilder;
use utoipa::openapi::header::HeaderBuilder;
use utoipa::openapi::path::{Operation, ParameterBuilder, ParameterIn};
use utoipa::openapi::response::{Response, ResponseBuilder};
use utoipa::openapi::schema::{ObjectBuilder, Type};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{Ref, RefOr, Required};
use utoipa::{Modify, OpenApi};

use super::{audit, broker, grants, info, keys, lbs, networks, nodes, sessions, users, vms, wake};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Otherix ingress control plane",
        description = "Broker access to VMs on private networks. Errors are `{\"error\":{\"code\",\"message\"}}`. \
            Request bodies are JSON objects; unknown fields are refused. Calls tagged `agent` are the nodes': \
            all but `enrollNode` need the node's client certificate (mutual TLS)."
    ),
    paths(
        info::info, info::whoami,
        users::list, users::create, users::get, users::delete,
        users::create_token, users::revoke_token, users::allow, users::disallow,
        networks::list, networks::create, networks::get, networks::delete,
        networks::add_node, networks::remove_node,
        vms::list, vms::create, vms::create_batch, vms::get, vms::delete, vms::label, vms::migrate, broker::console,
        broker::broker,
        lbs::create, lbs::list, lbs::get, lbs::update, lbs::delete,
        grants::create, grants::list, grants::get, grants::revoke, audit::list, sessions::list, sessions::end,
        keys::list, keys::rotate,
        nodes::create_join_token, nodes::enroll, nodes::heartbeat, nodes::certificate, nodes::list, nodes::get, nodes::update, nodes::delete,
        wake::wait, info::healthz, info::readyz,
    ),
    modifiers(&Security, &Common),
)]
pub struct ApiDoc;

/// The security scheme of users and grants.
pub const BEARER: &str = "bearer";
/// The security scheme of the agent calls: the node certificate the
/// control plane issued at enrollment, presented in the TLS handshake.
pub const NODE_CERTIFICATE: &str = "node_certificate";

/// The agent calls that take a node certificate (all but enrollment, which
/// is how a node gets one: its credential is the join token in its body).
const NODE_CALLS: &[&str] = &[
    "/v1/agent/heartbeat",
    "/v1/agent/certificate",
    "/v1/agent/desired/wait",
];

struct Security;

impl Modify for Security {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            BEARER,
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "An API token (`oxt_...`), or a grant's token on `POST /v1/broker`.",
                    ))
                    .build(),
            ),
        );
        components.add_security_scheme(
            NODE_CERTIFICATE,
            SecurityScheme::MutualTls {
                description: Some(
                    "The node's client certificate, issued by this control plane at enrollment \
                     (`POST /v1/agent/enroll`) and renewed with `POST /v1/agent/certificate`."
                        .into(),
                ),
                extensions: None,
            },
        );
        for path in NODE_CALLS {
            if let Some(item) = openapi.paths.paths.get_mut(*path) {
                for (_, op) in operations(item) {
                    op.security = Some(vec![SecurityRequirement::new(
                        NODE_CERTIFICATE,
                        Vec::<String>::new(),
                    )]);
                }
            }
        }
    }
}

/// What every operation shares: its path's parameters, and the answers of
/// the layers before its handler.
struct Common;

impl Modify for Common {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        for (path, item) in openapi.paths.paths.iter_mut() {
            let path = path.clone();
            for (method, op) in operations(item) {
                declare_path_parameters(&path, op);
                add_common_responses(method, &path, op);
            }
        }
    }
}

fn operations(
    item: &mut utoipa::openapi::path::PathItem,
) -> impl Iterator<Item = (http::Method, &mut Operation)> {
    [
        (http::Method::GET, &mut item.get),
        (http::Method::POST, &mut item.post),
        (http::Method::PUT, &mut item.put),
        (http::Method::PATCH, &mut item.patch),
        (http::Method::DELETE, &mut item.delete),
    ]
    .into_iter()
    .filter_map(|(method, op)| Some((method, op.as_mut()?)))
}

/// Each `{name}` in `path` as a required string parameter, unless the
/// operation declares it itself.
fn declare_path_parameters(path: &str, op: &mut Operation) {
    let names = path
        .split('/')
        .filter_map(|seg| seg.strip_prefix('{')?.strip_suffix('}'));
    for name in names {
        let params = op.parameters.get_or_insert_with(Vec::new);
        if params
            .iter()
            .any(|p| p.name == name && p.parameter_in == ParameterIn::Path)
        {
            continue;
        }
        let description = match name {
            "name" => "The object's name.",
            "node" => "The node's name.",
            "id" => "The token's or rule's id.",
            _ => "",
        };
        params.push(
            ParameterBuilder::new()
                .name(name)
                .parameter_in(ParameterIn::Path)
                .required(Required::True)
                .description((!description.is_empty()).then_some(description))
                .schema(Some(ObjectBuilder::new().schema_type(Type::String)))
                .build(),
        );
    }
}

/// The refusals the shared layers make, each added where the operation can
/// meet it and its annotation does not say it already.
fn add_common_responses(method: http::Method, path: &str, op: &mut Operation) {
    let bearer = has_scheme(op, BEARER);
    let node = has_scheme(op, NODE_CERTIFICATE);
    let has_body = op.request_body.is_some();
    let has_params = op.parameters.as_ref().is_some_and(|p| !p.is_empty());
    let named = path.contains('{');
    let mut add = |status: &str, response: Response| {
        op.responses
            .responses
            .entry(status.to_string())
            .or_insert_with(|| RefOr::T(response));
    };
    if bearer || node {
        add(
            "401",
            error("No credential, or one that is invalid, expired or revoked.")
                .header(
                    "WWW-Authenticate",
                    HeaderBuilder::new()
                        .schema(ObjectBuilder::new().schema_type(Type::String))
                        .description(Some("`Bearer`"))
                        .build(),
                )
                .build(),
        );
    }
    if bearer {
        add(
            "403",
            error("The caller's role may not make this call, or a grant's token was used for anything but brokering.")
                .build(),
        );
    }
    if has_body || has_params {
        add(
            "400",
            error("The request is malformed or invalid; the message says what to change.").build(),
        );
    }
    if has_body {
        add("408", error("The request body did not arrive in time.").build());
        add("413", error("The request body is over the size limit.").build());
        add(
            "415",
            error("The request body is not `Content-Type: application/json`.").build(),
        );
    }
    if named || has_body {
        add(
            "404",
            error("No such object, or no such parent of it, or an object the body names.").build(),
        );
    }
    // The broker (and the console tickets it mints) is rate-limited for
    // everyone, the reads that walk a
    // table for non-admins (`limits::check_list`), the agent calls per node.
    let walks_a_table =
        method == http::Method::GET && matches!(path, "/v1/vms" | "/v1/lbs" | "/v1/lbs/{name}");
    if matches!(path, "/v1/broker" | "/v1/vms/{name}/console") || node || walks_a_table {
        add(
            "429",
            error("Over a rate limit: retry after `Retry-After` seconds.")
                .header(
                    "Retry-After",
                    HeaderBuilder::new()
                        .schema(ObjectBuilder::new().schema_type(Type::Integer).minimum(Some(1)))
                        .description(Some("Seconds to wait before retrying."))
                        .build(),
                )
                .build(),
        );
    }
    if path != "/healthz" && path != "/readyz" {
        add(
            "503",
            error("This replica has lost its database (`replica_unavailable`), or nothing can serve the request now; retry, or use another replica.")
                .build(),
        );
    }
}

fn has_scheme(op: &Operation, scheme: &str) -> bool {
    op.security.as_ref().is_some_and(|reqs| {
        reqs.iter().any(|r| {
            serde_json::to_value(r)
                .ok()
                .and_then(|v| v.as_object().map(|o| o.contains_key(scheme)))
                .unwrap_or(false)
        })
    })
}

/// An answer with the API's error body.
fn error(description: &str) -> ResponseBuilder {
    ResponseBuilder::new().description(description).content(
        "application/json",
        ContentBuilder::new()
            .schema(Some(Ref::from_schema_name("ErrorBody")))
            .build(),
    )
}

#[utoipa::path(get, path = "/v1/openapi.json", operation_id = "getOpenApi", tag = "meta", responses((status = 200, description = "this document")))]
pub async fn document() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}
