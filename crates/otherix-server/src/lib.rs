//! The Otherix control plane: API, store, PKI. `run` is the whole server;
//! `api::router` is the API alone, for tests without a socket.

pub mod api;
pub mod audit;
pub mod auth;
pub mod authorize;
pub mod brokered;
pub mod catalog;
pub mod clock;
pub mod console;
pub mod creates;
pub mod desired;
pub mod error;
pub mod groups;
pub mod health;
pub mod keys;
pub mod lb;
pub mod limits;
pub mod migration;
pub mod pki;
pub mod random;
pub mod relay;
pub mod relay_ready;
mod relay_resume;
pub mod replicas;
pub mod revoke;
pub mod schedule;
pub mod secrets;
pub mod serve;
pub mod state;
pub mod tokens;

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use otherix_proto::ServerInfo;
use otherix_store::Store;
use time::OffsetDateTime;

/// How `otherix server` is configured.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Holds the database (unless `database` names one), the cluster CA
    /// and the first admin token.
    pub data_dir: PathBuf,
    /// A PostgreSQL database (`postgres://...`) instead of the embedded
    /// SQLite one in `data_dir`.
    pub database: Option<String>,
    /// The key the cluster CA's key and the session keys' seeds are sealed
    /// with in the store (see [`secrets`]). On PostgreSQL it defaults to
    /// `data_dir/secret.key`; every replica needs the same one.
    pub secret_key_file: Option<PathBuf>,
    /// Address the API listens on.
    pub listen: SocketAddr,
    /// Extra names or IPs the serving certificate is valid for.
    pub sans: Vec<String>,
    /// Where `/metrics`, `/healthz` and `/readyz` are served (plain HTTP, a
    /// management address), if anywhere.
    pub metrics_listen: Option<SocketAddr>,
    /// Caps on open connections to the API.
    pub limits: serve::ConnLimits,
    pub settings: state::Settings,
}

