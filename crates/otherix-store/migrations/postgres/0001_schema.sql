-- The PostgreSQL schema: the SQLite schema as of its migration 17, in one
-- step (no PostgreSQL database predates it). Later changes are appended to
-- both sets, as a migration of each.
--
-- Times are milliseconds since the Unix epoch (BIGINT), as in SQLite;
-- labels, targets and other small structures are JSON text.

CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);

CREATE TABLE users (
    name       TEXT PRIMARY KEY,
    role       TEXT NOT NULL CHECK (role IN ('admin', 'user', 'viewer')),
    created_at BIGINT NOT NULL
);
CREATE TABLE api_tokens (
    id           TEXT PRIMARY KEY,
    user_name    TEXT NOT NULL REFERENCES users(name) ON DELETE CASCADE,
    secret_hash  BYTEA NOT NULL,
    created_at   BIGINT NOT NULL,
    last_used_at BIGINT
);
CREATE INDEX api_tokens_user ON api_tokens (user_name);
CREATE TABLE access_rules (
    id         BIGSERIAL PRIMARY KEY,
    user_name  TEXT NOT NULL REFERENCES users(name) ON DELETE CASCADE,
    selector   TEXT NOT NULL,
    ports      TEXT NOT NULL,
    created_at BIGINT NOT NULL
);
CREATE INDEX access_rules_user ON access_rules (user_name);

CREATE TABLE networks (
    name       TEXT PRIMARY KEY,
    id         TEXT NOT NULL UNIQUE,
    kind       TEXT NOT NULL CHECK (kind IN ('overlay', 'bridge')),
    subnet     TEXT NOT NULL,
    vni        BIGINT UNIQUE,
    node       TEXT,
    created_at BIGINT NOT NULL,
    CHECK ((kind = 'overlay' AND vni IS NOT NULL AND node IS NULL)
        OR (kind = 'bridge' AND vni IS NULL AND node IS NOT NULL))
);
CREATE TABLE network_nodes (
    network TEXT NOT NULL REFERENCES networks(name) ON DELETE CASCADE,
    node    TEXT NOT NULL,
    PRIMARY KEY (network, node)
);

