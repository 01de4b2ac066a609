-- 0014_wakeups_never_lost: a run that finishes while its waiter parks wakes it, a waiter's
-- locked row no longer stalls the statement that finishes what it waits for, and a wait's
-- deadline decides which events it may receive.
--
-- 0009's waker is the trigger that notes finished runs: it can see only the waits already
-- committed. A run finished by a transaction still in flight (an operator's open cancel, a
-- completion batch) was invisible to park's check, and the wait park then committed was
-- invisible to that trigger: the waiter stayed parked until 9999-12-31. park now share-locks
-- the rows of the runs it waits for, never waiting: one held by another transaction (which
-- may be finishing it) makes park report the waiter busy (WF005), and the worker parks again
-- shortly, when the finish has committed and can be seen. A finish that starts after park took
-- its share lock cannot take the row until park commits, and then sees the wait.
--
-- wake_waiters updated the waiters' rows and so waited for their locks: an operator holding a
-- parked run's row stalled every completion batch (and every claim's stalled-run sweep) that
-- finished a run it waited for. It now skips locked waiters and notes them in
-- missed_wakeups; workers apply those every poll interval (wake_missed_waiters), once the row
-- is free.
--
-- wait_for_event received events sent after its deadline (a worker reaching the run late took
-- them as arriving in time), and a wait whose timeout was recorded consumed an event meant for
-- the next wait of that name when asked again. A recorded outcome, payload or timeout, is now
-- returned as recorded, and only events sent by the deadline count.
--
-- Lock order as in 0009: a finishing run's row before the rows of the runs waiting for it;
-- park holds the waiting run's row before it share-locks the rows of the runs it waits for,
-- and never waits for those.

-- Parked runs whose wake-up found their row locked: made due by wake_missed_waiters once it
-- is free. No foreign key: the insert must not wait for the lock of the row it is about.
create table missed_wakeups (
    run_id text primary key,
    missed_at timestamptz not null default now()
);

-- wait_for_event as in 0009, but for the recorded outcome and the deadline.
create or replace function wait_for_event(
    p_run_id text, p_epoch bigint, p_step text, p_event text,
    p_timeout double precision default null, p_position integer default null
) returns table (outcome text, payload jsonb)
language plpgsql
set search_path from current
as $$
declare
    v_recorded jsonb;
    v_event events;
    v_timeout_at timestamptz;
begin
    perform check_name('wait name', p_step);
    perform check_name('event name', p_event);
    perform lock_held_run(p_run_id, p_epoch, array['running']);
    select s.output into v_recorded from steps s
    where s.run_id = p_run_id and s.name = p_step;
    if found then
        if v_recorded ? 'payload' then
            outcome := 'received';
            payload := v_recorded -> 'payload';
        else
            outcome := 'timeout';
        end if;
        return next;
        return;
    end if;
    -- the deadline written when the wait was first reached (none yet: no limit)
    select w.timeout_at into v_timeout_at from waits w
    where w.run_id = p_run_id and w.step = p_step;
    select * into v_event from events e
    where e.run_id = p_run_id and e.name = p_event and e.consumed_by is null
      and (v_timeout_at is null or e.sent_at <= v_timeout_at)
    order by e.seq
    limit 1;
    if found then
        update events e set consumed_by = p_step
        where e.run_id = p_run_id and e.seq = v_event.seq;
        perform record_wait(p_run_id, p_step, 'event',
                            jsonb_build_object('payload', v_event.payload), p_position);
        outcome := 'received';
        payload := v_event.payload;
        return next;
        return;
    end if;
    insert into waits (run_id, step, kind, target, timeout_at)
    values (p_run_id, p_step, 'event', p_event, now() + make_interval(secs => p_timeout))
    on conflict do nothing;
    select w.timeout_at into v_timeout_at from waits w
    where w.run_id = p_run_id and w.step = p_step;
    if v_timeout_at <= now() then
        perform record_wait(p_run_id, p_step, 'event', jsonb_build_object('timeout', true),
                            p_position);
        outcome := 'timeout';
    else
        outcome := 'waiting';
    end if;
    return next;
end
$$;

-- park as in 0009, but it first share-locks the runs waited for (see the header): WF005 when
-- another transaction holds one of them.
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
    if exists (
        select from waits w
        where w.run_id = p_run_id
          and (w.timeout_at <= now()
               or (w.kind = 'event' and exists (
                       select from events e
                       where e.run_id = p_run_id and e.name = w.target
                         and e.consumed_by is null
                         and (w.timeout_at is null or e.sent_at <= w.timeout_at)))
               or (w.kind = 'run' and exists (
                       select from runs t
                       where t.id = w.target
                         and t.status in ('completed', 'dead_letter', 'cancelled'))))) then
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

-- Makes parked runs due now and wakes workers: the ones waiting for one of p_run_ids to
-- finish or, with p_event, those of p_run_ids waiting for an event of that name. Never waits
-- for a lock: a waiter whose row another transaction holds is noted in missed_wakeups.
create or replace function wake_waiters(p_run_ids text[], p_event text default null)
returns void
language plpgsql
set search_path from current
as $$
declare
    v_parked text[];
    v_queues text[];
begin
    v_parked := array(
        select distinct w.run_id from waits w
        join runs r on r.id = w.run_id
        where ((p_event is null and w.kind = 'run' and w.target = any(p_run_ids))
               or (p_event is not null and w.kind = 'event' and w.target = p_event
                   and w.run_id = any(p_run_ids)))
          and r.status = 'pending' and r.scheduled_for > now());
    if cardinality(v_parked) = 0 then
        return;
    end if;
    with locked as (
        select r.id from runs r
        where r.id = any(v_parked) and r.status = 'pending' and r.scheduled_for > now()
        order by r.id
        for no key update skip locked
    ), woken as (
        update runs r set scheduled_for = now()
        from locked l
        where r.id = l.id
        returning r.queue
    ), missed as (
        insert into missed_wakeups (run_id)
        select p.id from unnest(v_parked) p (id)
        where p.id not in (select l.id from locked l)
        on conflict do nothing
    )
    select array_agg(distinct woken.queue) into v_queues from woken;
    perform pg_notify(wakeup_channel(), q) from unnest(v_queues) q;
end
$$;

-- Applies the wake-ups wake_waiters could not (their run's row was locked): each run still
-- parked becomes due now. One whose row is still locked keeps its wake-up for the next call,
-- and does not count towards the batch (1,000 held rows must not starve a free one); one that
-- no longer exists loses it. Workers call this every poll interval; returns how many wake-ups
-- it settled.
create function wake_missed_waiters() returns integer
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
