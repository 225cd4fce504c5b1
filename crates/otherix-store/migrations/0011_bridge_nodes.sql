-- A bridge network may exist on several nodes, each with a host-local bridge
-- of its own (isolated segments, one subnet: the CP still leases every IP
-- once per network), so that its VMs can migrate between those nodes.
-- `networks.node` stays (its CHECK wants it for bridges) and always names the
-- first of them by name.
CREATE TABLE network_nodes (
    network TEXT NOT NULL REFERENCES networks(name) ON DELETE CASCADE,
    node    TEXT NOT NULL,
    PRIMARY KEY (network, node)
);
INSERT INTO network_nodes (network, node)
    SELECT name, node FROM networks WHERE kind = 'bridge' AND node IS NOT NULL;