CREATE TABLE vms (
    id         TEXT PRIMARY KEY,
    name       TEXT NOT NULL UNIQUE,
    network    TEXT NOT NULL REFERENCES networks(name),
    node       TEXT,
    labels     TEXT NOT NULL DEFAULT '{}',
    exec       TEXT,
    state      TEXT NOT NULL,
    reason     TEXT,
    created_at BIGINT NOT NULL,
    migrate_to TEXT
);
CREATE INDEX vms_network ON vms (network);
CREATE TABLE leases (
    network    TEXT NOT NULL REFERENCES networks(name) ON DELETE CASCADE,
    ip         BIGINT NOT NULL,
    mac        TEXT NOT NULL UNIQUE,
    owner_kind TEXT NOT NULL CHECK (owner_kind IN ('vm', 'node')),
    owner      TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (network, ip),
    UNIQUE (network, owner_kind, owner)
);
CREATE INDEX leases_owner ON leases (owner_kind, owner);
-- Every address of a network below `next` is leased (see SQLite's 17).
CREATE TABLE lease_hints (
    network TEXT PRIMARY KEY,
    next    BIGINT NOT NULL
);

CREATE TABLE join_tokens (
    id          TEXT PRIMARY KEY,
    secret_hash BYTEA NOT NULL,
    created_at  BIGINT NOT NULL,
    expires_at  BIGINT NOT NULL,
    used_at     BIGINT,
    used_by     TEXT,
    node        TEXT,
    hypervisor  BIGINT NOT NULL DEFAULT 0,
    gateway     TEXT,
    relay       TEXT,
    vtep        TEXT,
    replace     BIGINT NOT NULL DEFAULT 0
);
CREATE TABLE nodes (
    name             TEXT PRIMARY KEY,
    cert_fingerprint TEXT NOT NULL UNIQUE,
    hypervisor       BIGINT NOT NULL DEFAULT 0,
    gateway          TEXT,
    vtep             TEXT,
    agent_version    TEXT,
    applied_version  BIGINT,
    last_heartbeat   BIGINT,
    created_at       BIGINT NOT NULL,
    relay            TEXT,
    sessions         TEXT NOT NULL DEFAULT '{}',
    netns            TEXT,
    ready_overlays   TEXT NOT NULL DEFAULT '[]',
    session_epoch    TEXT,
    vtep_grant       TEXT,
    status_reason    TEXT,
    draining_since   TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE node_certs (
    fingerprint TEXT PRIMARY KEY,
    node        TEXT NOT NULL REFERENCES nodes(name) ON DELETE CASCADE,
    purpose     TEXT NOT NULL CHECK (purpose IN ('node', 'gateway', 'relay')),
    not_after   BIGINT NOT NULL,
    created_at  BIGINT NOT NULL,
    -- Issue order (SQLite's rowid): a node keeps its newest two per purpose.
    seq         BIGSERIAL NOT NULL
);
CREATE INDEX node_certs_node ON node_certs (node, purpose);

CREATE TABLE session_keys (
    kid        TEXT PRIMARY KEY,
    seed       BYTEA NOT NULL,
    public     BYTEA NOT NULL,
    created_at BIGINT NOT NULL
);

CREATE TABLE audit_events (
    id          BIGSERIAL PRIMARY KEY,
    at          BIGINT NOT NULL,
    principal   TEXT NOT NULL,
    action      TEXT NOT NULL,
    target      TEXT,
    port        BIGINT,
    transport   TEXT,
    node        TEXT,
    allowed     BIGINT NOT NULL,
    reason      TEXT,
    bytes_up    BIGINT,
    bytes_down  BIGINT,
    duration_ms BIGINT,
    session     TEXT
);
CREATE INDEX audit_events_at ON audit_events (at, id);
CREATE INDEX audit_events_principal ON audit_events (principal, at, id);
CREATE INDEX audit_events_target ON audit_events (target, at, id);
CREATE UNIQUE INDEX audit_events_session ON audit_events (session, action) WHERE session IS NOT NULL;

CREATE TABLE grants (
    id              TEXT PRIMARY KEY,
    name            TEXT NOT NULL UNIQUE,
    secret_hash     BYTEA NOT NULL,
    targets         TEXT NOT NULL,
    created_by      TEXT NOT NULL,
    created_at      BIGINT NOT NULL,
    expires_at      BIGINT NOT NULL,
    max_connections BIGINT,
    connections     BIGINT NOT NULL DEFAULT 0,
    last_used_at    BIGINT,
    revoked_at      BIGINT
);

CREATE TABLE load_balancers (
    name        TEXT PRIMARY KEY,
    port        BIGINT NOT NULL,
    selector    TEXT NOT NULL,
    health_kind TEXT NOT NULL CHECK (health_kind IN ('tcp', 'http')),
    health_path TEXT,
    health_port BIGINT,
    interval_ms BIGINT NOT NULL,
    timeout_ms  BIGINT NOT NULL,
    rise        BIGINT NOT NULL,
    fall        BIGINT NOT NULL,
    created_at  BIGINT NOT NULL
);
CREATE TABLE health_verdicts (
    lb         TEXT NOT NULL REFERENCES load_balancers(name) ON DELETE CASCADE,
    vm_id      TEXT NOT NULL,
    node       TEXT NOT NULL,
    health     TEXT NOT NULL,
    probed_at  BIGINT NOT NULL,
    changed_at BIGINT,
    reason     TEXT,
    successes  BIGINT NOT NULL DEFAULT 0,
    failures   BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (lb, vm_id)
);

CREATE TABLE open_sessions (
    id         TEXT PRIMARY KEY,
    principal  TEXT NOT NULL,
    target     TEXT NOT NULL,
    port       BIGINT NOT NULL,
    transport  TEXT NOT NULL,
    node       TEXT NOT NULL,
    started_at BIGINT NOT NULL
);
CREATE INDEX open_sessions_node ON open_sessions (node);
CREATE INDEX open_sessions_principal ON open_sessions (principal);

CREATE TABLE used_tickets (
    jti TEXT PRIMARY KEY,
    exp BIGINT NOT NULL
);
CREATE INDEX used_tickets_exp ON used_tickets (exp);

CREATE TABLE revocations (
    id         BIGSERIAL PRIMARY KEY,
    principal  TEXT NOT NULL,
    token      TEXT,
    vm_id      TEXT,
    port       BIGINT,
    before     BIGINT NOT NULL,
    keep_until BIGINT NOT NULL
);
CREATE INDEX revocations_keep_until ON revocations (keep_until);

-- The change log (SQLite's migration 16 says what it holds and why).
CREATE TABLE changes (
    revision BIGSERIAL PRIMARY KEY,
    kind     TEXT NOT NULL,
    key      TEXT NOT NULL,
    at       BIGINT NOT NULL DEFAULT (extract(epoch FROM clock_timestamp()) * 1000)::BIGINT
);

-- One trigger function for every logged table: TG_ARGV[0] is the kind,
-- TG_ARGV[1] (and TG_ARGV[2], one space after it) the columns that make the
-- key; no column: the empty key. It takes the store's write lock first
-- (otherix_store::WRITE_LOCK; a write transaction already holds it, and it
-- is re-entrant), so revisions are assigned and committed in one order: a
-- catalog that read revision N has seen every revision below it. It also
-- notifies the catalogs listening.
CREATE FUNCTION log_change() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    r jsonb;
    k text := '';
BEGIN
    IF TG_OP = 'DELETE' THEN r := to_jsonb(OLD); ELSE r := to_jsonb(NEW); END IF;
    IF TG_NARGS > 1 THEN k := r ->> TG_ARGV[1]; END IF;
    IF TG_NARGS > 2 THEN k := k || ' ' || (r ->> TG_ARGV[2]); END IF;
    PERFORM pg_advisory_xact_lock(31371714142300536);
    INSERT INTO changes (kind, key) VALUES (TG_ARGV[0], k);
    -- Delivered at commit, once per transaction: other control planes'
    -- catalogs read the log then (otherix_store::CHANGES_CHANNEL).
    PERFORM pg_notify('otherix_changes', '');
    RETURN NULL;
END $$;

CREATE TRIGGER changes_users AFTER INSERT OR UPDATE OR DELETE ON users
    FOR EACH ROW EXECUTE FUNCTION log_change('user', 'name');
CREATE TRIGGER changes_tokens AFTER INSERT OR DELETE ON api_tokens
    FOR EACH ROW EXECUTE FUNCTION log_change('user', 'user_name');
CREATE TRIGGER changes_rules AFTER INSERT OR UPDATE OR DELETE ON access_rules
    FOR EACH ROW EXECUTE FUNCTION log_change('user', 'user_name');

CREATE TRIGGER changes_grants AFTER INSERT OR DELETE ON grants
    FOR EACH ROW EXECUTE FUNCTION log_change('grant', 'id');
CREATE TRIGGER changes_grants_upd AFTER UPDATE ON grants
    FOR EACH ROW WHEN (OLD.revoked_at IS DISTINCT FROM NEW.revoked_at
        OR OLD.expires_at IS DISTINCT FROM NEW.expires_at OR OLD.targets IS DISTINCT FROM NEW.targets)
    EXECUTE FUNCTION log_change('grant', 'id');

CREATE TRIGGER changes_networks AFTER INSERT OR UPDATE OR DELETE ON networks
    FOR EACH ROW EXECUTE FUNCTION log_change('network', 'name');
CREATE TRIGGER changes_network_nodes AFTER INSERT OR DELETE ON network_nodes
    FOR EACH ROW EXECUTE FUNCTION log_change('network', 'network');

CREATE TRIGGER changes_vms AFTER INSERT OR UPDATE OR DELETE ON vms
    FOR EACH ROW EXECUTE FUNCTION log_change('vm', 'id');
CREATE TRIGGER changes_vm_leases AFTER INSERT ON leases
    FOR EACH ROW WHEN (NEW.owner_kind = 'vm') EXECUTE FUNCTION log_change('vm', 'owner');
CREATE TRIGGER changes_node_leases_ins AFTER INSERT ON leases
    FOR EACH ROW WHEN (NEW.owner_kind = 'node') EXECUTE FUNCTION log_change('node_lease', 'network', 'owner');
CREATE TRIGGER changes_node_leases_del AFTER DELETE ON leases
    FOR EACH ROW WHEN (OLD.owner_kind = 'node') EXECUTE FUNCTION log_change('node_lease', 'network', 'owner');

CREATE TRIGGER changes_nodes AFTER INSERT OR DELETE ON nodes
    FOR EACH ROW EXECUTE FUNCTION log_change('node', 'name');
CREATE TRIGGER changes_nodes_upd AFTER UPDATE ON nodes
    FOR EACH ROW WHEN (OLD.hypervisor IS DISTINCT FROM NEW.hypervisor OR OLD.gateway IS DISTINCT FROM NEW.gateway
        OR OLD.relay IS DISTINCT FROM NEW.relay OR OLD.vtep IS DISTINCT FROM NEW.vtep
        OR OLD.vtep_grant IS DISTINCT FROM NEW.vtep_grant OR OLD.netns IS DISTINCT FROM NEW.netns
        OR OLD.ready_overlays IS DISTINCT FROM NEW.ready_overlays OR OLD.sessions IS DISTINCT FROM NEW.sessions
        OR OLD.draining_since IS DISTINCT FROM NEW.draining_since
        OR OLD.status_reason IS DISTINCT FROM NEW.status_reason
        OR OLD.cert_fingerprint IS DISTINCT FROM NEW.cert_fingerprint
        OR OLD.created_at IS DISTINCT FROM NEW.created_at)
    EXECUTE FUNCTION log_change('node', 'name');
CREATE TRIGGER changes_node_certs AFTER INSERT OR DELETE ON node_certs
    FOR EACH ROW EXECUTE FUNCTION log_change('node_cert', 'node');

CREATE TRIGGER changes_lbs AFTER INSERT OR UPDATE OR DELETE ON load_balancers
    FOR EACH ROW EXECUTE FUNCTION log_change('lb', 'name');
CREATE TRIGGER changes_verdicts AFTER INSERT OR DELETE ON health_verdicts
    FOR EACH ROW EXECUTE FUNCTION log_change('verdict', 'lb', 'vm_id');
CREATE TRIGGER changes_verdicts_upd AFTER UPDATE ON health_verdicts
    FOR EACH ROW WHEN (OLD.health IS DISTINCT FROM NEW.health OR OLD.node IS DISTINCT FROM NEW.node
        OR OLD.reason IS DISTINCT FROM NEW.reason OR OLD.changed_at IS DISTINCT FROM NEW.changed_at)
    EXECUTE FUNCTION log_change('verdict', 'lb', 'vm_id');

CREATE TRIGGER changes_keys AFTER INSERT OR DELETE ON session_keys
    FOR EACH ROW EXECUTE FUNCTION log_change('session_keys');
CREATE TRIGGER changes_revocations AFTER INSERT OR DELETE ON revocations
    FOR EACH ROW EXECUTE FUNCTION log_change('revocations');
CREATE TRIGGER changes_open_sessions AFTER INSERT OR DELETE ON open_sessions
    FOR EACH ROW EXECUTE FUNCTION log_change('open_sessions', 'principal');

-- A freed lease lowers its network's hint; a deleted network forgets it.
CREATE FUNCTION lease_hints_freed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE lease_hints SET next = OLD.ip WHERE network = OLD.network AND next > OLD.ip;
    RETURN NULL;
END $$;
CREATE TRIGGER lease_hints_freed AFTER DELETE ON leases
    FOR EACH ROW EXECUTE FUNCTION lease_hints_freed();
CREATE FUNCTION lease_hints_network_gone() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM lease_hints WHERE network = OLD.name;
    RETURN NULL;
END $$;
CREATE TRIGGER lease_hints_network_gone AFTER DELETE ON networks
    FOR EACH ROW EXECUTE FUNCTION lease_hints_network_gone();
