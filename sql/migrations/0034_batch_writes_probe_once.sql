-- 0034_batch_writes_probe_once: claim, checkpoint_steps and complete_runs look up each run
-- and step as often as the common case needs, not once more per item "in case".
--
-- Each of the three answered questions that arise only for a run another transaction holds or
-- a step stored before (is the row busy? what output is stored?) with a lateral lookup per
-- item whose condition PostgreSQL applies after the lookup, not before: every item of every
-- batch paid an index probe of runs, checkpoint_steps one of steps too, and claim probed steps
-- and timers for history of runs claimed for the first time, which can have none (a run's
-- lease epoch only grows, and only a lease holder writes steps and timers). checkpoint_steps
-- also matched its inserted rows to its items by a nested loop over the insert's result (its
-- generic plan expects one row): 16,384 comparisons for a batch of 128. claim read back each
-- run it had just updated; the update now returns them.
--
-- Called straight from psycopg, batches of 128 (bench/batch_cost.py's shape), in turns with
-- 0033's functions in one database: claim 70 -> 64, checkpoint_steps 98 -> 78, complete_runs
-- 86 -> 81 microseconds per run. Results and their order are unchanged.

-- checkpoint_steps as in 0012, the rare lookups made in the loop for the items that need them.
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
-- the items are matched to their inserted rows by hash: a nested loop compares every pair
set enable_nestloop = off
as $$
#variable_conflict use_column
declare
    v_item record;
    v_bad text;
    v_progressed text[];
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
            select r.id, r.lease_epoch, r.generation, r.status, r.takeovers from runs r
            where r.id = any(p_run_ids)
            order by r.id
            for no key update of r skip locked
        ), valid as (
            select i.*, f.generation, f.takeovers from items i
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
        )
        select i.run_id, i.name, i.epoch, v.ord is null as unfenced, f.id is null as unlocked,
               n.output, n.seq, n.run_id is not null and v.takeovers > 0 as progressed
        from items i
        left join valid v on v.ord = i.ord
        left join fenced f on f.id = i.run_id
        left join inserted n on n.run_id = i.run_id and n.name = i.name
        order by i.ord
    loop
        run_id := v_item.run_id;
        name := v_item.name;
        busy := false;
        output := v_item.output;
        seq := v_item.seq;
        if v_item.unfenced then
            -- not locked, yet its token still current: another transaction holds the row
            busy := v_item.unlocked and exists (
                select from runs r where r.id = v_item.run_id and r.lease_epoch = v_item.epoch
                  and r.status in ('running', 'compensating'));
        elsif seq is null then
            -- a duplicate: stored before, or committed while our insert waited for it (after
            -- the statement's snapshot was taken: this new statement sees it)
            select s.output, s.seq into output, seq
            from steps s where s.run_id = v_item.run_id and s.name = v_item.name;
        end if;
        lease_lost := v_item.unfenced and not busy;
        if v_item.progressed then
            v_progressed := v_progressed || v_item.run_id;
        end if;
        return next;
    end loop;
    if v_progressed is not null then
        -- a new checkpoint is progress: only takeovers in a row without one mark a poison run
        -- (the rows are still locked by the statement above)
        update runs r set takeovers = 0 where r.id = any(v_progressed);
    end if;
end
$$;

-- complete_runs as in 0024, the busy lookup made only for a row it could not lock.
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
        for update skip locked
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
    -- not locked, yet its token still current: another transaction holds the row
    cross join lateral (
        select case when l.id is null then exists (
            select from runs r where r.id = i.id and r.lease_epoch = i.epoch
              and r.status = 'running') else false end as busy
    ) b
    order by i.ord;
end
$$;

-- claim as in 0017, returning the runs from its update and probing history only where
-- there can be some.
create or replace function claim(
    p_worker text, p_workflows text[], p_queues text[], p_limit integer, p_lease interval
) returns table (
    run_id text, workflow text, status text, input jsonb, attempt integer, generation integer,
    lease_epoch bigint, has_history boolean
)
language plpgsql
set search_path from current
-- see 0013 for these settings
set plan_cache_mode = force_generic_plan
set jit = off
set enable_seqscan = off
as $$
declare
    v_queues text[] := array(select distinct q from unnest(p_queues) q where q is not null);
    v_workflows text[] := array(select distinct w from unnest(p_workflows) w where w is not null);
    -- the levels above this one are done; above every integer priority at first
    v_below bigint := 2147483648;
    v_priority integer;
    v_ids text[] := '{}';
    v_tried text[] := '{}';
    v_due text[];
begin
    if p_limit is null or p_limit < 1 then
        raise exception 'claim limit must be a positive number of runs, got %',
            coalesce(p_limit::text, 'null') using errcode = 'WF003';
    end if;
    perform check_lease(p_lease);
    perform dead_letter_stalled_runs();
    loop
        -- the next priority level below v_below at which a served queue has runs of a
        -- served workflow
        select max(l.priority) into v_priority
        from unnest(v_queues) q (name)
        cross join unnest(v_workflows) w (name)
        cross join lateral (
            select r.priority from runs r
            where r.queue = q.name and r.workflow = w.name
              and r.status in ('pending', 'running', 'compensating')
              and r.priority < v_below
            order by r.priority desc
            limit 1) l;
        exit when v_priority is null;
        v_below := v_priority;
        loop
            -- the longest due runs of this level, merged from one range per queue and
            -- workflow; those another claim holds were tried and are not read again
            v_due := array(
                select d.id from unnest(v_queues) q (name)
                cross join unnest(v_workflows) w (name)
                cross join lateral (
                    select r.id, r.available_at from runs r
                    where r.queue = q.name and r.workflow = w.name and r.priority = v_priority
                      and r.status in ('pending', 'running', 'compensating')
                      and r.available_at <= now()
                      and (r.timeout_at is null or r.timeout_at >= now()
                           or r.status = 'compensating')
                      and r.id <> all(v_tried)
                    order by r.available_at
                    limit p_limit - cardinality(v_ids)) d
                order by d.available_at
                limit p_limit - cardinality(v_ids));
            exit when cardinality(v_due) = 0;
            v_tried := v_tried || v_due;
            -- locked, and checked again on the version locked (a claim that committed
            -- meanwhile may have taken the run)
            v_ids := v_ids || array(
                select r.id from runs r
                where r.id = any(v_due) and r.status in ('pending', 'running', 'compensating')
                  and r.available_at <= now()
                  and (r.timeout_at is null or r.timeout_at >= now()
                       or r.status = 'compensating')
                order by r.available_at
                for update skip locked);
            exit when cardinality(v_ids) >= p_limit;
        end loop;
        exit when cardinality(v_ids) >= p_limit;
    end loop;
    if cardinality(v_ids) = 0 then
        return;
    end if;
    update timers t set fired_at = now()
    where t.run_id = any(v_ids) and t.fired_at is null and t.wake_at <= now();
    return query
    with claimed as (
        update runs r
        set status = case r.status when 'pending' then 'running' else r.status end,
            lease_epoch = r.lease_epoch + 1,
            takeovers = r.takeovers
                + (r.locked_until is not null and not worker_alive(r.locked_by))::integer,
            locked_by = p_worker,
            locked_until = now() + p_lease,
            started_at = coalesce(r.started_at, now())
        where r.id = any(v_ids)
        returning r.id, r.workflow, r.status, r.input, r.attempt, r.generation, r.lease_epoch
    )
    select r.id, r.workflow, r.status, r.input, r.attempt, r.generation, r.lease_epoch,
           h.present is not null
    from unnest(v_ids) with ordinality as c (id, ord)
    join claimed r on r.id = c.id
    -- one probe of each index per run, stopped at the first row (see 0013); none for a run
    -- claimed for the first time, which has written nothing (epochs only grow)
    left join lateral (
        select true as present from steps s where r.lease_epoch > 1 and s.run_id = r.id
        union all
        select true from timers t where r.lease_epoch > 1 and t.run_id = r.id
        limit 1
    ) h on true
    order by c.ord;
end
$$;