/// Runs the control plane until `shutdown` resolves.
pub async fn run(config: ServerConfig, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    let nofile = raise_open_files_limit();
    let limits = config.limits.fit_to_descriptors(nofile);
    let opened = open(
        &config.data_dir,
        config.database.as_deref(),
        config.secret_key_file.as_deref(),
    )
    .await?;
    let store = opened.store.clone();
    let cluster_id = opened.cluster_id.clone();
    let admin_token = opened.admin_token;

    let sans = serving_sans(&config);
    let identity = opened.ca.issue_serving(otherix_tls::CP_NAME, &sans)?;
    let acceptor = serve::tls_acceptor(identity, opened.ca.cert_der().clone())?;
    let listener = serve::bind(config.listen).await?;
    let local = listener.local_addr()?;
    // Bound before the banner, so whoever reads it can scrape at once.
    let metrics_listener = match config.metrics_listen {
        Some(addr) => {
            otherix_telemetry::install();
            health::register();
            Some(serve::bind(addr).await.context("metrics listener")?)
        }
        None => None,
    };

    let info = ServerInfo {
        cluster_id: cluster_id.clone(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        ca_fingerprint: opened.ca.fingerprint(),
    };
    let url = format!("https://{}", display_addr(local, &sans));
    let replica = replicas::Replica {
        id: opened.replica.clone(),
        address: url.clone(),
        started_at: OffsetDateTime::now_utc(),
    };
    println!("otherix control plane {} (cluster {cluster_id})", info.version);
    println!("listening on     {url}");
    println!("CA fingerprint   {}", info.ca_fingerprint);
    println!("data directory   {}", config.data_dir.display());
    if let Some(url) = &config.database {
        println!("database         {}", redacted(url));
        println!("replica          {}", replica.id);
    }
    if let Some(m) = &metrics_listener {
        println!("metrics on       http://{}/metrics", m.local_addr()?);
    }
    let lowered = limits != config.limits;
    if lowered {
        // Caps the descriptors cannot carry would never engage: accepts
        // would fail first, and the nodes' reserve could not help.
        println!(
            "connections      at most {} (+{} for nodes): fitted to {nofile} open files; raise LimitNOFILE for more",
            limits.max, limits.node_reserve
        );
    }
    let token_path = config.data_dir.join(ADMIN_TOKEN);
    if admin_token {
        println!("admin token      written to {} (mode 0600)", token_path.display());
    }
    println!(
        "log in with      otherix login --server {url} --token-file {} --ca-fingerprint {}",
        token_path.display(),
        info.ca_fingerprint
    );
    // Log lines after the banner, never in the middle of it: stdout and
    // stderr often share one terminal.
    if lowered {
        tracing::warn!(
            max_connections = limits.max,
            node_reserve = limits.node_reserve,
            per_ip = limits.per_ip,
            open_files = nofile,
            "connection caps lowered to fit the open-files limit"
        );
    }
    tracing::info!(%local, cluster_id = %cluster_id, "control plane started");

    let ttl = config.settings.credential_ttl;
    if ttl > otherix_core::credential::DEFAULT_MAX_LIFETIME {
        tracing::warn!(
            credential_ttl = %ttl,
            "credentials live longer than gateways accept by default (15 min): start gateway agents with a --max-credential-lifetime of at least this"
        );
    }
    let state = app_state(opened, Arc::new(info), config.settings.clone()).await?;
    state.keys.clone().spawn_rotation();
    spawn_audit_retention(store.clone(), config.settings.audit_retention);
    // Relay sessions live in this process: the previous run's ended with it.
    replica.register(&store).await?;
    relay_resume::spawn_sweeper(store.clone());
    if store.dialect() == otherix_store::Dialect::Postgres {
        if let Err(e) = state.clock.measure(&store).await {
            tracing::warn!(error = %e, "cannot read the database's clock");
        }
        replica.clone().spawn(
            store.clone(),
            state.relay.clone(),
            state.fenced.clone(),
            state.clock.clone(),
        );
        limits::spawn_sharing(
            store.clone(),
            replica.id.clone(),
            state.limits.clone(),
            state.list_limits.clone(),
        );
    }
    state.catalog.spawn();
    spawn_relay_revocations(&state);
    relay::spawn_bytes(state.relay.clone(), state.store.clone());
    if let Some(listener) = metrics_listener {
        let probe = Arc::new(health::CpProbe(state.clone()));
        tokio::spawn(otherix_telemetry::serve(listener, probe, std::future::pending()));
    }
    // Relay sessions are upgraded connections the HTTP drain does not see:
    // tell them first.
    // Nor do agents' held desired-state waits end by themselves.
    let relay = state.relay.clone();
    let catalog = state.catalog.clone();
    let audit = state.audit.clone();
    let shutdown = async move {
        shutdown.await;
        relay.stop();
        catalog.close();
    };
    // Nodes known from before this start may use the reserve at once (their
    // VTEP is where they called from, unless an admin set it).
    for n in state.catalog.read().nodes() {
        if let Some(ip) = n.vtep.as_deref().and_then(|v| v.parse().ok()) {
            state.node_sources.insert(ip);
        }
    }
    let node_sources = state.node_sources.clone();
    serve::serve(
        listener,
        acceptor,
        api::router(state),
        limits,
        node_sources,
        shutdown,
    )
    .await?;
    // Every answered request's audit record is written before the store closes.
    audit.close().await;
    // Its relay sessions were ended above: nothing for the others to do.
    if let Err(e) = store.remove_replica(&replica.id).await {
        tracing::warn!(error = %e, "cannot remove this replica from the store");
    }
    store.close().await;
    tracing::info!("control plane stopped");
    Ok(())
}

/// What a data directory holds, opened.
pub struct Opened {
    pub store: Store,
    pub cluster_id: String,
    pub ca: pki::ClusterCa,
    /// Whether this start created the first admin (its token is in
    /// `DIR/admin.token`).
    pub admin_token: bool,
    /// What seals the store's secrets, when the CA lives in the store.
    pub sealer: Option<Arc<secrets::SecretKey>>,
    /// This control plane's id among the replicas on its store.
    pub replica: String,
}

/// Opens (or, the first time, creates) a data directory: the directory
/// and the store made the owner's alone, migrations applied, the cluster id,
/// the cluster CA and the first admin. With `database`, the store is that
/// PostgreSQL database instead of `DIR/otherix.db`. With a secret key (on
/// PostgreSQL always: `secret_key_file`, or `DIR/secret.key`) the CA's key
/// lives in the store, sealed, and every replica that holds the key shares
/// it; without one (SQLite's default) it lives in `DIR/ca.key`.
pub async fn open(
    data_dir: &std::path::Path,
    database: Option<&str>,
    secret_key_file: Option<&std::path::Path>,
) -> anyhow::Result<Opened> {
    create_private_dir(data_dir)?;
    let store = match database {
        None => {
            let db = data_dir.join("otherix.db");
            create_private_file(&db)?;
            let store = Store::open(&db)
                .await
                .with_context(|| format!("opening the store in {}", data_dir.display()))?;
            // It holds the session-key seeds: the owner's alone, like the CA key.
            restrict_files(&db)?;
            store
        }
        Some(url) => {
            if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
                anyhow::bail!(
                    "--database takes a PostgreSQL URL (postgres://USER@HOST/DB, or postgres:///DB?host=/run/postgresql for a Unix socket), not {:?}; without it the store is SQLite in the data directory",
                    redacted(url)
                );
            }
            Store::open_postgres(url)
                .await
                .with_context(|| format!("opening the store at {}", redacted(url)))?
        }
    };
    let cluster_id = store.meta_init("cluster_id", &random::short_id()).await?;
    let key_file = secret_key_file
        .map(std::path::Path::to_path_buf)
        .or_else(|| database.map(|_| data_dir.join("secret.key")));
    let (ca, sealer) = match key_file {
        None => {
            if store.secret(CA_SECRET).await?.is_some() {
                anyhow::bail!(
                    "this store keeps the cluster CA sealed with a secret key: start with --secret-key-file FILE (the key it was started with before)"
                );
            }
            // A first start stopped before it recorded the CA (and before
            // the first admin) issued nothing with it.
            let in_use = store.meta("ca_fingerprint").await?.is_some() || !store.users().await?.is_empty();
            (
                pki::ClusterCa::load_or_create(data_dir, &cluster_id, in_use)?,
                None,
            )
        }
        Some(path) => {
            let (key, made) = secret_key(&store, &path).await?;
            let ca = match shared_ca(&store, data_dir, &cluster_id, &key, &path).await {
                Ok(ca) => ca,
                Err(e) => {
                    // A key made now, for a cluster whose secrets another
                    // key sealed (a replica that bootstrapped at the same
                    // moment), would only stand in the way of the right one.
                    // Never one that sealed what the store holds.
                    let foreign = match store.secret(CA_SECRET).await {
                        Ok(Some(stored)) => key.open(CA_SECRET, &stored.sealed).is_err(),
                        _ => false,
                    };
                    if made && foreign {
                        let _ = std::fs::remove_file(&path);
                    }
                    return Err(e);
                }
            };
            (ca, Some(Arc::new(key)))
        }
    };
    // One cluster, one CA: a second CP on a shared database with a CA of its
    // own would issue certificates nobody else trusts.
    let recorded = store.meta_init("ca_fingerprint", &ca.fingerprint()).await?;
    if recorded != ca.fingerprint() {
        anyhow::bail!(
            "the database belongs to a cluster whose CA (fingerprint {recorded}) is not the one in {} ({}); every control plane on one database needs the same CA",
            data_dir.display(),
            ca.fingerprint()
        );
    }
    let admin_token = bootstrap_admin(&store, data_dir).await?;
    Ok(Opened {
        store,
        cluster_id,
        ca,
        admin_token,
        sealer,
        replica: replicas::id(data_dir)?,
    })
}

