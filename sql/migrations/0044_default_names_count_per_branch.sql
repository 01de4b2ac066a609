-- 0044_default_names_count_per_branch: marks when workers began to count default names per
-- branch of a workflow body, so that runs recorded before keep replaying as they were recorded.
--
-- A child started without run_id, and a repeated wait for one event or run, are named by
-- counting. Workers counted across the whole body in the order calls were reached; in
-- parallel branches whose order depends on timing, a replay could hand a branch its sibling's
-- child id or event payload (exact replay broken). Workers of this version count per branch
-- (per task the body created, numbered in the order the body's code created them; see
-- flowly/branches.py), which gives branches names of a new form. A run whose history was
-- recorded before this migration was applied must still be replayed with the names it
-- recorded: the worker asks this function, once per execution and only when the two
-- countings differ. This migration's own applied_at is the mark.

-- Whether run p_run_id's first recorded step was written before this migration was applied
-- (one probe of steps_run_seq).
create function records_predate_branch_names(p_run_id text) returns boolean
language sql stable
set search_path from current
as $$
    select coalesce(
        (select s.finished_at from steps s where s.run_id = p_run_id order by s.seq limit 1)
        < (select m.applied_at from schema_migrations m where m.version = 44),
        false)
$$;
