-- As SQLite's 0018: control-plane replicas, the replica carrying each
-- relay session, and sealed secrets.

CREATE TABLE replicas (
    id         TEXT PRIMARY KEY,
    address    TEXT NOT NULL,
    started_at BIGINT NOT NULL,
    seen_at    BIGINT NOT NULL
);

ALTER TABLE open_sessions ADD COLUMN replica TEXT;
CREATE INDEX open_sessions_replica ON open_sessions (replica) WHERE replica IS NOT NULL;

CREATE TABLE secrets (
    name       TEXT PRIMARY KEY,
    public     TEXT NOT NULL,
    sealed     BYTEA NOT NULL,
    created_at BIGINT NOT NULL
);
