-- As SQLite's 0020: each VM target of a grant made before grants were bound
-- to VM ids gets the id of the VM that holds its name now; a target whose
-- VM is gone gets none (the broker refuses it); `lb/NAME` targets stay names.
UPDATE grants SET targets = (
    SELECT COALESCE(
        jsonb_agg(
            CASE
                WHEN left(e.t->>'target', 3) = 'lb/'
                     OR e.t->'vm_id' IS NOT NULL
                     OR v.id IS NULL
                    THEN e.t
                ELSE e.t || jsonb_build_object('vm_id', v.id)
            END
            ORDER BY e.ord
        ),
        '[]'::jsonb
    )::text
    FROM jsonb_array_elements(grants.targets::jsonb) WITH ORDINALITY AS e(t, ord)
    LEFT JOIN vms AS v ON v.name = e.t->>'target'
);
