-- Open sessions' byte counts so far, as their carrier last reported them
-- (gateways in heartbeats, the relay every few seconds), and when: the
-- sessions list shows them live. Updates are not in the change log row by
-- row; one `session_bytes` change per batch tells the consoles.
ALTER TABLE open_sessions ADD COLUMN bytes_up BIGINT NOT NULL DEFAULT 0;
ALTER TABLE open_sessions ADD COLUMN bytes_down BIGINT NOT NULL DEFAULT 0;
ALTER TABLE open_sessions ADD COLUMN bytes_at BIGINT;

-- A revocation naming one session (its credential's jti): an admin ended
-- it. The entry keeps its principal, VM and port, which a control plane
-- that predates the column matches on instead.
ALTER TABLE revocations ADD COLUMN session TEXT;