/// The secret key at `path`, and whether this start made it: made when the
/// store holds no sealed secret yet (the first replica; several starting
/// together with one pre-made key, `openssl rand -hex 32 > FILE`, share it);
/// otherwise it must be a running replica's.
async fn secret_key(store: &Store, path: &std::path::Path) -> anyhow::Result<(secrets::SecretKey, bool)> {
    if path.exists() {
        return Ok((secrets::SecretKey::load(path)?, false));
    }
    if store.secret(CA_SECRET).await?.is_some() {
        anyhow::bail!(
            "this cluster's secrets in the database are sealed with a key this control plane does not have: copy the secret key file of a running replica to {} (or name it with --secret-key-file)",
            path.display()
        );
    }
    match secrets::SecretKey::create(path)? {
        Some(key) => {
            tracing::info!(path = %path.display(), key = key.id(), "made the secret key the store's secrets are sealed with; every other replica needs a copy");
            Ok((key, true))
        }
        // Made meanwhile by another process with the same path.
        None => Ok((secrets::SecretKey::load(path)?, false)),
    }
}

/// The name the cluster CA is stored under in `secrets`.
const CA_SECRET: &str = "ca";

/// The cluster CA kept in the store, sealed with `key`. The first replica
/// stores it — the one in `dir` if there is one (a cluster that kept it in
/// files before), else a new one; replicas starting together agree on one.
/// A cluster whose CA is recorded (`meta`) but kept in files only takes that
/// one, never a new one. Its certificate is written to `dir/ca.crt` for
/// `--ca-file`.
async fn shared_ca(
    store: &Store,
    dir: &std::path::Path,
    cluster_id: &str,
    key: &secrets::SecretKey,
    key_path: &std::path::Path,
) -> anyhow::Result<pki::ClusterCa> {
    // A CA key in the directory is one kept in files before (or a
    // stranger's); a certificate alone is the copy written below.
    let local = if dir.join("ca.key").exists() {
        pki::ClusterCa::load(dir)?
    } else {
        None
    };
    // The fingerprint is read before the secret: a replica records it only
    // after its secret is committed, so a fingerprint seen here with no
    // secret after it is a CA kept in files, never one a replica starting
    // at the same moment is storing.
    let recorded = store.meta("ca_fingerprint").await?;
    let stored = match store.secret(CA_SECRET).await? {
        Some(stored) => stored,
        None => {
            let candidate = match (&local, recorded) {
                (Some(ca), Some(fp)) if ca.fingerprint() != fp => anyhow::bail!(
                    "{} holds a CA ({}) other than the cluster's ({fp}); start this replica with an empty data directory, or first one that holds the cluster's ca.crt and ca.key",
                    dir.display(),
                    ca.fingerprint()
                ),
                (Some(ca), _) => pki::ClusterCa::from_pem(ca.cert_pem(), &ca.key_pem())?,
                (None, Some(fp)) => anyhow::bail!(
                    "this cluster's CA ({fp}) is still kept in files: start one control plane whose data directory holds its ca.crt and ca.key with --secret-key-file first, and it moves the CA into the database"
                ),
                (None, None) => pki::ClusterCa::generate(cluster_id)?,
            };
            let stored = store
                .secret_init(&otherix_store::SecretRecord {
                    name: CA_SECRET.into(),
                    public: candidate.cert_pem().to_string(),
                    sealed: key.seal(CA_SECRET, candidate.key_pem().as_bytes()),
                    created_at: OffsetDateTime::now_utc(),
                })
                .await?;
            if local.is_some() && stored.public == candidate.cert_pem() {
                tracing::info!(
                    dir = %dir.display(),
                    "the cluster CA from ca.key is kept in the store now, sealed; ca.key is no longer read: remove it here and from every other replica"
                );
            }
            stored
        }
    };
    let key_pem = key.open(CA_SECRET, &stored.sealed).map_err(|_| {
        anyhow::anyhow!(
            "the secret key in {} (id {}) does not open this cluster's secrets in the database: every replica needs a copy of the same secret key file",
            key_path.display(),
            key.id()
        )
    })?;
    let key_pem = String::from_utf8(key_pem).context("the stored CA key is not PEM")?;
    let ca = pki::ClusterCa::from_pem(&stored.public, &key_pem)?;
    let local_fingerprint = match local {
        Some(local) => Some(local.fingerprint()),
        None => std::fs::read_to_string(dir.join("ca.crt"))
            .ok()
            .and_then(|pem| otherix_tls::cert_from_pem(&pem).ok())
            .map(|der| otherix_tls::fingerprint(der.as_ref())),
    };
    match local_fingerprint {
        Some(other) if other != ca.fingerprint() => anyhow::bail!(
            "{} holds a CA ({other}) other than the cluster's ({}) kept in the database; remove ca.crt and ca.key from it",
            dir.display(),
            ca.fingerprint()
        ),
        Some(_) if dir.join("ca.key").exists() => tracing::warn!(
            dir = %dir.display(),
            "ca.key here is the cluster CA's key unsealed, and no longer read (the store keeps it sealed): remove it"
        ),
        _ => {}
    }
    ca.write_cert(dir)?;
    Ok(ca)
}

