-- 0073_parked_runs_wake_for_their_sleeps: a run parked on a wait also wakes when a sleep it
-- reached beside the wait ends.
--
-- A body gathering a durable sleep in one branch (a reminder after a day) and a wait in
-- another (the approval it reminds of) ends on whichever interrupt its gather meets first.
-- Ended by the wait, the worker parked the run until the wait's timeout or its event: the
-- sleep's wake time, stored in timers when the sleep was reached, was not counted, so the
-- reminder waited for the approval, which might never come. park is now due at the earliest
-- of the waits' timeouts and the run's unfired timers (a timer stored in this execution
-- whose time has passed makes the run due at once); a timer fires (fired_at) at the claim
-- after its time, so an earlier execution's sleeps do not count again. The worker counts a
-- sleep's write as in flight, as it counts a wait's registration, so the run is parked only
-- once the sleeps beside its waits were stored.
--
-- Lock order as in 0051: the run's row, then the rows of the runs it waits for (key share,
-- skip locked); timers are read, not locked.

-- park as in 0051, due at the earliest of the waits' timeouts and the run's unfired timers.
create or replace function park(p_run_id text, p_epoch bigint, p_steps text[])
returns timestamptz
language plpgsql
set search_path from current
as $$
declare
    v_targets text[];
    v_due timestamptz;
begin
    if coalesce(cardinality(p_steps), 0) = 0 or array_position(p_steps, null) is not null then
        raise exception 'park of run % needs the steps of the waits it parks for, got %',
            p_run_id, coalesce(p_steps::text, 'null') using errcode = 'WF003';
    end if;
    perform lock_held_run_for_update(p_run_id, p_epoch, array['running']);
    delete from waits w where w.run_id = p_run_id and w.step <> all(p_steps);
    v_targets := array(
        select t.id from waits w join runs t on t.id = w.target
        where w.run_id = p_run_id and w.kind = 'run');
    if cardinality(v_targets) > cardinality(array(
            select t.id from runs t where t.id = any(v_targets)
            order by t.id
            for key share skip locked)) then
        raise exception 'run % is busy: a run it waits for is held by another transaction;'
            ' try again', p_run_id using errcode = 'WF005';
    end if;
    if parked_run_is_due(p_run_id) then
        v_due := now();
    else
        -- "never" is the last day clients can read ('infinity' would break every reader)
        v_due := coalesce(least(
            (select min(w.timeout_at) from waits w where w.run_id = p_run_id),
            (select min(t.wake_at) from timers t
             where t.run_id = p_run_id and t.fired_at is null)),
            timestamptz '9999-12-31 00:00:00+00');
    end if;
    perform release_held_run(p_run_id, v_due);
    return nullif(v_due, timestamptz '9999-12-31 00:00:00+00');
end
$$;
