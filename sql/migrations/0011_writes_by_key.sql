-- 0011_writes_by_key: a worker's batched writes reach their runs by primary key, whatever the
-- statistics say.
--
-- checkpoint_steps, complete_runs and heartbeat named each run by id *and* by status. When the
-- statistics were taken with few runs running (the usual case: running runs are a sliver of a
-- table of finished ones), the planner read the status index instead of the primary key: every
-- call visited every running run of every worker, and the dead index entries every claim and
-- completion leaves until a vacuum (3,000 runs held elsewhere: 1,400 pages for one checkpoint).
-- Now the rows are locked by id alone and the status and fencing token are checked on the row
-- the lock returns, which is also the current version of it.
--
-- The batch functions keep their generic plans for the life of a connection, and the first
-- call may plan them while the tables are nearly empty (a new install, a truncated table):
-- a sequential scan chosen then stays, growing with the table, until something invalidates
-- the plan. They never need one, so they may not use one.

-- checkpoint_steps as in 0003 (each item fenced on its own, busy or lease_lost never waited
-- for, the stored output returned); its runs locked by id alone, as above.
create or replace function checkpoint_steps(
    p_run_ids text[], p_epochs bigint[], p_names text[], p_outputs jsonb[],
    p_started_at timestamptz[], p_compensable boolean[], p_positions integer[]
) returns table (
    run_id text, name text, lease_lost boolean, busy boolean, output jsonb, seq bigint
)
language plpgsql
set search_path from current
set plan_cache_mode = force_generic_plan
set jit = off
set enable_seqscan = off
as $$
#variable_conflict use_column
declare
    v_item record;
    v_bad text;
begin
    select n into v_bad from unnest(p_names) n
    where n is null or n = '' or octet_length(n) > max_name_bytes()
    limit 1;
    if found then
        perform check_name('step name', v_bad);
    end if;
    for v_item in
        with items as (
            select i.run_id, i.epoch, i.name, i.output, i.started_at, i.compensable,
                   i.position, i.ord
            from unnest(p_run_ids, p_epochs, p_names, p_outputs, p_started_at, p_compensable,
                        p_positions)
                with ordinality as i (run_id, epoch, name, output, started_at, compensable,
                                      position, ord)
        ), fenced as (
            select r.id, r.lease_epoch, r.generation, r.status from runs r
            where r.id = any(p_run_ids)
            order by r.id
            for no key update of r skip locked
        ), valid as (
            select i.*, f.generation from items i
            join fenced f on f.id = i.run_id and f.lease_epoch = i.epoch
            where f.status in ('running', 'compensating')
        ), inserted as (
            insert into steps as s (run_id, name, seq, position, status, output, attempts,
                                    started_at, compensable)
            select v.run_id, v.name, nextval('step_seq'), v.position, 'completed', v.output,
                   1 + (select count(*) from step_attempts a
                        where a.run_id = v.run_id and a.step_name = v.name
                          and a.generation = v.generation),
                   v.started_at, v.compensable
            from valid v
            order by v.ord
            on conflict do nothing
            returning s.run_id, s.name, s.output, s.seq
        ), progressed as (
            -- a new checkpoint is progress: only takeovers in a row without one mark a poison run
            update runs r set takeovers = 0
            from (select distinct n.run_id from inserted n) n
            where r.id = n.run_id and r.takeovers > 0
        )
        select i.run_id, i.name, v.ord is null as unfenced,
               -- not locked, yet its token still current: another transaction holds the row
               coalesce(v.ord is null and f.id is null and now_held.lease_epoch = i.epoch
                        and now_held.status in ('running', 'compensating'), false) as busy,
               case when n.run_id is not null then n.output else stored.output end as output,
               coalesce(n.seq, stored.seq) as seq
        from items i
        left join valid v on v.ord = i.ord
        left join fenced f on f.id = i.run_id
        left join inserted n on n.run_id = i.run_id and n.name = i.name
        left join lateral (
            select s.output, s.seq from steps s
            where v.ord is not null and n.run_id is null and s.run_id = i.run_id
              and s.name = i.name
        ) stored on true
        left join lateral (
            select r.lease_epoch, r.status from runs r
            where v.ord is null and f.id is null and r.id = i.run_id
        ) now_held on true
        order by i.ord
    loop
        run_id := v_item.run_id;
        name := v_item.name;
        busy := v_item.busy;
        lease_lost := v_item.unfenced and not v_item.busy;
        output := v_item.output;
        seq := v_item.seq;
        if not v_item.unfenced and seq is null then
            -- a duplicate committed while our insert waited for it, after the statement's
            -- snapshot was taken: this new statement sees it
            select s.output, s.seq into output, seq
            from steps s where s.run_id = v_item.run_id and s.name = v_item.name;
        end if;
        return next;
    end loop;
end
$$;

-- complete_runs as in 0003 (runs completed with their output, lease dropped; busy or
-- lease_lost items change nothing); its runs locked by id alone, as above.
create or replace function complete_runs(p_run_ids text[], p_epochs bigint[], p_outputs jsonb[])
returns table (run_id text, lease_lost boolean, busy boolean)
language plpgsql
set search_path from current
set plan_cache_mode = force_generic_plan
set jit = off
set enable_seqscan = off
as $$
begin
    return query
    with items as (
        select i.id, i.epoch, i.output, i.ord
        from unnest(p_run_ids, p_epochs, p_outputs) with ordinality as i (id, epoch, output, ord)
    ), locked as (
        select r.id, r.lease_epoch, r.status from runs r
        where r.id = any(p_run_ids)
        order by r.id
        for no key update skip locked
    ), done as (
        update runs r
        set status = 'completed', output = i.output, error = null, finished_at = now(),
            locked_by = null, locked_until = null
        from items i
        join locked l on l.id = i.id
        where r.id = l.id and l.lease_epoch = i.epoch and l.status = 'running'
        returning r.id
    )
    select i.id, d.id is null and not b.busy, d.id is null and b.busy
    from items i
    left join done d on d.id = i.id
    left join locked l on l.id = i.id
    left join lateral (
        select r.lease_epoch, r.status from runs r where l.id is null and r.id = i.id
    ) now_held on true
    -- not locked, yet its token still current: another transaction holds the row
    cross join lateral (
        select coalesce(l.id is null and now_held.lease_epoch = i.epoch
                        and now_held.status = 'running', false) as busy
    ) b
    order by i.ord;
end
$$;

-- heartbeat as in 0003 (extends the leases, reports the runs it did not extend as busy or
-- lost); its lock checks the status on the locked row, as above.
create or replace function heartbeat(
    p_worker text, p_run_ids text[], p_epochs bigint[], p_lease interval
) returns table (run_id text, outcome text)
language plpgsql
set search_path from current
set enable_seqscan = off
as $$
declare
    v_extended text[];
begin
    perform check_lease(p_lease);
    update workers set last_seen_at = now() where id = p_worker;
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

-- claim keeps its statements (they read runs_claimable by design) but not the sequential
-- scan a plan made on near-empty tables could keep choosing
alter function claim(text, text[], text[], integer, interval) set enable_seqscan = off;
