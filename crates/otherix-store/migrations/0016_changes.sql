-- The change log: every write to what the control plane's read model (the
-- catalog) holds appends (revision, kind, key) in the same transaction, by
-- trigger, so no write path can forget it. A catalog catches up by reading
-- the revisions after the last one it applied and re-reading each (kind,
-- key) it names; it is never told what changed, only that something did.
--
-- Not logged: the audit trail, used relay tickets, join tokens, and the
-- soft state a heartbeat refreshes (last heartbeat, agent version, applied
-- version, a verdict's probe time), which the process that answered the
-- heartbeat keeps in its own catalog.
CREATE TABLE changes (
    revision INTEGER PRIMARY KEY AUTOINCREMENT,
    kind     TEXT NOT NULL,
    key      TEXT NOT NULL,
    at       INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER))
);

-- users (key: name), with their tokens and access rules
CREATE TRIGGER changes_users_ins AFTER INSERT ON users
BEGIN INSERT INTO changes (kind, key) VALUES ('user', NEW.name); END;
CREATE TRIGGER changes_users_upd AFTER UPDATE ON users
BEGIN INSERT INTO changes (kind, key) VALUES ('user', NEW.name); END;
CREATE TRIGGER changes_users_del AFTER DELETE ON users
BEGIN INSERT INTO changes (kind, key) VALUES ('user', OLD.name); END;
CREATE TRIGGER changes_tokens_ins AFTER INSERT ON api_tokens
BEGIN INSERT INTO changes (kind, key) VALUES ('user', NEW.user_name); END;
CREATE TRIGGER changes_tokens_del AFTER DELETE ON api_tokens
BEGIN INSERT INTO changes (kind, key) VALUES ('user', OLD.user_name); END;
CREATE TRIGGER changes_rules_ins AFTER INSERT ON access_rules
BEGIN INSERT INTO changes (kind, key) VALUES ('user', NEW.user_name); END;
CREATE TRIGGER changes_rules_upd AFTER UPDATE ON access_rules
BEGIN INSERT INTO changes (kind, key) VALUES ('user', NEW.user_name); END;
CREATE TRIGGER changes_rules_del AFTER DELETE ON access_rules
BEGIN INSERT INTO changes (kind, key) VALUES ('user', OLD.user_name); END;

-- grants (key: id); the use counter is the store's business alone
CREATE TRIGGER changes_grants_ins AFTER INSERT ON grants
BEGIN INSERT INTO changes (kind, key) VALUES ('grant', NEW.id); END;
CREATE TRIGGER changes_grants_upd AFTER UPDATE ON grants
WHEN OLD.revoked_at IS NOT NEW.revoked_at OR OLD.expires_at IS NOT NEW.expires_at OR OLD.targets IS NOT NEW.targets
BEGIN INSERT INTO changes (kind, key) VALUES ('grant', NEW.id); END;
CREATE TRIGGER changes_grants_del AFTER DELETE ON grants
BEGIN INSERT INTO changes (kind, key) VALUES ('grant', OLD.id); END;

-- networks (key: name), with a bridge network's nodes
CREATE TRIGGER changes_networks_ins AFTER INSERT ON networks
BEGIN INSERT INTO changes (kind, key) VALUES ('network', NEW.name); END;
CREATE TRIGGER changes_networks_upd AFTER UPDATE ON networks
BEGIN INSERT INTO changes (kind, key) VALUES ('network', NEW.name); END;
CREATE TRIGGER changes_networks_del AFTER DELETE ON networks
BEGIN INSERT INTO changes (kind, key) VALUES ('network', OLD.name); END;
CREATE TRIGGER changes_network_nodes_ins AFTER INSERT ON network_nodes
BEGIN INSERT INTO changes (kind, key) VALUES ('network', NEW.network); END;
CREATE TRIGGER changes_network_nodes_del AFTER DELETE ON network_nodes
BEGIN INSERT INTO changes (kind, key) VALUES ('network', OLD.network); END;

-- VMs (key: id), with their leases
CREATE TRIGGER changes_vms_ins AFTER INSERT ON vms
BEGIN INSERT INTO changes (kind, key) VALUES ('vm', NEW.id); END;
CREATE TRIGGER changes_vms_upd AFTER UPDATE ON vms
BEGIN INSERT INTO changes (kind, key) VALUES ('vm', NEW.id); END;
CREATE TRIGGER changes_vms_del AFTER DELETE ON vms
BEGIN INSERT INTO changes (kind, key) VALUES ('vm', OLD.id); END;
CREATE TRIGGER changes_vm_leases_ins AFTER INSERT ON leases WHEN NEW.owner_kind = 'vm'
BEGIN INSERT INTO changes (kind, key) VALUES ('vm', NEW.owner); END;

