-- 0019_undone_steps: what the worker needs to keep a step's idempotency key until the step's
-- effect was undone.
--
-- ctx.idempotency_key gave every step of a retried generation a new key, so that a step whose
-- compensation refunded a charge could charge again. A step that was never undone (it was in
-- flight when the run timed out, or it failed) then ran again under a new key as well, and the
-- provider could not tell the repeat from a new call: a double charge. The key now changes
-- only for a step that a compensation undid, once per undoing; the worker reads how often with
-- this function when it runs a retried generation.

-- How many times a compensation undid each step of the run, in the generations retry_dead_letter
-- retired (step_history). Moves nothing.
create function undone_steps(p_run_id text) returns table (name text, times integer)
language sql stable
set search_path from current
as $$
    select h.name, count(*)::integer from step_history h
    where h.run_id = p_run_id and h.compensation_status = 'completed'
    group by h.name
$$;
