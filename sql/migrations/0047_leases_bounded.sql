-- 0047_leases_bounded: a lease is at most a day, and a worker registers under a name.
--
-- A lease had no upper bound: a worker registered with a lease of 10^13 seconds (a typo, a
-- unit mistake) made `last_seen_at + lease` overflow the timestamp range, and every call that
-- asks whether a worker is alive (each claim's and each heartbeat's sweep for stalled runs,
-- the live_workers view) failed for every worker. A run held under such a lease would also
-- never be taken over. register_worker took an empty or NULL worker name as well.

-- check_lease as in 0001, with an upper bound.
create or replace function check_lease(p_lease interval) returns void
language plpgsql
set search_path from current
as $$
begin
    if p_lease is null or p_lease <= interval '0' or p_lease > interval '1 day' then
        raise exception 'lease must be a positive interval of at most 1 day, got %',
            coalesce(p_lease::text, 'null') using errcode = 'WF003';
    end if;
end
$$;

-- register_worker as in 0001, its name and lease checked (WF003) before anything is written.
create or replace function register_worker(
    p_worker text, p_workflows text[], p_queues text[], p_lease interval
) returns void
language plpgsql
set search_path from current
as $$
begin
    perform check_name('worker', p_worker);
    perform check_lease(p_lease);
    delete from workers w where w.last_seen_at + 100 * w.lease < now();
    insert into workers (id, workflows, queues, lease)
    values (p_worker, p_workflows, p_queues, p_lease)
    on conflict (id) do update
    set workflows = excluded.workflows, queues = excluded.queues, lease = excluded.lease,
        last_seen_at = now();
end
$$;

-- a worker registered before with a longer lease keeps a lease that cannot overflow
update workers set lease = interval '1 day' where lease > interval '1 day';
