-- Leases by owner: a VM's or a node's lease was found by scanning every
-- lease (the unique index leads with the network, which those lookups do
-- not name) — once per VM read, VM delete and node membership change.
CREATE INDEX leases_owner ON leases (owner_kind, owner);

-- The lowest address of each network that may be free: every address
-- below `next` is leased. Allocation starts there instead of reading every
-- lease of the network; a freed lease lowers it (so the lowest free
-- address is still the one handed out). Not in the change log: no catalog
-- holds it.
CREATE TABLE lease_hints (
    network TEXT PRIMARY KEY,
    next    INTEGER NOT NULL
);
CREATE TRIGGER lease_hints_freed AFTER DELETE ON leases
BEGIN UPDATE lease_hints SET next = OLD.ip WHERE network = OLD.network AND next > OLD.ip; END;
CREATE TRIGGER lease_hints_network_gone AFTER DELETE ON networks
BEGIN DELETE FROM lease_hints WHERE network = OLD.name; END;
