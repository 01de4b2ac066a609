-- 0025_missed_wakeups_kept_apart: a wake-up noted while another is being settled is kept, and
-- noting one never waits.
--
-- missed_wakeups had one row per run, inserted with `on conflict do nothing`. Two defects
-- followed from merging a new wake-up into an old one:
-- - wake_missed_waiters locks the waiter's row, finds with its snapshot that no wait is
--   satisfied yet, and deletes the entry as settled. A completion that committed in between
--   found the row locked and noted a wake-up, but its insert did nothing (the old entry was
--   still there), and the delete then removed the only trace: the waiter stayed parked with a
--   finished target.
-- - A completion inserting the key of an entry another transaction had inserted and not
--   committed (an operator's open cancel of another of the waiter's targets) waited for that
--   transaction: a worker's call waiting on a lock.
-- Each wake-up now is a row of its own. A row is committed with the finish that noted it, so a
-- wake_missed_waiters whose snapshot sees the row sees the finish too, and one that does not
-- see the row does not delete it.

alter table missed_wakeups drop constraint missed_wakeups_pkey;
create index missed_wakeups_run on missed_wakeups (run_id);

-- wake_waiters as in 0014, with a row for each wake-up it cannot apply (see the header).
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
    )
    select array_agg(distinct woken.queue) into v_queues from woken;
    perform pg_notify(wakeup_channel(), q) from unnest(v_queues) q;
end
$$;
