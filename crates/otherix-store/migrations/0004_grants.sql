-- External ingress grants: one bearer token for exactly the listed targets.

CREATE TABLE grants (
    id              TEXT PRIMARY KEY,
    name            TEXT NOT NULL UNIQUE,
    secret_hash     BLOB NOT NULL,
    -- JSON array of {"target": "web01" | "lb/web", "port": 443}; never widened.
    targets         TEXT NOT NULL,
    created_by      TEXT NOT NULL,
    created_at      INTEGER NOT NULL,
    expires_at      INTEGER NOT NULL,
    max_connections INTEGER,
    connections     INTEGER NOT NULL DEFAULT 0,
    last_used_at    INTEGER,
    revoked_at      INTEGER
);
