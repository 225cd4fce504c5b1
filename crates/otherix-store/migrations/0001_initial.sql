-- Otherix control-plane store, version 1.
-- Times are Unix milliseconds (UTC). Names are DNS labels, unique per kind.

CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);

CREATE TABLE users (
    name       TEXT PRIMARY KEY,
    role       TEXT NOT NULL CHECK (role IN ('admin', 'user', 'viewer')),
    created_at INTEGER NOT NULL
);

-- API tokens: only a SHA-256 of the secret is kept.
CREATE TABLE api_tokens (
    id           TEXT PRIMARY KEY,
    user_name    TEXT NOT NULL REFERENCES users(name) ON DELETE CASCADE,
    secret_hash  BLOB NOT NULL,
    created_at   INTEGER NOT NULL,
    last_used_at INTEGER
);
CREATE INDEX api_tokens_user ON api_tokens(user_name);

-- What a `user` may broker to: VMs matching `selector`, on `ports` (JSON array).
CREATE TABLE access_rules (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    user_name  TEXT NOT NULL REFERENCES users(name) ON DELETE CASCADE,
    selector   TEXT NOT NULL,
    ports      TEXT NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE INDEX access_rules_user ON access_rules(user_name);

CREATE TABLE networks (
    name       TEXT PRIMARY KEY,
    id         TEXT NOT NULL UNIQUE,
    kind       TEXT NOT NULL CHECK (kind IN ('overlay', 'bridge')),
    subnet     TEXT NOT NULL,
    vni        INTEGER UNIQUE,
    node       TEXT,
    created_at INTEGER NOT NULL,
    CHECK ((kind = 'overlay' AND vni IS NOT NULL AND node IS NULL)
        OR (kind = 'bridge' AND vni IS NULL AND node IS NOT NULL))
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
    created_at INTEGER NOT NULL
);
CREATE INDEX vms_network ON vms(network);

-- Address leases. The primary key makes a double lease of one IP impossible,
-- whatever the application does.
CREATE TABLE leases (
    network    TEXT NOT NULL REFERENCES networks(name) ON DELETE CASCADE,
    ip         INTEGER NOT NULL,
    mac        TEXT NOT NULL UNIQUE,
    owner_kind TEXT NOT NULL CHECK (owner_kind IN ('vm', 'node')),
    owner      TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (network, ip),
    UNIQUE (network, owner_kind, owner)
);
