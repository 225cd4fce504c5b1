-- `GET /v1/audit` pages by (at, id). `audit_events_at` serves the unfiltered
-- trail (an index holds the rowid, `id`, last); these serve a principal's or
-- a target's trail without reading everyone else's.
CREATE INDEX audit_events_principal ON audit_events(principal, at);
CREATE INDEX audit_events_target ON audit_events(target, at);
