-- 0080_heartbeat_and_release_check_their_batches: heartbeat and release refuse run id and
-- epoch lists of different lengths (WF003), as checkpoint_steps and complete_runs do since
-- 0050.
--
-- Both pair the lists item by item with unnest, which pads the shorter one with NULLs. Typed
-- by hand, heartbeat('w', null, array[3], ...) answered 'lost' for a run id of NULL, and
-- release(array['a', 'b'], array[3]) released a and passed over b without a word. The worker
-- always sends lists of one length; two NULL lists stay an empty batch.

-- heartbeat as in 0075, its lists checked first. It moves the locked_until of the runs the
-- worker still holds; lock order as before: the worker's row, then the runs, never waiting.
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
    if p_worker is null then
        raise exception 'worker must not be null' using errcode = 'WF003';
    end if;
    perform check_batch('heartbeat', array[cardinality(p_run_ids), cardinality(p_epochs)]);
    p_lease := checked_lease(p_lease);
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

-- release as in 0003, its lists checked first. It gives a stopping worker's unfinished runs
-- back at once, so another worker takes them now rather than after lease expiry. Runs whose
-- token is stale are left alone, and so are runs whose row another transaction holds (never
-- waited for: a stopping worker must exit; their leases expire). Returns how many were
-- released.
create or replace function release(p_run_ids text[], p_epochs bigint[]) returns integer
language plpgsql
set search_path from current
as $$
declare
    v_count integer := 0;
    v_id text;
begin
    perform check_batch('release', array[cardinality(p_run_ids), cardinality(p_epochs)]);
    for v_id in
        select r.id from runs r
        join unnest(p_run_ids, p_epochs) as h (id, epoch) on r.id = h.id and r.lease_epoch = h.epoch
        where r.status in ('running', 'compensating')
        order by r.id
        for update of r skip locked
    loop
        perform release_held_run(v_id, now());
        v_count := v_count + 1;
    end loop;
    return v_count;
end
$$;
