-- Access taken away (a revoked grant or token, a deleted user, a removed
-- access rule): gateways refuse the credentials each entry covers and end
-- the sessions opened with them. Kept until every covered credential has
-- expired (`keep_until`).
CREATE TABLE revocations (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    principal  TEXT NOT NULL,
    token      TEXT,
    vm_id      TEXT,
    port       INTEGER,
    before     INTEGER NOT NULL,
    keep_until INTEGER NOT NULL
);
CREATE INDEX revocations_keep_until ON revocations (keep_until);

-- The broker counts a principal's open sessions against its cap.
CREATE INDEX open_sessions_principal ON open_sessions (principal);
