-- Session signing keys (Ed25519) and the audit trail.

-- The private half is kept: the CP signs credentials with the newest key.
-- The data directory is 0700, the database file inside it the CP's alone.
CREATE TABLE session_keys (
    kid        TEXT PRIMARY KEY,
    seed       BLOB NOT NULL,
    public     BLOB NOT NULL,
    created_at INTEGER NOT NULL
);

CREATE TABLE audit_events (
    id        INTEGER PRIMARY KEY AUTOINCREMENT,
    at        INTEGER NOT NULL,
    principal TEXT NOT NULL,
    action    TEXT NOT NULL,
    target    TEXT,
    port      INTEGER,
    transport TEXT,
    node      TEXT,
    allowed   INTEGER NOT NULL,
    reason    TEXT
);
CREATE INDEX audit_events_at ON audit_events(at);
