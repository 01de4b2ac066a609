-- 0055_backoffs_not_cut_short_by_events: an event sent to a run waiting out a step's retry
-- backoff is kept for it, and no longer wakes it before the backoff ends.
--
-- A step that failed beside a pending event wait (asyncio.gather) released its run until the
-- step's retry_at; the wait, which has a deadline, stayed registered (0042). An event sent
-- for it meanwhile made the run due at once (wake_waiters), and the replay tried the failed
-- step again there and then: a 6 s backoff ended after 1.5 s, whenever an event came. A
-- backoff is what a caller asks for to spare a failing service, so no event may cut it short.
--
-- A run with a failed step attempt of its generation whose retry_at is still ahead, and no
-- checkpoint of that step since, is in its backoff (retry_backoff_pending). wake_waiters and
-- wake_missed_waiters leave such a run as it is: it is due at retry_at anyway (its
-- scheduled_for), and its replay then receives the event (sent within the wait's deadline, it
-- counts as received in time). Other wake-ups are unchanged.

-- Whether the run waits out a failed step's retry backoff now.
create function retry_backoff_pending(p_run_id text) returns boolean
language plpgsql stable
set search_path from current
as $$
begin
    return exists (
        select from step_attempts a
        join runs r on r.id = a.run_id and r.generation = a.generation
        where a.run_id = p_run_id and a.retry_at > now()
          and not exists (select from steps s
                          where s.run_id = a.run_id and s.name = a.step_name));
end
$$;

-- wake_waiters as in 0025, leaving runs in a retry backoff alone.
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
          and r.status = 'pending' and r.scheduled_for > now()
          and not retry_backoff_pending(r.id));
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
    )
    select array_agg(distinct woken.queue) into v_queues from woken;
    perform pg_notify(wakeup_channel(), q) from unnest(v_queues) q;
end
$$;

-- wake_missed_waiters as in 0022, settling a wake-up of a run in a retry backoff unapplied.
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
          and parked_run_is_due(r.id) and not retry_backoff_pending(r.id)
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
