-- Which connection carries a resumable session: each resume counts one
-- more leg before it asks the node. A leg that ends later than the next
-- one began (its client already resumed elsewhere, the node's side cut
-- by the takeover) neither detaches nor ends the session.
ALTER TABLE relay_resume ADD COLUMN leg INTEGER NOT NULL DEFAULT 0;