/// A database URL fit to print: its password (if any) replaced.
pub fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let (authority, tail) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _password)) => format!("{scheme}://{user}:***@{host}{tail}"),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

/// What the handlers share, for an opened store: session keys (the first
/// one made if due), the relay's client identity, limits, the wake-up
/// channel. Spawns nothing: [`run`] starts the background tasks.
pub async fn app_state(
    opened: Opened,
    info: Arc<ServerInfo>,
    settings: state::Settings,
) -> anyhow::Result<state::AppState> {
    let Opened {
        store,
        ca,
        sealer,
        replica,
        ..
    } = opened;
    let keys = Arc::new(keys::SessionKeys::new(
        store.clone(),
        sealer,
        settings.key_rotation,
        settings.credential_ttl,
    ));
    keys.rotate_if_due(OffsetDateTime::now_utc()).await?;
    let relay = Arc::new(relay::RelayState::new(
        ca.issue_client(otherix_proto::relay::CP_CLIENT_NAME)?,
        ca.cert_der().clone(),
        replica,
        settings.relay_ready_keep,
    )?);
    let catalog =
        catalog::Catalog::load(store.clone(), keys.clone(), info.cluster_id.clone(), settings.mtu).await?;
    catalog.set_migration_secret(ca.derive_secret("otherix qemu migration keys v1"));
    let brokered = Arc::new(brokered::Tally::default());
    brokered::spawn_summary(&brokered, brokered::EVERY);
    Ok(state::AppState::new(state::Shared {
        audit: audit::AuditWriter::spawn(store.clone()),
        brokered,
        clock: Arc::new(clock::ClockCheck::new(store.dialect())),
        node_sources: Arc::default(),
        console: Arc::default(),
        store,
        catalog,
        info,
        ca: Arc::new(ca),
        scheduling: Arc::default(),
        creates: Arc::default(),
        heartbeat_writes: Arc::default(),
        list_limits: Arc::new(limits::BrokerLimits::new(limits::LIST_RATE, limits::LIST_BURST)),
        node_limits: Arc::default(),
        limits: Arc::new(limits::BrokerLimits::new(
            settings.broker_rate,
            settings.broker_burst,
        )),
        settings: Arc::new(settings),
        keys,
        recent: Arc::new(lb::RecentConnections::default()),
        relay,
        fenced: Arc::default(),
    }))
}

