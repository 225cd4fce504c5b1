-- Sessions open now (gateway and relay), and the session id on audit records.

CREATE TABLE open_sessions (
    id         TEXT PRIMARY KEY,
    principal  TEXT NOT NULL,
    target     TEXT NOT NULL,
    port       INTEGER NOT NULL,
    transport  TEXT NOT NULL,
    node       TEXT NOT NULL,
    started_at INTEGER NOT NULL
);
CREATE INDEX open_sessions_node ON open_sessions(node);

-- One start and one end record per session, however often a report is resent.
ALTER TABLE audit_events ADD COLUMN session TEXT;
CREATE UNIQUE INDEX audit_events_session ON audit_events(session, action) WHERE session IS NOT NULL;

-- The run of the node's gateway whose sessions are listed as open.
ALTER TABLE nodes ADD COLUMN session_epoch TEXT;
