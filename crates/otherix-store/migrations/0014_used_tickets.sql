-- Relay tickets used, until they expire: single use across CP restarts
-- (the in-memory replay cache forgets them when the process ends).
CREATE TABLE used_tickets (
    jti TEXT PRIMARY KEY,
    exp INTEGER NOT NULL
);
CREATE INDEX used_tickets_exp ON used_tickets (exp);
