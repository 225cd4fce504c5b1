-- Nodes and the join tokens they enroll with.

CREATE TABLE join_tokens (
    id          TEXT PRIMARY KEY,
    secret_hash BLOB NOT NULL,
    created_at  INTEGER NOT NULL,
    expires_at  INTEGER NOT NULL,
    used_at     INTEGER,
    used_by     TEXT
);

CREATE TABLE nodes (
    name             TEXT PRIMARY KEY,
    -- SHA-256 of the node's current client certificate: mutual-TLS requests
    -- are attributed to a node by it.
    cert_fingerprint TEXT NOT NULL UNIQUE,
    hypervisor       INTEGER NOT NULL DEFAULT 0,
    gateway          TEXT,
    vtep             TEXT,
    agent_version    TEXT,
    applied_version  INTEGER,
    last_heartbeat   INTEGER,
    created_at       INTEGER NOT NULL
);
