-- Grants bind each VM target to the VM's id (`vm_id` in the targets'
-- JSON): a VM deleted and re-created under the same name is another VM,
-- which an old grant must not reach. Grants made before this are bound to
-- the VM that holds the name now, which is the one they reached until now;
-- a target whose VM is gone gets no id, and the broker refuses it (which VM
-- it meant is unknown). `lb/NAME` targets stay names: an LB's pool is what
-- its selector matches now, by design.
UPDATE grants SET targets = (
    SELECT json_group_array(
        CASE
            WHEN substr(json_extract(t.value, '$.target'), 1, 3) = 'lb/'
                 OR json_extract(t.value, '$.vm_id') IS NOT NULL
                 OR v.id IS NULL
                THEN json(t.value)
            ELSE json_set(t.value, '$.vm_id', v.id)
        END
    )
    FROM json_each(grants.targets) AS t
    LEFT JOIN vms AS v ON v.name = json_extract(t.value, '$.target')
);
