-- Resumable relay sessions: what a control plane (any replica) needs to
-- let a client resume one. The secret's SHA-256 only; the ticket's claims
-- (JSON, no secret in them) so that revocations still cover the session;
-- the node holding the guest's connection; when no replica carried it any
-- more (NULL while one does), from which its grace period counts.
CREATE TABLE relay_resume (
    session TEXT PRIMARY KEY,
    secret_hash TEXT NOT NULL,
    claims TEXT NOT NULL,
    node TEXT NOT NULL,
    grace_ms INTEGER NOT NULL,
    detached_at INTEGER
);

-- A session is resumed any number of times: one start and one end record
-- per session still, as many `session_resume` records as it took.
DROP INDEX audit_events_session;
CREATE UNIQUE INDEX audit_events_session ON audit_events (session, action)
    WHERE session IS NOT NULL AND action <> 'session_resume';
