//! VMs: create (with a CP-allocated MAC and lease), list by selector, label,
//! delete.

use std::collections::BTreeMap;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use otherix_core::labels::{validate_label_key, validate_label_value};
use otherix_core::selector::Selector;
use otherix_proto::{
    CreateVmBatchRequest, CreateVmRequest, ErrorBody, LabelVmRequest, Machine, Runtime, Vm, VmBatch,
};
use otherix_store::NewVm;
use serde::Deserialize;
use time::OffsetDateTime;

use super::{ApiPath, ApiQuery, Body};
use crate::auth::Principal;
use crate::error::ApiError;
use crate::random;
use crate::state::AppState;

/// Longest workload command accepted.
const MAX_EXEC: usize = 4096;
/// Most labels one VM may carry.
const MAX_LABELS: usize = 64;

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    /// Label selector, e.g. `app=web,tier!=canary`.
    selector: Option<String>,
    /// At most this many VMs (1 to 1000), in name order: one page. A page
    /// shorter than `limit` is the last. Without it, every VM.
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<usize>,
    /// Only VMs whose name sorts after this one: the last name of the
    /// previous page.
    after: Option<String>,
    /// Only VMs in this state.
    state: Option<otherix_proto::VmState>,
}

/// Most VMs one page of `vm list` holds.
pub const MAX_PAGE: usize = 1000;