/// Raises the soft limit on open files to the hard one: every client, node
/// and relay session holds descriptors, and a service manager's default soft
/// limit (1024) would stop the CP answering long before its memory would.
pub fn raise_open_files_limit() -> u64 {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => {
                tracing::info!(from = soft, to = hard, "raised the open-files limit");
                hard
            }
            Err(e) => {
                tracing::warn!(soft, hard, error = %e, "cannot raise the open-files limit");
                soft
            }
        },
        Ok((soft, _)) => {
            tracing::debug!(limit = soft, "open-files limit");
            soft
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the open-files limit");
            u64::MAX
        }
    }
}

/// Revocations written through any replica end the relay sessions they
/// cover on this one and refuse new ones (the replica that wrote them
/// added them to its relay's list at once).
fn spawn_relay_revocations(state: &state::AppState) {
    let mut changed = state.catalog.revocations_changed();
    let (catalog, relay) = (state.catalog.clone(), state.relay.clone());
    // The list new relay sessions are checked against, from the start.
    relay.set_revocations(catalog.read().revocations().to_vec());
    tokio::spawn(async move {
        while changed.changed().await.is_ok() {
            let revocations = catalog.read().revocations().to_vec();
            let ended = relay.set_revocations(revocations);
            if ended > 0 {
                tracing::info!(sessions = ended, "relay sessions ended by a revocation");
            }
        }
    });
}

