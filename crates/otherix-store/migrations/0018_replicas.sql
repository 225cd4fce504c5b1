-- Several control-plane replicas on one database (PostgreSQL; SQLite has
-- the one process, which registers all the same).

-- Each running control plane, refreshed every couple of seconds. One whose
-- row goes stale has stopped: another one records its relay sessions as
-- ended and removes the row. Not in the change log: no catalog holds it.
CREATE TABLE replicas (
    id         TEXT PRIMARY KEY,
    address    TEXT NOT NULL,
    started_at INTEGER NOT NULL,
    seen_at    INTEGER NOT NULL
);

-- The replica that carries a relay session (NULL: a gateway session, or a
-- relay session from before replicas).
ALTER TABLE open_sessions ADD COLUMN replica TEXT;
CREATE INDEX open_sessions_replica ON open_sessions (replica) WHERE replica IS NOT NULL;

-- Secrets every replica needs, sealed with the key every replica is given
-- (`--secret-key-file`): the cluster CA's key. `public` is what may be
-- read by anyone (the CA certificate).
CREATE TABLE secrets (
    name       TEXT PRIMARY KEY,
    public     TEXT NOT NULL,
    sealed     BLOB NOT NULL,
    created_at INTEGER NOT NULL
);
