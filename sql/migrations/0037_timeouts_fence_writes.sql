-- 0037_timeouts_fence_writes: a run past its timeout takes no more writes from its worker,
-- send_event waits for a run's row no longer than cancel does, and a hand-off's payload is
-- built by a function planned once per session.
--
-- A run's timeout was enforced only by dead_letter_stalled_runs, which claims and heartbeats
-- call: a worker busy with its runs claims nothing, and heartbeats every third of a lease, so
-- a worker frozen (SIGSTOP, a paused VM) past a run's timeout could thaw and checkpoint and
-- complete the run before any sweep ran, although the README says such a run ends
-- dead_letter with a Timeout. Every fenced write now refuses a run past its timeout as it
-- refuses a stale lease (WF001, or lease_lost in the batch functions); the next sweep ends it.
-- A compensating run has no timeout (the sweep leaves it too): its undo must be able to end.
--
-- send_event key-share locked the run with no bound: an operator's transaction left open on
-- the row (a cancel in psql) held an application's send_event, or `flowly send-event`, for as
-- long. It now gives up after 5 s with WF005 (RunBusy, try again), as cancel does.

-- check_fence as in 0003, a run past its timeout fenced like a stale lease.
create or replace function check_fence(
    p_run_id text, p_epoch bigint, p_statuses text[], p_run runs, p_locked boolean
) returns runs
language plpgsql
set search_path from current
as $$
begin
    if not p_locked then
        if exists (select from runs r where r.id = p_run_id) then
            raise exception 'run % is busy: another transaction holds its row; try again',
                p_run_id using errcode = 'WF005';
        end if;
        raise exception 'run % not found', p_run_id using errcode = 'WF002';
    end if;
    if p_run.lease_epoch <> p_epoch or p_run.status <> all(p_statuses) then
        raise exception 'lease lost on run %: fencing token % is stale (run is % at epoch %)',
            p_run_id, p_epoch, p_run.status, p_run.lease_epoch using errcode = 'WF001';
    end if;
    if p_run.timeout_at < now() and p_run.status <> 'compensating' then
        raise exception 'lease lost on run %: its timeout ended at %', p_run_id,
            p_run.timeout_at using errcode = 'WF001';
    end if;
    return p_run;
end
$$;

-- checkpoint_steps as in 0034, a run past its timeout fenced.
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
            select r.id, r.lease_epoch, r.generation, r.status, r.takeovers, r.timeout_at
            from runs r
            where r.id = any(p_run_ids)
            order by r.id
            for no key update of r skip locked
        ), valid as (
            select i.*, f.generation, f.takeovers from items i
            join fenced f on f.id = i.run_id and f.lease_epoch = i.epoch
            where f.status in ('running', 'compensating')
              and (f.timeout_at is null or f.timeout_at >= now() or f.status = 'compensating')
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
                  and r.status in ('running', 'compensating')
                  and (r.timeout_at is null or r.timeout_at >= now()
                       or r.status = 'compensating'));
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

-- complete_runs as in 0034, a run past its timeout fenced.
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
        select r.id, r.lease_epoch, r.status, r.timeout_at from runs r
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
          and (l.timeout_at is null or l.timeout_at >= now())
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
              and r.status = 'running' and (r.timeout_at is null or r.timeout_at >= now()))
            else false end as busy
    ) b
    order by i.ord;
end
$$;

-- handoff_payload as in 0036, in PL/pgSQL: a SQL function with a search_path of its own is
-- never inlined, and its query was parsed and planned again at each call, twice a hand-off
-- (about 55 us a call, a fifth of what a hand-off adds to a start).
create or replace function handoff_payload(
    p_id text, p_workflow text, p_input jsonb, p_lease interval, p_lease_until timestamptz
) returns text
language plpgsql stable
set search_path from current
as $$
begin
    return json_build_object(
        'run_id', p_id, 'workflow', p_workflow, 'input', p_input, 'attempt', 1,
        'generation', 1, 'lease_epoch', 1,
        'lease_seconds', extract(epoch from handoff_lease(p_lease)),
        'lease_until', extract(epoch from p_lease_until))::text;
end
$$;

-- send_event as in 0027, its wait for the run's row bounded as cancel's is.
create or replace function send_event(run_id text, name text, payload jsonb default 'null')
returns bigint
language plpgsql
set search_path from current
set lock_timeout = '5s'
as $$
declare
    v_status text;
    v_seq bigint;
begin
    perform check_name('event name', send_event.name);
    select r.status into v_status from runs r where r.id = send_event.run_id for key share;
    if not found then
        raise exception 'run % not found', send_event.run_id using errcode = 'WF002';
    end if;
    if v_status in ('completed', 'dead_letter', 'cancelled') then
        raise exception 'run % is %: it takes no more events', send_event.run_id, v_status
            using errcode = 'WF004';
    end if;
    insert into events (run_id, name, payload, sent_at)
    values (send_event.run_id, send_event.name, coalesce(send_event.payload, 'null'),
            clock_timestamp())
    returning seq into v_seq;
    perform wake_waiters(array[send_event.run_id], send_event.name);
    return v_seq;
exception
    when lock_not_available then
        raise exception 'run % is busy: another transaction has held its row for over %;'
            ' try again', send_event.run_id, current_setting('lock_timeout')
            using errcode = 'WF005';
end
$$;