/// Deletes audit events older than `retention`, hourly.
fn spawn_audit_retention(store: Store, retention: time::Duration) {
    tokio::spawn(async move {
        loop {
            match store.prune_audit(OffsetDateTime::now_utc() - retention).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(deleted = n, "pruned old audit events"),
                Err(e) => tracing::warn!(error = %e, "audit retention failed"),
            }
            // Used relay tickets: the store keeps each until no replica's
            // clock can accept it (exp, skew, skew again, a margin).
            // The change log: an hour of changes, at least the newest
            // 100,000, is far more than a catalog polling every second needs.
            let hour_ago = OffsetDateTime::now_utc() - time::Duration::hours(1);
            if let Err(e) = store.prune_changes(hour_ago, 100_000).await {
                tracing::warn!(error = %e, "pruning the change log failed");
            }
            if let Err(e) = store.prune_used_tickets(OffsetDateTime::now_utc()).await {
                tracing::warn!(error = %e, "pruning used relay tickets failed");
            }
            // Revocations whose credentials have all expired (queries skip
            // them already; this only frees the rows).
            if let Err(e) = store.prune_revocations(OffsetDateTime::now_utc()).await {
                tracing::warn!(error = %e, "pruning revocations failed");
            }
            tokio::time::sleep(std::time::Duration::from_secs(3600)).await;
        }
    });
}

/// On the very first start, creates user `admin` with a token written to
/// `DIR/admin.token` (0600). Returns whether this start wrote the file.
///
/// The token is durable in the data directory (file and directory
/// fsynced, as `admin.token.pending`) before the store commits the admin,
/// and renamed to `admin.token` after: a crash (or a failed write) in
/// between leaves the store with an admin whose token only the pending
/// file holds, so the next start finishes the rename — once the store
/// confirms that token is the admin's — instead of writing a new pending
/// file over it (which lost the only copy of the token).
async fn bootstrap_admin(store: &Store, dir: &std::path::Path) -> anyhow::Result<bool> {
    let pending = dir.join(PENDING_ADMIN_TOKEN);
    let file = dir.join(ADMIN_TOKEN);
    let left = match std::fs::read_to_string(&pending) {
        Ok(token) => Some(token),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(e).with_context(|| format!("reading {}", pending.display())),
    };
    if let Some(token) = left {
        if admin_token_in_store(store, token.trim()).await? {
            publish_admin_token(&pending, &file, dir)?;
            tracing::warn!(file = %file.display(), "finished a first start that stopped before writing the admin token");
            return Ok(true);
        }
        // Left by a start that stopped before the store committed (or
        // found the admin there already): the token is nobody's.
        std::fs::remove_file(&pending).with_context(|| format!("removing {}", pending.display()))?;
    }
    let token = tokens::new_token();
    pki::write_private(&pending, format!("{}\n", token.token).as_bytes())?;
    sync_dir(dir)?;
    let created = store
        .bootstrap_admin("admin", &token.id, &token.secret_hash, OffsetDateTime::now_utc())
        .await?;
    if created {
        publish_admin_token(&pending, &file, dir)?;
    } else {
        let _ = std::fs::remove_file(&pending);
    }
    Ok(created)
}

/// The first admin's token file, and where it waits for the store.
const ADMIN_TOKEN: &str = "admin.token";
const PENDING_ADMIN_TOKEN: &str = "admin.token.pending";

/// Whether `token` is a live token of user `admin`, as the store holds it.
async fn admin_token_in_store(store: &Store, token: &str) -> anyhow::Result<bool> {
    let Some((id, secret)) = tokens::split_token(token) else {
        return Ok(false);
    };
    Ok(store
        .token(id)
        .await?
        .is_some_and(|t| t.user == "admin" && tokens::secret_matches(secret, &t.secret_hash)))
}

/// Renames the pending admin token into place, durably.
fn publish_admin_token(
    pending: &std::path::Path,
    file: &std::path::Path,
    dir: &std::path::Path,
) -> anyhow::Result<()> {
    std::fs::rename(pending, file).with_context(|| {
        format!(
            "writing {} (the admin was created; its token is kept in {} and moved into place at the next start)",
            file.display(),
            pending.display()
        )
    })?;
    sync_dir(dir)
}