#[utoipa::path(get, path = "/v1/vms", operation_id = "listVms", tag = "vms", security(("bearer" = [])), params(ListQuery),
    responses((status = 200, body = Vec<Vm>), (status = 400, body = ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    p: Principal,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Result<Json<Vec<Vm>>, ApiError> {
    crate::limits::check_list(&state.list_limits, &p, "vm list")?;
    let selector: Option<Selector> = q
        .selector
        .as_deref()
        .map(str::parse)
        .transpose()
        .map_err(|e| ApiError::Invalid(format!("{e}")))?;
    // From the catalog (API writes catch it up before they answer), not
    // the store: no query, and no read under the store's connections.
    let limit = match q.limit {
        Some(n) if (1..=MAX_PAGE).contains(&n) => n,
        Some(n) => {
            return Err(ApiError::Invalid(format!(
                "limit {n}: pages hold 1 to {MAX_PAGE} VMs"
            )))
        }
        None => usize::MAX,
    };
    let vms: Vec<Vm> = {
        let m = state.catalog.read();
        m.vms_page(q.after.as_deref(), limit, |vm| {
            selector.as_ref().is_none_or(|s| s.matches(&vm.labels)) && q.state.is_none_or(|st| vm.state == st)
        })
        .into_iter()
        .cloned()
        .collect()
    };
    Ok(Json(vms.into_iter().map(|vm| shown_to(&p, vm)).collect()))
}

/// A VM as `p` may see it: its workload command (which may hold secrets
/// passed on its command line) to admins only.
fn shown_to(p: &Principal, mut vm: Vm) -> Vm {
    if p.role != otherix_proto::Role::Admin {
        vm.exec = None;
    }
    vm
}

#[utoipa::path(get, path = "/v1/vms/{name}", operation_id = "getVm", tag = "vms", security(("bearer" = [])),
    responses((status = 200, body = Vm), (status = 404, body = ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    p: Principal,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<Vm>, ApiError> {
    Ok(Json(shown_to(&p, state.store.vm(&name).await?)))
}

/// Creates a VM. Concurrent creates share transactions (see
/// [`crate::creates`]); each is refused or created on its own.
#[utoipa::path(post, path = "/v1/vms", operation_id = "createVm", tag = "vms", security(("bearer" = [])), request_body = CreateVmRequest,
    responses((status = 201, body = Vm), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    p: Principal,
    body: Body<CreateVmRequest>,
) -> Result<(StatusCode, Json<Vm>), ApiError> {
    p.require_admin("create VMs")?;
    let new = new_vm(body.read()?)?;
    let vm = state.creates.create(&state, new).await?;
    Ok((StatusCode::CREATED, Json(vm)))
}

/// Creates several VMs in one transaction, all or none: one refusal (a
/// name taken, a network missing, a subnet too small for them all) and
/// nothing is created. Each gets its own lease, distinct from the others'.
#[utoipa::path(post, path = "/v1/vm-batches", operation_id = "createVmBatch", tag = "vms", security(("bearer" = [])), request_body = CreateVmBatchRequest,
    responses((status = 201, body = VmBatch), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn create_batch(
    State(state): State<AppState>,
    p: Principal,
    body: Body<CreateVmBatchRequest>,
) -> Result<(StatusCode, Json<VmBatch>), ApiError> {
    p.require_admin("create VMs")?;
    let req = body.read()?;
    if req.vms.is_empty() || req.vms.len() > otherix_store::MAX_VM_BATCH {
        return Err(ApiError::Invalid(format!(
            "a batch holds 1 to {} VMs, not {}",
            otherix_store::MAX_VM_BATCH,
            req.vms.len()
        )));
    }
    let news = req
        .vms
        .into_iter()
        .map(|vm| {
            let name = vm.name.to_string();
            new_vm(vm).map_err(|e| match e {
                ApiError::Invalid(m) => ApiError::Invalid(format!("vm {name:?}: {m}")),
                other => other,
            })
        })
        .collect::<Result<Vec<NewVm>, ApiError>>()?;
    let now = OffsetDateTime::now_utc();
    // Written placed, as single creates are (see `creates::place`).
    let scheduling = state.scheduling.lock().await;
    let mut news = news;
    crate::creates::place(&state, &mut news, now);
    let vms = state
        .store
        .create_vms(&news, random::mac, now)
        .await
        .map_err(|e| match e {
            // Not "all leased": fewer are free than the batch needs.
            otherix_store::StoreError::Exhausted(otherix_core::ipam::IpamError::Exhausted { subnet, capacity, .. }) => {
                ApiError::Conflict {
                    code: "subnet_exhausted",
                    message: format!(
                        "subnet {subnet} has fewer free addresses than the batch needs (it holds {capacity}); no VM of the batch was created"
                    ),
                }
            }
            e => nothing_created(e.into()),
        })?;
    tracing::info!(vms = vms.len(), first = %vms[0].name, by = %p.name, "vm batch created");
    let vms = match crate::creates::settle_placed(&state, scheduling, vms.iter().any(|vm| vm.node.is_none()))
        .await
    {
        Ok(()) => {
            let m = state.catalog.read();
            vms.into_iter()
                .map(|vm| m.vm(&vm.id).cloned().unwrap_or(vm))
                .collect()
        }
        // Created; a later heartbeat places them.
        Err(_) => vms,
    };
    Ok((StatusCode::CREATED, Json(VmBatch { vms })))
}

/// A batch's refusal, saying that none of it was created.
fn nothing_created(e: ApiError) -> ApiError {
    let more = |m: String| format!("{m}; no VM of the batch was created");
    match e {
        ApiError::NotFound(m) => ApiError::NotFound(more(m)),
        ApiError::AlreadyExists(m) => ApiError::AlreadyExists(more(m)),
        ApiError::Invalid(m) => ApiError::Invalid(more(m)),
        ApiError::Conflict { code, message } => ApiError::Conflict {
            code,
            message: more(message),
        },
        other => other,
    }
}

/// A create request checked, as the store takes it (with a fresh id).
fn new_vm(req: CreateVmRequest) -> Result<NewVm, ApiError> {
    validate_labels(&req.labels)?;
    if let Some(exec) = &req.exec {
        if exec.trim().is_empty() {
            return Err(ApiError::Invalid("exec must not be empty".into()));
        }
        if exec.len() > MAX_EXEC {
            return Err(ApiError::Invalid(format!("exec is longer than {MAX_EXEC} bytes")));
        }
    }
    let machine = machine_of(&req)?;
    if machine.is_some() && req.exec.is_some() {
        return Err(ApiError::Invalid(
            "exec runs a command in a netns guest; a QEMU guest runs its image's services (drop --exec or --runtime qemu)".into(),
        ));
    }
    Ok(NewVm {
        name: req.name.into_string(),
        id: random::long_id(),
        network: req.network.into_string(),
        node: req.node.map(String::from),
        labels: req.labels,
        exec: req.exec,
        machine,
    })
}

#[utoipa::path(delete, path = "/v1/vms/{name}", operation_id = "deleteVm", tag = "vms", security(("bearer" = [])),
    responses((status = 204), (status = 404, body = ErrorBody)))]
pub async fn delete(
    State(state): State<AppState>,
    p: Principal,
    ApiPath(name): ApiPath<String>,
) -> Result<StatusCode, ApiError> {
    p.require_admin("delete VMs")?;
    state.store.delete_vm(&name).await?;
    tracing::info!(vm = %name, by = %p.name, "vm deleted");
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(patch, path = "/v1/vms/{name}/labels", operation_id = "labelVm", tag = "vms", security(("bearer" = [])), request_body = LabelVmRequest,
    responses((status = 200, body = Vm), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn label(
    State(state): State<AppState>,
    p: Principal,
    ApiPath(name): ApiPath<String>,
    body: Body<LabelVmRequest>,
) -> Result<Json<Vm>, ApiError> {
    p.require_admin("label VMs")?;
    let req = body.read()?;
    validate_labels(&req.set)?;
    for key in &req.remove {
        validate_label_key(key).map_err(|e| ApiError::Invalid(format!("invalid label key {key:?}: {e}")))?;
        if req.set.contains_key(key) {
            return Err(ApiError::Invalid(format!(
                "label {key:?} is both set and removed"
            )));
        }
    }
    let vm = state
        .store
        .update_vm_labels(&name, &req.set, &req.remove, MAX_LABELS)
        .await?;
    tracing::info!(vm = %name, by = %p.name, "vm labels changed");
    Ok(Json(vm))
}

/// Guest memory of a QEMU VM that names none, in MiB.
pub const DEFAULT_MEMORY_MIB: u32 = 256;
/// Most SSH keys one VM may carry, and the longest one.
const MAX_SSH_KEYS: usize = 16;
const MAX_SSH_KEY: usize = 8192;

/// The machine a create asks for: `None` for the netns runtime (which takes
/// none of the QEMU options), or a QEMU guest's, checked and defaulted.
fn machine_of(req: &CreateVmRequest) -> Result<Option<Machine>, ApiError> {
    let qemu_only =
        req.memory_mib.is_some() || req.cpus.is_some() || req.image.is_some() || !req.ssh_keys.is_empty();
    match req.runtime.unwrap_or_default() {
        Runtime::Netns if qemu_only => Err(ApiError::Invalid(
            "memory, cpus, image and ssh keys are for QEMU guests: add --runtime qemu".into(),
        )),
        Runtime::Netns => Ok(None),
        Runtime::Qemu => {
            let memory_mib = req.memory_mib.unwrap_or(DEFAULT_MEMORY_MIB);
            if !(64..=65536).contains(&memory_mib) {
                return Err(ApiError::Invalid(format!(
                    "memory {memory_mib} MiB: give 64 MiB to 64 GiB"
                )));
            }
            let cpus = req.cpus.unwrap_or(1);
            if !(1..=64).contains(&cpus) {
                return Err(ApiError::Invalid(format!("cpus {cpus}: give 1 to 64")));
            }
            let image = req.image.clone().unwrap_or_else(|| "default".into());
            let image_ok = (1..=64).contains(&image.len())
                && image
                    .bytes()
                    .next()
                    .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
                && image
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b));
            if !image_ok {
                return Err(ApiError::Invalid(format!(
                    "image {:?}: 1 to 64 lowercase letters, digits, '.', '_' or '-'",
                    image.chars().take(80).collect::<String>()
                )));
            }
            if req.ssh_keys.len() > MAX_SSH_KEYS {
                return Err(ApiError::Invalid(format!(
                    "at most {MAX_SSH_KEYS} SSH keys per VM"
                )));
            }
            for key in &req.ssh_keys {
                validate_ssh_key(key)?;
            }
            Ok(Some(Machine {
                memory_mib,
                cpus,
                image,
                ssh_keys: req.ssh_keys.iter().map(|k| k.trim().to_owned()).collect(),
            }))
        }
    }
}

/// One `authorized_keys` line: `TYPE BASE64 [comment]`, printable, no options
/// (a key given here gets no `command=` or `from=`).
fn validate_ssh_key(key: &str) -> Result<(), ApiError> {
    let bad = |why: &str| {
        ApiError::Invalid(format!(
            "SSH key {:?}...: {why}",
            key.chars().take(24).collect::<String>()
        ))
    };
    let key = key.trim();
    if key.len() > MAX_SSH_KEY {
        return Err(bad(&format!("longer than {MAX_SSH_KEY} bytes")));
    }
    if key.chars().any(|c| c.is_control()) {
        return Err(bad("one line of printable text, please"));
    }
    let mut words = key.split_ascii_whitespace();
    let kind = words.next().unwrap_or_default();
    const KINDS: &[&str] = &[
        "ssh-ed25519",
        "ssh-rsa",
        "ecdsa-sha2-nistp256",
        "ecdsa-sha2-nistp384",
        "ecdsa-sha2-nistp521",
        "sk-ssh-ed25519@openssh.com",
        "sk-ecdsa-sha2-nistp256@openssh.com",
    ];
    if !KINDS.contains(&kind) {
        return Err(bad(
            "not a public key (it starts with ssh-ed25519, ssh-rsa or ecdsa-sha2-...): give the .pub file",
        ));
    }
    let body = words.next().unwrap_or_default();
    let b64 = !body.is_empty()
        && body
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'/' || b == b'=');
    if !b64 {
        return Err(bad("its key is not base64"));
    }
    Ok(())
}

fn validate_labels(labels: &BTreeMap<String, String>) -> Result<(), ApiError> {
    if labels.len() > MAX_LABELS {
        return Err(ApiError::Invalid(format!("at most {MAX_LABELS} labels per VM")));
    }
    for (k, v) in labels {
        validate_label_key(k).map_err(|e| ApiError::Invalid(format!("invalid label key {k:?}: {e}")))?;
        validate_label_value(v)
            .map_err(|e| ApiError::Invalid(format!("invalid label value {v:?} for {k:?}: {e}")))?;
    }
    Ok(())
}

/// Starts a live migration (admin). The VM keeps its MAC, IP and labels;
/// `vm get` shows `migrating` until the target runs it, or the reason it
/// was rolled back. A bridge VM moves only to another node of its bridge
/// network; its relay sessions end (clients connect again).
#[utoipa::path(post, path = "/v1/vms/{name}/migrate", operation_id = "migrateVm", tag = "vms", security(("bearer" = [])),
    request_body = otherix_proto::MigrateVmRequest,
    responses((status = 202, body = Vm), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn migrate(
    State(state): State<AppState>,
    p: Principal,
    ApiPath(name): ApiPath<String>,
    body: Body<otherix_proto::MigrateVmRequest>,
) -> Result<(StatusCode, Json<Vm>), ApiError> {
    p.require_admin("migrate VMs")?;
    let req = body.read()?;
    let conflict = |message: String| ApiError::Conflict {
        code: "cannot_migrate",
        message,
    };
    let vm = state.store.vm(&name).await?;
    let net = state.store.network(&vm.network).await?;
    // The VM is there; a target that is not makes the move impossible
    // (409), not the VM missing (404).
    let target = match state.store.node(&req.to).await {
        Err(otherix_store::StoreError::NotFound { .. }) => {
            return Err(conflict(format!("node {:?} not found", req.to.as_str())))
        }
        other => other?,
    };
    let now = OffsetDateTime::now_utc();
    let from = crate::migration::start(&vm, &net, &target, now, state.settings.node_timeout)
        .map_err(|e| conflict(e.to_string()))?;
    let migration = random::short_id();
    if !state
        .store
        .start_migration(&vm.id, &from, &req.to, &migration)
        .await?
    {
        return Err(conflict(format!(
            "vm {name:?} changed meanwhile (already migrating?); try again"
        )));
    }
    tracing::info!(vm = %name, from = %from, to = %req.to, by = %p.name, "migration started");
    Ok((StatusCode::ACCEPTED, Json(state.store.vm(&name).await?)))
}
