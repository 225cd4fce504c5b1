-- Node trust: a node is what an admin granted, never what it asserts.
--
-- A join token binds the node's name and roles (and, behind NAT, its VTEP);
-- `replace` lets it enroll over an enrolled node of that name, revoking the
-- old node's certificates.
ALTER TABLE join_tokens ADD COLUMN node TEXT;
ALTER TABLE join_tokens ADD COLUMN hypervisor INTEGER NOT NULL DEFAULT 0;
ALTER TABLE join_tokens ADD COLUMN gateway TEXT;
ALTER TABLE join_tokens ADD COLUMN relay TEXT;
ALTER TABLE join_tokens ADD COLUMN vtep TEXT;
ALTER TABLE join_tokens ADD COLUMN replace INTEGER NOT NULL DEFAULT 0;

-- nodes.hypervisor and nodes.gateway are now the grant (heartbeats no
-- longer write them); nodes.relay is the granted relay endpoint: NULL for
-- the default (a hypervisor's VTEP, port 7444), 'off', or IP:PORT. Until now
-- it held what the node reported: start from the default.
UPDATE nodes SET relay = NULL;
-- Until now a node asserted its roles itself: the ones it held become its
-- grant, and the audit trail says so, for an admin to review (`otherix audit
-- --target NODE`; `otherix node update NODE --no-gateway` withdraws one).
INSERT INTO audit_events (at, principal, action, target, node, allowed, reason)
    SELECT CAST(strftime('%s', 'now') AS INTEGER) * 1000, 'migration:node-trust', 'node_update', name, name, 1,
           'roles inherited from what the node asserted before roles were granted: '
           || CASE WHEN hypervisor != 0 THEN 'hypervisor' ELSE 'no hypervisor' END
           || ', ' || COALESCE('gateway ' || gateway, 'no gateway')
           || '; review them'
    FROM nodes;
-- An admin-set VTEP; NULL: the address the node's connections come from.
ALTER TABLE nodes ADD COLUMN vtep_grant TEXT;
-- Why the last heartbeat was refused (asserted roles or VTEP not granted).
ALTER TABLE nodes ADD COLUMN status_reason TEXT;
-- Overlay -> when the gateway's membership began to be held only by its
-- draining sessions (JSON object of millisecond timestamps).
ALTER TABLE nodes ADD COLUMN draining_since TEXT NOT NULL DEFAULT '{}';

-- Every certificate issued to a node, by purpose. A request is a node's
-- only if its certificate is listed here for that purpose and unexpired;
-- deleting or replacing the node deletes its rows, which revokes them all.
CREATE TABLE node_certs (
    fingerprint TEXT PRIMARY KEY,
    node        TEXT NOT NULL REFERENCES nodes(name) ON DELETE CASCADE,
    purpose     TEXT NOT NULL CHECK (purpose IN ('node', 'gateway', 'relay')),
    not_after   INTEGER NOT NULL,
    created_at  INTEGER NOT NULL
);
CREATE INDEX node_certs_node ON node_certs (node, purpose);
-- Enrolled nodes keep their client certificate (its real expiry is not
-- recorded here: the agent renews it into the new form at its next start).
INSERT INTO node_certs (fingerprint, node, purpose, not_after, created_at)
    SELECT cert_fingerprint, name, 'node', created_at + 400 * 86400000, created_at FROM nodes;