/// Makes the directory's entries (a created or renamed file) durable.
fn sync_dir(dir: &std::path::Path) -> anyhow::Result<()> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("syncing directory {}", dir.display()))
}

/// Names the serving certificate covers: the CP-only name clients and
/// agents verify it by, then — for other tools, such as curl — loopback,
/// the listen address, the host name, and whatever `--san` adds.
fn serving_sans(config: &ServerConfig) -> Vec<String> {
    let mut sans = vec![
        otherix_tls::CP_NAME.to_string(),
        "localhost".to_string(),
        "127.0.0.1".to_string(),
        "::1".to_string(),
    ];
    let ip = config.listen.ip();
    if !ip.is_unspecified() {
        sans.push(ip.to_string());
    }
    if let Ok(host) = std::fs::read_to_string("/proc/sys/kernel/hostname") {
        let host = host.trim();
        if !host.is_empty()
            && host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        {
            sans.push(host.to_string());
        }
    }
    sans.extend(config.sans.iter().cloned());
    sans.sort();
    sans.dedup();
    sans
}

fn display_addr(local: SocketAddr, sans: &[String]) -> String {
    if local.ip().is_unspecified() {
        // Listening everywhere: show a name the certificate covers.
        let host = sans
            .iter()
            .find(|s| s.parse::<IpAddr>().is_err() && *s != "localhost")
            .map(String::as_str)
            .unwrap_or("127.0.0.1");
        format!("{host}:{}", local.port())
    } else {
        local.to_string()
    }
}

/// Creates the data directory (0700), or tightens an existing one that
/// others may read: it holds the CA key, the store and the admin token.
fn create_private_dir(dir: &std::path::Path) -> anyhow::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("creating data directory {}", dir.display()))?;
    tighten(dir, 0o700)
}

/// Creates the empty database file (0600) unless it exists, before SQLite
/// opens it: SQLite gives its WAL and shared-memory files the database's
/// mode, so a first start makes nothing open to others, and
/// [`restrict_files`] warns only of files that were loose before this start.
fn create_private_file(path: &std::path::Path) -> anyhow::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
    {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e).with_context(|| format!("creating {}", path.display())),
    }
}

/// Makes the store's files (database, WAL, shared memory) the owner's alone.
fn restrict_files(db: &std::path::Path) -> anyhow::Result<()> {
    for suffix in ["", "-wal", "-shm"] {
        let path = std::path::PathBuf::from(format!("{}{suffix}", db.display()));
        if path.exists() {
            tighten(&path, 0o600)?;
        }
    }
    Ok(())
}

/// Removes group and other permissions from `path`, logging when it had
/// any; a path we cannot tighten stops the start with how to fix it.
pub(crate) fn tighten(path: &std::path::Path, mode: u32) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    let current = meta.permissions().mode() & 0o777;
    if current & 0o077 == 0 {
        return Ok(());
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).with_context(|| {
        format!(
            "{} is open to other users (mode {current:o}) and cannot be tightened; run `chmod {mode:o} {}` as its owner",
            path.display(),
            path.display()
        )
    })?;
    tracing::warn!(path = %path.display(), was = %format!("{current:o}"), now = %format!("{mode:o}"), "tightened permissions of key material");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::redacted;

    #[test]
    fn a_database_url_prints_without_its_password() {
        assert_eq!(
            redacted("postgres://otherix:s3cret@db.internal:5432/otherix"),
            "postgres://otherix:***@db.internal:5432/otherix"
        );
        // A password holding '@' is still hidden whole.
        assert_eq!(redacted("postgres://u:p@ss@db/x"), "postgres://u:***@db/x");
        assert_eq!(
            redacted("postgres://otherix@db/otherix"),
            "postgres://otherix@db/otherix"
        );
        assert_eq!(
            redacted("postgres:///otherix?host=/run/postgresql"),
            "postgres:///otherix?host=/run/postgresql"
        );
        assert_eq!(redacted("not a url"), "not a url");
    }
}
