-- 0022_wakeups_that_stay_true: a wake-up applied late wakes only a run whose wait is still
-- satisfied, and a run a wait is registering for cannot be purged under it.
--
-- A wake-up wake_waiters missed (the waiter's row was locked) was applied by
-- wake_missed_waiters whatever had happened since: in a fan-in, two children finishing at once
-- noted a missed wake-up for a waiter the other completion was already waking; the waiter ran
-- on, a step failed, and the stale wake-up made the run due at once instead of after the
-- backoff the database had stored. It now wakes a run only while one of its waits is satisfied
-- (parked_run_is_due, park's own rule) and drops the others as settled.
--
-- wait_for_run read its target without a lock: a purge in the moment between the wait's
-- insert and its commit could not see the wait and deleted the finished target, and park then
-- found neither a busy nor a finished run and parked the waiter until 9999-12-31. The target's
-- row is now key-share locked while the wait registers (purge skips locked rows; a finish,
-- which takes no key lock, is not held up; a row an operator holds reports the waiter busy,
-- WF005, as park does, and the worker asks again shortly), and a wait for a run that no longer exists makes
-- the waiter due, so its body's wait fails with RunNotFound instead of hanging. The recorded
-- outcome now names the run (run_id), so that purge can keep a run whose failure a retry asks
-- for again (0023).
--
-- Lock order as in 0014: the waiting run's row, then the rows of the runs it waits for.

-- Whether a parked run has a wait that is satisfied: a timeout passed, an event it may receive
-- arrived, or the run it waits for finished or no longer exists. Moves nothing.
create function parked_run_is_due(p_run_id text) returns boolean
language sql stable
set search_path from current
as $$
    select exists (
        select from waits w
        where w.run_id = p_run_id
          and (w.timeout_at <= now()
               or (w.kind = 'event' and exists (
                       select from events e
                       where e.run_id = p_run_id and e.name = w.target
                         and e.consumed_by is null
                         and (w.timeout_at is null or e.sent_at <= w.timeout_at)))
               or (w.kind = 'run' and not exists (
                       select from runs t
                       where t.id = w.target
                         and t.status not in ('completed', 'dead_letter', 'cancelled')))))
$$;

-- park as in 0014, its rule for "due now" in parked_run_is_due (a wait for a run that is gone
-- included).
create or replace function park(p_run_id text, p_epoch bigint, p_steps text[])
returns timestamptz
language plpgsql
set search_path from current
as $$
declare
    v_targets text[];
    v_due timestamptz;
begin
    perform lock_held_run(p_run_id, p_epoch, array['running']);
    delete from waits w where w.run_id = p_run_id and w.step <> all(p_steps);
    v_targets := array(
        select t.id from waits w join runs t on t.id = w.target
        where w.run_id = p_run_id and w.kind = 'run');
    if cardinality(v_targets) > cardinality(array(
            select t.id from runs t where t.id = any(v_targets)
            order by t.id
            for share skip locked)) then
        raise exception 'run % is busy: a run it waits for is held by another transaction;'
            ' try again', p_run_id using errcode = 'WF005';
    end if;
    if parked_run_is_due(p_run_id) then
        v_due := now();
    else
        -- "never" is the last day clients can read ('infinity' would break every reader)
        select coalesce(min(w.timeout_at), timestamptz '9999-12-31 00:00:00+00') into v_due
        from waits w
        where w.run_id = p_run_id;
    end if;
    perform release_held_run(p_run_id, v_due);
    return nullif(v_due, timestamptz '9999-12-31 00:00:00+00');
end
$$;

-- wake_missed_waiters as in 0014, but a run is made due only while one of its waits is
-- satisfied: a wake-up that is stale by now (the run was woken otherwise, ran on, and waits
-- for a retry's backoff or another wait) is settled without waking anything.
create or replace function wake_missed_waiters() returns integer
language plpgsql
set search_path from current
as $$
declare
    v_settled integer;
    v_queues text[];
begin
    with gone as (
        delete from missed_wakeups m
        where not exists (select from runs r where r.id = m.run_id)
        returning m.run_id
    ), free as (
        select r.id from missed_wakeups m
        join runs r on r.id = m.run_id
        order by m.run_id
        limit 1000
        for no key update of r skip locked
    ), woken as (
        update runs r set scheduled_for = now()
        from free f
        where r.id = f.id and r.status = 'pending' and r.scheduled_for > now()
          and parked_run_is_due(r.id)
        returning r.queue
    ), settled as (
        delete from missed_wakeups m
        using free f
        where m.run_id = f.id
        returning m.run_id
    )
    select (select count(*) from gone) + (select count(*) from settled),
           (select array_agg(distinct w.queue) from woken w)
    into v_settled, v_queues;
    perform pg_notify(wakeup_channel(), q) from unnest(v_queues) q;
    return v_settled;
end
$$;

-- wait_for_run as in 0009, but the target's row is key-share locked while the wait registers
-- (see the header), and the recorded outcome names the run it is about.
create or replace function wait_for_run(
    p_run_id text, p_epoch bigint, p_step text, p_target text, p_position integer default null
) returns table (outcome text, status text, output jsonb, error jsonb)
language plpgsql
set search_path from current
as $$
declare
    v_target runs;
    v_recorded jsonb;
begin
    perform check_name('wait name', p_step);
    perform lock_held_run(p_run_id, p_epoch, array['running']);
    select s.output into v_recorded from steps s
    where s.run_id = p_run_id and s.name = p_step;
    if not found then
        begin
            select * into v_target from runs r where r.id = p_target for key share nowait;
        exception
            when lock_not_available then  -- an operator's cancel, a purge: try again
                raise exception 'run % is busy: run %, which it waits for, is held by another'
                    ' transaction; try again', p_run_id, p_target using errcode = 'WF005';
        end;
        if not found then
            raise exception 'run % not found', p_target using errcode = 'WF002';
        end if;
        if v_target.status not in ('completed', 'dead_letter', 'cancelled') then
            insert into waits (run_id, step, kind, target)
            values (p_run_id, p_step, 'run', p_target)
            on conflict do nothing;
            outcome := 'waiting';
            return next;
            return;
        end if;
        v_recorded := jsonb_build_object('status', v_target.status, 'output', v_target.output,
                                         'error', v_target.error, 'run_id', v_target.id);
        perform record_wait(p_run_id, p_step, 'run', v_recorded, p_position);
    end if;
    outcome := 'finished';
    status := v_recorded ->> 'status';
    output := v_recorded -> 'output';
    error := v_recorded -> 'error';
    return next;
end
$$;
