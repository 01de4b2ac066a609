-- 0059_heartbeats_past_a_held_worker_row: another transaction holding a worker's row in
-- workers no longer stops that worker's heartbeats.
--
-- heartbeat marks the worker alive (workers.last_seen_at) before it extends the leases of its
-- runs, and that update waited for a lock on the row: an admin's open `update workers ...`
-- or a `select ... for update` of the table held every run of the worker unextended. Its
-- heartbeats were cut off, the leases lapsed, and the worker took its own runs over, running
-- the step in progress again (4 times for a 4 s step under a 1.5 s lease). The row is now
-- skipped while held: only last_seen_at waits for a later beat, never a lease. A worker alive
-- but unseen for a while only looks stale (live_workers, Client.is_served) and makes no
-- takeover count as poison evidence, since its runs stay leased. register_worker's clean-up
-- of long-dead workers skips held rows the same way, so a worker's start does not wait for
-- them either. Lock order: the worker's row, then the runs (as before), never waiting.

-- heartbeat as in 0011 (with 0032's jit = off), the worker's row skipped while held.
create or replace function heartbeat(
    p_worker text, p_run_ids text[], p_epochs bigint[], p_lease interval
) returns table (run_id text, outcome text)
language plpgsql
set search_path from current
set enable_seqscan = off
set jit = off
as $$
declare
    v_extended text[];
begin
    perform check_lease(p_lease);
    update workers w set last_seen_at = now()
    where w.id = (select x.id from workers x where x.id = p_worker
                  for no key update skip locked);
    with held as (
        select r.id, r.status from runs r
        join unnest(p_run_ids, p_epochs) as h (id, epoch)
            on r.id = h.id and r.lease_epoch = h.epoch
        where r.id = any(p_run_ids)
        order by r.id
        for no key update of r skip locked
    ), extended as (
        update runs r set locked_until = now() + p_lease
        from held h
        where r.id = h.id and h.status in ('running', 'compensating')
        returning r.id
    )
    select coalesce(array_agg(e.id), '{}') into v_extended from extended e;
    perform dead_letter_stalled_runs();
    -- a new statement: it sees what the sweep just did to our runs (a timeout)
    return query
    select h.id,
           case when r.lease_epoch = h.epoch and r.status in ('running', 'compensating')
                then 'busy' else 'lost' end
    from unnest(p_run_ids, p_epochs) as h (id, epoch)
    left join runs r on r.id = h.id
    where not coalesce(h.id = any(v_extended) and r.lease_epoch = h.epoch
                       and r.status in ('running', 'compensating'), false);
end
$$;

-- register_worker as in 0047, its clean-up of long-dead workers skipping rows held elsewhere.
create or replace function register_worker(
    p_worker text, p_workflows text[], p_queues text[], p_lease interval
) returns void
language plpgsql
set search_path from current
as $$
begin
    perform check_name('worker', p_worker);
    perform check_lease(p_lease);
    delete from workers w
    where w.id in (select x.id from workers x
                   where x.last_seen_at + 100 * x.lease < now()
                   for update skip locked);
    insert into workers (id, workflows, queues, lease)
    values (p_worker, p_workflows, p_queues, p_lease)
    on conflict (id) do update
    set workflows = excluded.workflows, queues = excluded.queues, lease = excluded.lease,
        last_seen_at = now();
end
$$;
