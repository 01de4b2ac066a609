-- 0017_claim_skips_priorities_not_due: runs that are not due at a higher priority no longer
-- cost claim a read of each.
--
-- claim walks the priority levels that have live runs from the top, one index range per level.
-- It found the next level down with "v_priority is null or r.priority < v_priority", which its
-- generic plan could only apply as a filter: every level's look-up read the index from the top
-- priority again. 5,000 runs sleeping (or parked on an event, or held by workers) at priority 1
-- made a claim of one due run at priority 0 read 5,004 index entries; one run not due at each
-- of 1,000 levels, 501,502 (20,000 levels: over a minute a claim). The bound is now a plain
-- comparison with a value (above every integer when there is none), which the index range
-- takes: a level costs a look-up of a few entries, whatever waits above it.

-- claim as in 0013, but for the bound of the next priority level.
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
    update runs r
    set status = case r.status when 'pending' then 'running' else r.status end,
        lease_epoch = r.lease_epoch + 1,
        takeovers = r.takeovers
            + (r.locked_until is not null and not worker_alive(r.locked_by))::integer,
        locked_by = p_worker,
        locked_until = now() + p_lease,
        started_at = coalesce(r.started_at, now())
    where r.id = any(v_ids);
    update timers t set fired_at = now()
    where t.run_id = any(v_ids) and t.fired_at is null and t.wake_at <= now();
    return query
    select r.id, r.workflow, r.status, r.input, r.attempt, r.generation, r.lease_epoch,
           h.present is not null
    from unnest(v_ids) with ordinality as c (id, ord)
    join runs r on r.id = c.id
    -- one probe of each index per run, stopped at the first row (see 0013)
    left join lateral (
        select true as present from steps s where s.run_id = r.id
        union all
        select true from timers t where t.run_id = r.id
        limit 1
    ) h on true
    order by c.ord;
end
$$;
