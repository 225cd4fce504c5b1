-- Open gateway sessions per overlay, as the node last reported them (JSON
-- object network → count). Keeps a draining gateway's membership.
ALTER TABLE nodes ADD COLUMN sessions TEXT NOT NULL DEFAULT '{}';