-- nodes' leases on overlays (key: network and node, one space apart)
CREATE TRIGGER changes_node_leases_ins AFTER INSERT ON leases WHEN NEW.owner_kind = 'node'
BEGIN INSERT INTO changes (kind, key) VALUES ('node_lease', NEW.network || ' ' || NEW.owner); END;
CREATE TRIGGER changes_node_leases_del AFTER DELETE ON leases WHEN OLD.owner_kind = 'node'
BEGIN INSERT INTO changes (kind, key) VALUES ('node_lease', OLD.network || ' ' || OLD.owner); END;

-- nodes (key: name): what an admin granted and what a heartbeat changed,
-- not the heartbeat's soft state
CREATE TRIGGER changes_nodes_ins AFTER INSERT ON nodes
BEGIN INSERT INTO changes (kind, key) VALUES ('node', NEW.name); END;
CREATE TRIGGER changes_nodes_upd AFTER UPDATE ON nodes
WHEN OLD.hypervisor IS NOT NEW.hypervisor OR OLD.gateway IS NOT NEW.gateway OR OLD.relay IS NOT NEW.relay
  OR OLD.vtep IS NOT NEW.vtep OR OLD.vtep_grant IS NOT NEW.vtep_grant OR OLD.netns IS NOT NEW.netns
  OR OLD.ready_overlays IS NOT NEW.ready_overlays OR OLD.sessions IS NOT NEW.sessions
  OR OLD.draining_since IS NOT NEW.draining_since OR OLD.status_reason IS NOT NEW.status_reason
  OR OLD.cert_fingerprint IS NOT NEW.cert_fingerprint OR OLD.created_at IS NOT NEW.created_at
BEGIN INSERT INTO changes (kind, key) VALUES ('node', NEW.name); END;
CREATE TRIGGER changes_nodes_del AFTER DELETE ON nodes
BEGIN INSERT INTO changes (kind, key) VALUES ('node', OLD.name); END;

-- node certificates (key: node)
CREATE TRIGGER changes_node_certs_ins AFTER INSERT ON node_certs
BEGIN INSERT INTO changes (kind, key) VALUES ('node_cert', NEW.node); END;
CREATE TRIGGER changes_node_certs_del AFTER DELETE ON node_certs
BEGIN INSERT INTO changes (kind, key) VALUES ('node_cert', OLD.node); END;

-- load balancers (key: name)
CREATE TRIGGER changes_lbs_ins AFTER INSERT ON load_balancers
BEGIN INSERT INTO changes (kind, key) VALUES ('lb', NEW.name); END;
CREATE TRIGGER changes_lbs_upd AFTER UPDATE ON load_balancers
BEGIN INSERT INTO changes (kind, key) VALUES ('lb', NEW.name); END;
CREATE TRIGGER changes_lbs_del AFTER DELETE ON load_balancers
BEGIN INSERT INTO changes (kind, key) VALUES ('lb', OLD.name); END;

-- health verdicts (key: lb and VM id): a new verdict, not a new probe time
CREATE TRIGGER changes_verdicts_ins AFTER INSERT ON health_verdicts
BEGIN INSERT INTO changes (kind, key) VALUES ('verdict', NEW.lb || ' ' || NEW.vm_id); END;
CREATE TRIGGER changes_verdicts_upd AFTER UPDATE ON health_verdicts
WHEN OLD.health IS NOT NEW.health OR OLD.node IS NOT NEW.node OR OLD.reason IS NOT NEW.reason
  OR OLD.changed_at IS NOT NEW.changed_at
BEGIN INSERT INTO changes (kind, key) VALUES ('verdict', NEW.lb || ' ' || NEW.vm_id); END;
CREATE TRIGGER changes_verdicts_del AFTER DELETE ON health_verdicts
BEGIN INSERT INTO changes (kind, key) VALUES ('verdict', OLD.lb || ' ' || OLD.vm_id); END;

-- session signing keys and revocations: small sets, re-read whole
CREATE TRIGGER changes_keys_ins AFTER INSERT ON session_keys
BEGIN INSERT INTO changes (kind, key) VALUES ('session_keys', ''); END;
CREATE TRIGGER changes_keys_del AFTER DELETE ON session_keys
BEGIN INSERT INTO changes (kind, key) VALUES ('session_keys', ''); END;
CREATE TRIGGER changes_revocations_ins AFTER INSERT ON revocations
BEGIN INSERT INTO changes (kind, key) VALUES ('revocations', ''); END;
CREATE TRIGGER changes_revocations_del AFTER DELETE ON revocations
BEGIN INSERT INTO changes (kind, key) VALUES ('revocations', ''); END;

-- open sessions, counted per principal (key: principal)
CREATE TRIGGER changes_open_sessions_ins AFTER INSERT ON open_sessions
BEGIN INSERT INTO changes (kind, key) VALUES ('open_sessions', NEW.principal); END;
CREATE TRIGGER changes_open_sessions_del AFTER DELETE ON open_sessions
BEGIN INSERT INTO changes (kind, key) VALUES ('open_sessions', OLD.principal); END;
