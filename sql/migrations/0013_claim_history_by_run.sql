-- 0013_claim_history_by_run: claim looks up each claimed run's history by that run alone.
--
-- claim says, for each run it hands out, whether the run has steps or timers to replay. It
-- asked with exists() subqueries, which the planner may turn into a hash of the whole table,
-- built at every call, when it thinks the table small. claim keeps one generic plan per
-- connection, often made when steps is nearly empty (a new install, a worker that starts
-- with its queue): the plan stayed, and every claim then read every step of every run, so a
-- drain's claims grew slower with every step it wrote (a claim of 26 runs read 2,666 steps,
-- 1.2 of its 2.2 ms; with 20,000 steps, 428 pages for a claim of 3 runs). A lateral
-- subquery with limit 1 cannot be hashed: it probes the index of each table per run and
-- stops at the first row.

-- claim as in 0003 (and 0011's setting), but for how it computes has_history.
create or replace function claim(
    p_worker text, p_workflows text[], p_queues text[], p_limit integer, p_lease interval
) returns table (
    run_id text, workflow text, status text, input jsonb, attempt integer, generation integer,
    lease_epoch bigint, has_history boolean
)
language plpgsql
set search_path from current
-- its statements' plans are the same whatever the arguments (index ranges per queue and
-- workflow); custom plans were made afresh at every call, a third of a one-run claim. A
-- generic plan's cost is estimated for any limit, high enough on a large table to start the
-- JIT compiler (8 ms a statement, for work of a few index pages): never for these calls
set plan_cache_mode = force_generic_plan
set jit = off
set enable_seqscan = off
as $$
declare
    v_queues text[] := array(select distinct q from unnest(p_queues) q where q is not null);
    v_workflows text[] := array(select distinct w from unnest(p_workflows) w where w is not null);
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
        -- the next priority level below v_priority at which a served queue has runs of a
        -- served workflow
        select max(l.priority) into v_priority
        from unnest(v_queues) q (name)
        cross join unnest(v_workflows) w (name)
        cross join lateral (
            select r.priority from runs r
            where r.queue = q.name and r.workflow = w.name
              and r.status in ('pending', 'running', 'compensating')
              and (v_priority is null or r.priority < v_priority)
            order by r.priority desc
            limit 1) l;
        exit when v_priority is null;
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
    -- one probe of each index per run, stopped at the first row (see the header)
    left join lateral (
        select true as present from steps s where s.run_id = r.id
        union all
        select true from timers t where t.run_id = r.id
        limit 1
    ) h on true
    order by c.ord;
end
$$;
