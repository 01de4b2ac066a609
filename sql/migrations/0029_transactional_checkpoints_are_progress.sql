-- 0029_transactional_checkpoints_are_progress: a transactional step's checkpoint restarts its
-- run's count of takeovers, as every other checkpoint does.
--
-- checkpoint_transaction never reset runs.takeovers: a run that made progress only through
-- transactional steps, each time on a worker that then died, was dead-lettered as a PoisonRun
-- after max_takeovers such deaths, although a new checkpoint starts the count again. The reset
-- cannot be made in the step's transaction: under REPEATABLE READ or SERIALIZABLE its update of
-- the run fails (40001) whenever a heartbeat updated the run since the step began, and the step
-- would be tried again for ever. checkpoint_transaction now says whether the run has a count
-- (taken_over), and the worker then calls restart_takeovers once the step has committed.

drop function checkpoint_transaction(text, bigint, text, jsonb, timestamptz, boolean, integer);

-- checkpoint_transaction as in 0016, and whether the run's takeover count is to be restarted.
create function checkpoint_transaction(
    p_run_id text, p_epoch bigint, p_name text, p_output jsonb, p_started_at timestamptz,
    p_compensable boolean, p_position integer
) returns table (output jsonb, seq bigint, taken_over boolean)
language plpgsql
set search_path from current
as $$
declare
    v_run runs;
begin
    perform check_name('step name', p_name);
    perform check_step_transaction(p_run_id, format('transactional step %L', p_name));
    v_run := lock_run_for_transaction(p_run_id, p_epoch, array['running', 'compensating']);
    insert into steps as s (run_id, name, seq, position, kind, status, output, attempts,
                            started_at, compensable)
    values (p_run_id, p_name, nextval('step_seq'), p_position, 'transaction', 'completed',
            p_output,
            1 + (select count(*) from step_attempts a
                 where a.run_id = p_run_id and a.step_name = p_name
                   and a.generation = v_run.generation),
            p_started_at, p_compensable)
    on conflict do nothing;
    return query select s.output, s.seq, v_run.takeovers > 0 from steps s
                 where s.run_id = p_run_id and s.name = p_name;
end
$$;

-- Restarts the takeover count of a run whose transactional checkpoint committed: progress
-- (see checkpoint_transaction). A run held elsewhere is skipped: its next checkpoint restarts
-- the count.
create function restart_takeovers(p_run_id text, p_epoch bigint) returns void
language sql
set search_path from current
as $$
    update runs r set takeovers = 0
    from (select t.id from runs t
          where t.id = p_run_id and t.lease_epoch = p_epoch and t.takeovers > 0
          for no key update skip locked) held
    where r.id = held.id
$$;
