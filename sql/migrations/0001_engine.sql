-- 0001_engine: the engine's tables and its state machine.
--
-- Runs inside the target schema: the installer sets search_path to
-- "<schema>, pg_catalog, pg_temp" for the transaction, objects are created unqualified, and
-- every function pins that search_path (set search_path from current), so nothing here
-- depends on the search_path of whoever calls it later.
--
-- Fencing: every claim bumps runs.lease_epoch and hands it to the worker; every write a worker
-- makes for a run presents it, and a stale one is refused with SQLSTATE WF001 (lease lost).
-- Releasing a run (sleep, retry backoff, shutdown, cancel) bumps it too.
--
-- SQLSTATEs: WF001 lease lost, WF002 run not found, WF003 invalid argument, WF004 invalid state.
--
-- Lock order: functions that touch a run and its steps/timers lock the runs row first (the
-- fence check is an update, or a select ... for update / for share, on runs), then write the
-- child rows. Batch forms (heartbeat, checkpoint_steps, complete_runs, release) lock their runs
-- rows in id order (order by id ... for update / for no key update, whose rows are locked
-- after the sort): an update's own plan would lock them in physical order, which row updates
-- keep changing, and two batches sharing runs (one worker's heartbeat and its group commit)
-- would deadlock. dead_letter_stalled_runs and claim take rows with skip locked, so they never
-- wait.

create table runs (
    id text primary key,
    workflow text not null,
    queue text not null default 'default',
    status text not null default 'pending',
    input jsonb not null default 'null',
    output jsonb,
    error jsonb,
    priority integer not null default 0,
    scheduled_for timestamptz not null default now(),
    concurrency_key text,
    attempt integer not null default 1,
    max_attempts integer not null default 3,
    timeout interval,
    timeout_at timestamptz,
    parent_run_id text,
    generation integer not null default 1,
    lease_epoch bigint not null default 0,
    -- claims of this run under an expired lease: its worker died (or froze) holding it
    takeovers integer not null default 0,
    locked_by text,
    locked_until timestamptz,
    -- when the run may next be claimed: its due time while unheld, its lease expiry while held
    available_at timestamptz generated always as (coalesce(locked_until, scheduled_for)) stored,
    compensation_ok boolean,
    created_at timestamptz not null default now(),
    started_at timestamptz,
    finished_at timestamptz,
    constraint runs_status_valid check (
        status in ('pending', 'running', 'compensating', 'completed', 'dead_letter', 'cancelled')),
    constraint runs_attempts_valid check (attempt >= 1 and max_attempts >= 1),
    constraint runs_id_not_empty check (id <> ''),
    constraint runs_workflow_not_empty check (workflow <> '')
);

-- The claim query's only access path; partial, so finished history never slows it down.
create index runs_claimable on runs (priority desc, available_at)
    where status in ('pending', 'running', 'compensating');
-- One live run per concurrency key; a new one is admitted once the last one finished.
create unique index runs_concurrency_key on runs (concurrency_key)
    where concurrency_key is not null and status in ('pending', 'running', 'compensating');
-- Held runs only (a handful per worker): finds expired leases without touching the backlog.
create index runs_leased on runs (locked_until) where locked_until is not null;
create index runs_timeout on runs (timeout_at)
    where timeout_at is not null and status in ('pending', 'running', 'compensating');
create index runs_workflow_status on runs (workflow, status);
create index runs_finished_at on runs (finished_at) where finished_at is not null;
create index runs_parent on runs (parent_run_id) where parent_run_id is not null;

-- One row per step that reached an outcome: 'completed' (the checkpoint) or 'failed'
-- (retries exhausted). Failed attempts before that live in step_attempts.
create table steps (
    run_id text not null references runs (id) on delete cascade,
    name text not null,
    seq bigint not null,
    status text not null,
    output jsonb,
    error jsonb,
    attempts integer not null default 1,
    started_at timestamptz not null,
    finished_at timestamptz not null default clock_timestamp(),
    compensable boolean not null default false,
    compensation_status text,
    compensation_error jsonb,
    compensated_at timestamptz,
    primary key (run_id, name),
    constraint steps_status_valid check (status in ('completed', 'failed')),
    constraint steps_compensation_status_valid check (
        compensation_status is null or compensation_status in ('completed', 'failed'))
);

-- Every failed attempt of a step, with the backoff decided for it.
create table step_attempts (
    run_id text not null references runs (id) on delete cascade,
    step_name text not null,
    generation integer not null,
    attempt integer not null,
    error jsonb not null,
    started_at timestamptz not null,
    failed_at timestamptz not null default clock_timestamp(),
    retry_at timestamptz,
    primary key (run_id, step_name, generation, attempt)
);

-- Durable timers: written once per (run, name); the wake time never moves on replay.
create table timers (
    run_id text not null references runs (id) on delete cascade,
    name text not null,
    wake_at timestamptz not null,
    created_at timestamptz not null default now(),
    fired_at timestamptz,
    primary key (run_id, name)
);

create index timers_unfired on timers (wake_at) where fired_at is null;

-- Live workers and what they serve, so dashboards can tell runs that nobody will pick up.
create table workers (
    id text primary key,
    workflows text[] not null,
    queues text[] not null,
    lease interval not null,
    started_at timestamptz not null default now(),
    last_seen_at timestamptz not null default now()
);

-- The NOTIFY channel that wakes idle workers of this schema. A channel name is an identifier
-- of at most 63 bytes; a schema name too long for that gets a digest instead (cutting it
-- could split a multibyte character, or make two schemas share a channel).
create function wakeup_channel() returns text
language plpgsql stable
set search_path from current
as $$
declare
    v_channel text := current_schema() || '_wakeup';
begin
    if octet_length(v_channel) > 63 then
        v_channel := 'flowly_wakeup_' || md5(current_schema());
    end if;
    return v_channel;
end
$$;

-- Backoff before the next attempt after p_failures failures; the one place delays are decided.
create function backoff_delay(
    p_kind text, p_initial_delay double precision, p_max_delay double precision, p_failures integer
) returns interval
language plpgsql immutable
set search_path from current
as $$
declare
    v_seconds double precision;
begin
    v_seconds := case p_kind
        when 'fixed' then p_initial_delay
        when 'linear' then p_initial_delay * p_failures
        when 'exponential' then p_initial_delay * power(2, least(p_failures - 1, 60))
    end;
    if v_seconds is null then
        raise exception 'unknown backoff kind %: expected fixed, linear or exponential', p_kind
            using errcode = 'WF003';
    end if;
    return make_interval(secs => least(v_seconds, p_max_delay));
end
$$;

-- Enqueues a run and returns its id. Idempotent: an existing run id returns that run, and a
-- concurrency key that already has a live run returns the live run, never a duplicate and
-- never an error, so it is safe inside triggers and application transactions (it commits or
-- rolls back with them). Wakes idle workers with NOTIFY at commit. A workflow starting a
-- child passes its own lease epoch, so a worker that lost the parent starts nothing more.
create function start(
    workflow text,
    input jsonb default 'null',
    run_id text default null,
    queue text default 'default',
    priority integer default 0,
    scheduled_for timestamptz default null,
    concurrency_key text default null,
    max_attempts integer default 3,
    timeout interval default null,
    parent_run_id text default null,
    parent_lease_epoch bigint default null
) returns text
language plpgsql
set search_path from current
as $$
declare
    v_id text := coalesce(start.run_id, gen_random_uuid()::text);
    v_due timestamptz := coalesce(start.scheduled_for, now());
    v_existing text;
begin
    if start.workflow is null or start.workflow = '' then
        raise exception 'workflow must be a non-empty name' using errcode = 'WF003';
    end if;
    if v_id = '' then
        raise exception 'run_id must not be empty' using errcode = 'WF003';
    end if;
    if start.max_attempts is null or start.max_attempts < 1 then
        raise exception 'max_attempts must be at least 1, got %', start.max_attempts
            using errcode = 'WF003';
    end if;
    if start.timeout is not null and start.timeout <= interval '0' then
        raise exception 'timeout must be positive, got %', start.timeout using errcode = 'WF003';
    end if;
    if start.parent_lease_epoch is not null then
        perform lock_held_run(start.parent_run_id, start.parent_lease_epoch,
                              array['running', 'compensating']);
    end if;
    -- a concurrency-key winner may finish between our insert and our look-up: then try again
    for v_try in 1..3 loop
        insert into runs (id, workflow, queue, input, priority, scheduled_for, concurrency_key,
                          max_attempts, timeout, timeout_at, parent_run_id)
        values (v_id, start.workflow, coalesce(start.queue, 'default'),
                coalesce(start.input, 'null'),
                coalesce(start.priority, 0), v_due, start.concurrency_key, start.max_attempts,
                start.timeout, v_due + start.timeout, start.parent_run_id)
        on conflict do nothing;
        if found then
            perform pg_notify(wakeup_channel(), coalesce(start.queue, 'default'));
            return v_id;
        end if;
        select r.id into v_existing from runs r where r.id = v_id;
        if found then
            return v_existing;
        end if;
        select r.id into v_existing from runs r
        where r.concurrency_key = start.concurrency_key
          and r.status in ('pending', 'running', 'compensating');
        if found then
            return v_existing;
        end if;
    end loop;
    raise exception 'could not start run %: concurrency key % keeps changing hands',
        v_id, start.concurrency_key using errcode = 'WF004';
end
$$;

-- How many times a run may be taken over from a worker that died holding it before it is
-- treated as poison: a step that kills its process (segfault, OOM, os._exit) would otherwise
-- take down every worker of the fleet in turn, forever.
create function max_takeovers() returns integer
language plpgsql immutable
set search_path from current
as $$
begin
    return 10;
end
$$;

-- Moves to dead_letter the unfinished runs that must not go on, held or not (the epoch bump
-- fences a worker still running one; it learns at its next heartbeat or write): runs past
-- their overall timeout, and poison runs, whose lease expired again after max_takeovers()
-- takeovers with no new checkpoint in between. A run already compensating is exempt from its
-- timeout (its saga finishes); one cut short as poison records compensation_ok = false.
-- Called by claim and heartbeat, so neither needs a sweeper process.
create function dead_letter_stalled_runs() returns void
language plpgsql
set search_path from current
as $$
begin
    update runs r
    set status = 'dead_letter',
        error = case
            when r.timeout_at < now() then jsonb_build_object(
                'type', 'Timeout',
                'message', format('run exceeded its timeout of %s', r.timeout))
            else jsonb_build_object(
                'type', 'PoisonRun',
                'message', format('the lease of this run expired %s times while a worker held'
                                  ' it: its workers keep dying on it', r.takeovers + 1))
        end,
        compensation_ok = case when r.status = 'compensating' then false
                               else r.compensation_ok end,
        finished_at = now(),
        lease_epoch = r.lease_epoch + 1,
        locked_by = null,
        locked_until = null
    from (select t.id from runs t
          where t.status in ('pending', 'running', 'compensating')
            and ((t.timeout_at < now() and t.status <> 'compensating')
                 or (t.locked_until < now() and t.takeovers >= max_takeovers()))
          for update skip locked) stalled
    where r.id = stalled.id;
end
$$;

-- Records that a worker is alive and what it serves, and forgets workers that died without
-- unregistering (silent for a hundred leases), so the table does not grow with every crash.
create function register_worker(
    p_worker text, p_workflows text[], p_queues text[], p_lease interval
) returns void
language sql
set search_path from current
as $$
    delete from workers w where w.last_seen_at + 100 * w.lease < now();
    insert into workers (id, workflows, queues, lease)
    values (p_worker, p_workflows, p_queues, p_lease)
    on conflict (id) do update
    set workflows = excluded.workflows, queues = excluded.queues, lease = excluded.lease,
        last_seen_at = now()
$$;

-- Forgets a worker that stopped.
create function unregister_worker(p_worker text) returns void
language sql
set search_path from current
as $$
    delete from workers where id = p_worker
$$;

-- Refuses a lease that would leave a claimed run unprotected (null, zero or negative): another
-- worker would take it over at once and both would run it.
create function check_lease(p_lease interval) returns void
language plpgsql
set search_path from current
as $$
begin
    if p_lease is null or p_lease <= interval '0' then
        raise exception 'lease must be a positive interval, got %', coalesce(p_lease::text, 'null')
            using errcode = 'WF003';
    end if;
end
$$;

-- Hands up to p_limit due runs to a worker, in one statement: pending runs whose time has come
-- and running or compensating runs whose lease expired (a crashed worker's; taken over as they
-- are, without counting an attempt), highest priority first, then longest due. Each claim bumps
-- the fencing token. Returns each run's stored step outcomes and timers so the worker replays
-- without another round trip.
create function claim(
    p_worker text, p_workflows text[], p_queues text[], p_limit integer, p_lease interval
) returns table (
    run_id text, workflow text, status text, input jsonb, attempt integer, lease_epoch bigint,
    steps jsonb, timers jsonb
)
language plpgsql
set search_path from current
as $$
begin
    if p_limit is null or p_limit < 1 then
        raise exception 'claim limit must be a positive number of runs, got %',
            coalesce(p_limit::text, 'null') using errcode = 'WF003';
    end if;
    perform check_lease(p_lease);
    perform dead_letter_stalled_runs();
    return query
    with due as (
        select r.id from runs r
        where r.status in ('pending', 'running', 'compensating')
          and r.available_at <= now()
          and r.workflow = any(p_workflows)
          and r.queue = any(p_queues)
        order by r.priority desc, r.available_at
        limit p_limit
        for update skip locked
    ), claimed as (
        update runs r
        set status = case r.status when 'pending' then 'running' else r.status end,
            lease_epoch = r.lease_epoch + 1,
            takeovers = r.takeovers + (r.locked_until is not null)::integer,
            locked_by = p_worker,
            locked_until = now() + p_lease,
            started_at = coalesce(r.started_at, now())
        from due
        where r.id = due.id
        returning r.id, r.workflow, r.status, r.input, r.attempt, r.lease_epoch
    ), fired as (
        update timers t set fired_at = now()
        from claimed c
        where t.run_id = c.id and t.fired_at is null and t.wake_at <= now()
    )
    select c.id, c.workflow, c.status, c.input, c.attempt, c.lease_epoch,
           coalesce((select jsonb_object_agg(s.name, jsonb_build_object(
                        'status', s.status, 'output', s.output, 'seq', s.seq,
                        'compensable', s.compensable,
                        'compensation_status', s.compensation_status))
                     from steps s where s.run_id = c.id), '{}'::jsonb),
           coalesce((select jsonb_object_agg(t.name, jsonb_build_object(
                        'wake_at', t.wake_at, 'due', t.wake_at <= now()))
                     from timers t where t.run_id = c.id), '{}'::jsonb)
    from claimed c;
end
$$;

-- Extends, in one statement, the leases of all runs a worker holds, and marks the worker alive.
-- Returns the runs among p_run_ids it no longer holds (taken over after a pause, cancelled,
-- timed out), so the worker cancels them in-process at once.
create function heartbeat(
    p_worker text, p_run_ids text[], p_epochs bigint[], p_lease interval
) returns setof text
language plpgsql
set search_path from current
as $$
begin
    perform check_lease(p_lease);
    update workers set last_seen_at = now() where id = p_worker;
    -- our runs first, in id order, before the sweep holds any other row
    perform from runs r
    join unnest(p_run_ids, p_epochs) as h (id, epoch) on r.id = h.id and r.lease_epoch = h.epoch
    where r.id = any(p_run_ids) and r.status in ('running', 'compensating')
    order by r.id
    for no key update of r;
    perform dead_letter_stalled_runs();
    return query
    with held as (
        select h.id, h.epoch from unnest(p_run_ids, p_epochs) as h (id, epoch)
    ), extended as (
        update runs r set locked_until = now() + p_lease
        from held h
        where r.id = any(p_run_ids) and r.id = h.id and r.lease_epoch = h.epoch
          and r.status in ('running', 'compensating')
        returning r.id
    )
    select h.id from held h where h.id not in (select e.id from extended e);
end
$$;

-- Locks a run the caller holds, or raises WF001 if its fencing token is stale (or WF002 if the
-- run does not exist). The fence check every single-run write starts with.
create function lock_held_run(p_run_id text, p_epoch bigint, p_statuses text[]) returns runs
language plpgsql
set search_path from current
as $$
declare
    v_run runs;
begin
    select * into v_run from runs r where r.id = p_run_id for update;
    if not found then
        raise exception 'run % not found', p_run_id using errcode = 'WF002';
    end if;
    if v_run.lease_epoch <> p_epoch or v_run.status <> all(p_statuses) then
        raise exception 'lease lost on run %: fencing token % is stale (run is % at epoch %)',
            p_run_id, p_epoch, v_run.status, v_run.lease_epoch using errcode = 'WF001';
    end if;
    return v_run;
end
$$;

-- Orders steps: across runs only its monotonicity matters (replay and LIFO compensation order).
create sequence step_seq;

-- Stores the outputs of completed steps of many runs in one statement (the worker
-- group-commits concurrent runs' steps). Each item is fenced on its own: the run row is
-- locked while its epoch is checked, so a takeover cannot slip in between; a stale item
-- writes nothing and comes back with lease_lost, the others go through. A step already
-- checkpointed keeps its first output (on conflict do nothing) and that stored output is
-- returned, so a racing duplicate continues with the value every replay will see. Rows come
-- back in input order.
create function checkpoint_steps(
    p_run_ids text[], p_epochs bigint[], p_names text[], p_outputs jsonb[],
    p_started_at timestamptz[], p_compensable boolean[]
) returns table (run_id text, name text, lease_lost boolean, output jsonb, seq bigint)
language plpgsql
set search_path from current
as $$
-- plpgsql rather than sql: it keeps the plan between calls, which cuts a call from ~8 ms to
-- well under one
#variable_conflict use_column
declare
    v_item record;
begin
    for v_item in
        with items as (
            select i.run_id, i.epoch, i.name, i.output, i.started_at, i.compensable, i.ord
            from unnest(p_run_ids, p_epochs, p_names, p_outputs, p_started_at, p_compensable)
                with ordinality as i (run_id, epoch, name, output, started_at, compensable, ord)
        ), fenced as (
            -- locked for update, not share: progressed below updates some of them, and a
            -- lock upgrade could meet another writer's share lock in a cycle
            select r.id, r.lease_epoch, r.generation from runs r
            where r.id = any(p_run_ids) and r.status in ('running', 'compensating')
            order by r.id
            for no key update of r
        ), valid as (
            select i.*, f.generation from items i
            join fenced f on f.id = i.run_id and f.lease_epoch = i.epoch
        ), inserted as (
            insert into steps as s (run_id, name, seq, status, output, attempts, started_at,
                                    compensable)
            select v.run_id, v.name, nextval('step_seq'), 'completed', v.output,
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
        select i.run_id, i.name, v.ord is null as lease_lost,
               case when n.run_id is not null then n.output else stored.output end as output,
               coalesce(n.seq, stored.seq) as seq
        from items i
        left join valid v on v.ord = i.ord
        left join inserted n on n.run_id = i.run_id and n.name = i.name
        left join lateral (
            select s.output, s.seq from steps s
            where v.ord is not null and n.run_id is null and s.run_id = i.run_id
              and s.name = i.name
        ) stored on true
        order by i.ord
    loop
        run_id := v_item.run_id;
        name := v_item.name;
        lease_lost := v_item.lease_lost;
        output := v_item.output;
        seq := v_item.seq;
        if not lease_lost and seq is null then
            -- a duplicate committed while our insert waited for it, after the statement's
            -- snapshot was taken: this new statement sees it
            select s.output, s.seq into output, seq
            from steps s where s.run_id = v_item.run_id and s.name = v_item.name;
        end if;
        return next;
    end loop;
end
$$;

-- Single-run form of checkpoint_steps for SQL callers: returns the stored output, raises WF001
-- if the lease was lost.
create function checkpoint(
    p_run_id text, p_epoch bigint, p_name text, p_output jsonb,
    p_started_at timestamptz default now(), p_compensable boolean default false
) returns jsonb
language plpgsql
set search_path from current
as $$
declare
    v_row record;
begin
    select * into v_row from checkpoint_steps(array[p_run_id], array[p_epoch], array[p_name],
                                              array[p_output], array[p_started_at],
                                              array[p_compensable]);
    if v_row.lease_lost then
        perform lock_held_run(p_run_id, p_epoch, array['running', 'compensating']);
    end if;
    return v_row.output;
end
$$;

-- Finishes many runs in one statement: status completed with their output, lease dropped.
-- Items whose fencing token is stale are returned with lease_lost and change nothing.
create function complete_runs(p_run_ids text[], p_epochs bigint[], p_outputs jsonb[])
returns table (run_id text, lease_lost boolean)
language plpgsql
set search_path from current
as $$
begin
    return query
    with items as (
        select i.id, i.epoch, i.output, i.ord
        from unnest(p_run_ids, p_epochs, p_outputs) with ordinality as i (id, epoch, output, ord)
    ), locked as (
        select r.id from runs r
        where r.id = any(p_run_ids)
        order by r.id
        for no key update
    ), done as (
        update runs r
        set status = 'completed', output = i.output, error = null, finished_at = now(),
            locked_by = null, locked_until = null
        from items i
        join locked l on l.id = i.id
        where r.id = any(p_run_ids) and r.id = i.id and r.lease_epoch = i.epoch
          and r.status = 'running'
        returning r.id
    )
    select i.id, d.id is null from items i left join done d on d.id = i.id order by i.ord;
end
$$;

-- Single-run form of complete_runs for SQL callers; raises WF001 if the lease was lost.
create function complete(p_run_id text, p_epoch bigint, p_output jsonb default 'null')
returns void
language plpgsql
set search_path from current
as $$
begin
    if (select c.lease_lost from complete_runs(array[p_run_id], array[p_epoch],
                                                array[p_output]) c) then
        perform lock_held_run(p_run_id, p_epoch, array['running']);
    end if;
end
$$;

-- Takes a run away from the worker holding it and makes it claimable again at p_available_at
-- (pending; a compensating run stays compensating so its saga resumes). The epoch bump fences
-- the former holder.
create function release_held_run(p_run_id text, p_available_at timestamptz) returns void
language plpgsql
set search_path from current
as $$
begin
    update runs r
    set status = case r.status when 'running' then 'pending' else r.status end,
        scheduled_for = p_available_at,
        lease_epoch = r.lease_epoch + 1,
        locked_by = null,
        locked_until = null
    where r.id = p_run_id;
    perform pg_notify(wakeup_channel(), r.queue) from runs r
    where r.id = p_run_id and p_available_at <= now();
end
$$;

-- Durable sleep. The timer row is written once: on replay the stored wake time is returned,
-- never recomputed, so a restart cannot push the wake-up later. While the wake time is ahead,
-- the run is released (pending, nobody holds it) and becomes claimable at wake time. Give
-- either p_wake_at or p_seconds (from the database clock).
create function sleep(
    p_run_id text, p_epoch bigint, p_name text,
    p_wake_at timestamptz default null, p_seconds double precision default null
) returns table (wake_at timestamptz, released boolean)
language plpgsql
set search_path from current
as $$
declare
    v_wake_at timestamptz := coalesce(p_wake_at, now() + make_interval(secs => p_seconds));
begin
    if v_wake_at is null then
        raise exception 'sleep % needs a wake time or a number of seconds', p_name
            using errcode = 'WF003';
    end if;
    perform lock_held_run(p_run_id, p_epoch, array['running']);
    insert into timers (run_id, name, wake_at) values (p_run_id, p_name, v_wake_at)
    on conflict do nothing;
    select t.wake_at into v_wake_at from timers t where t.run_id = p_run_id and t.name = p_name;
    wake_at := v_wake_at;
    released := v_wake_at > now();
    if released then
        perform release_held_run(p_run_id, v_wake_at);
    else
        update timers t set fired_at = now()
        where t.run_id = p_run_id and t.name = p_name and t.fired_at is null;
    end if;
    return next;
end
$$;

-- Error JSON as the engine stores it: an object with at least a message; any other JSON a
-- caller passes becomes that message, so views can read error ->> 'message' uniformly.
create function as_error(p_error jsonb) returns jsonb
language sql immutable
set search_path from current
as $$
    select case when jsonb_typeof(p_error) = 'object' then p_error
                else jsonb_build_object('message', p_error #>> '{}') end
$$;

-- Starts a saga after a run failed for good: 'compensate' (status compensating, the worker
-- keeps its lease and runs the compensations) when a completed step has a compensation not yet
-- run, else 'dead_letter' at once.
create function begin_compensation(p_run_id text, p_error jsonb) returns text
language plpgsql
set search_path from current
as $$
begin
    if exists (select 1 from steps s
               where s.run_id = p_run_id and s.status = 'completed' and s.compensable
                 and s.compensation_status is null) then
        update runs r set status = 'compensating', error = p_error where r.id = p_run_id;
        return 'compensate';
    end if;
    update runs r
    set status = 'dead_letter', error = p_error, finished_at = now(),
        compensation_ok = case when exists (select 1 from steps s
                                            where s.run_id = p_run_id and s.compensable)
                               then not exists (select 1 from steps s
                                                where s.run_id = p_run_id and s.compensable
                                                  and s.compensation_status = 'failed')
                          end,
        locked_by = null, locked_until = null, lease_epoch = r.lease_epoch + 1
    where r.id = p_run_id;
    return 'dead_letter';
end
$$;

-- Records a failed attempt of a step and decides, from the step's retry policy, what comes
-- next: 'retry' (the run is released until retry_at, the backoff computed here), or, once the
-- attempts are spent or the failure is not retryable, the step is stored as failed and the run
-- goes to begin_compensation ('compensate' or 'dead_letter').
create function fail_step(
    p_run_id text, p_epoch bigint, p_name text, p_error jsonb, p_started_at timestamptz,
    p_max_attempts integer, p_backoff text, p_initial_delay double precision,
    p_max_delay double precision, p_retryable boolean default true
) returns table (decision text, retry_at timestamptz)
language plpgsql
set search_path from current
as $$
declare
    v_run runs;
    v_failures integer;
    v_failed_at timestamptz := clock_timestamp();
begin
    v_run := lock_held_run(p_run_id, p_epoch, array['running']);
    select count(*) + 1 into v_failures from step_attempts a
    where a.run_id = p_run_id and a.step_name = p_name and a.generation = v_run.generation;
    if p_retryable and v_failures < p_max_attempts then
        retry_at := v_failed_at
            + backoff_delay(p_backoff, p_initial_delay, p_max_delay, v_failures);
    end if;
    insert into step_attempts (run_id, step_name, generation, attempt, error, started_at,
                               failed_at, retry_at)
    values (p_run_id, p_name, v_run.generation, v_failures, p_error, p_started_at, v_failed_at,
            retry_at);
    if retry_at is not null then
        perform release_held_run(p_run_id, retry_at);
        decision := 'retry';
        return next;
        return;
    end if;
    insert into steps (run_id, name, seq, status, error, attempts, started_at)
    values (p_run_id, p_name, nextval('step_seq'), 'failed', p_error, v_failures, p_started_at)
    on conflict do nothing;
    decision := begin_compensation(p_run_id,
                                   as_error(p_error) || jsonb_build_object('step', p_name));
    return next;
end
$$;

-- Records a failure of the workflow body itself (outside any step). Retries the whole run
-- (replaying its checkpoints) with exponential backoff while attempts remain, else starts the
-- saga like an exhausted step.
create function fail_run(p_run_id text, p_epoch bigint, p_error jsonb)
returns table (decision text, retry_at timestamptz)
language plpgsql
set search_path from current
as $$
declare
    v_run runs;
begin
    v_run := lock_held_run(p_run_id, p_epoch, array['running']);
    if v_run.attempt < v_run.max_attempts then
        retry_at := now() + backoff_delay('exponential', 1, 300, v_run.attempt);
        update runs r set attempt = r.attempt + 1, error = as_error(p_error)
        where r.id = p_run_id;
        perform release_held_run(p_run_id, retry_at);
        decision := 'retry';
    else
        decision := begin_compensation(p_run_id, as_error(p_error));
    end if;
    return next;
end
$$;

-- Stores one compensation's outcome on its step (completed when p_error is null), on its own,
-- so a crash mid-saga neither repeats a finished compensation nor forgets a failed one.
create function record_compensation(
    p_run_id text, p_epoch bigint, p_name text, p_error jsonb default null
) returns void
language plpgsql
set search_path from current
as $$
begin
    perform lock_held_run(p_run_id, p_epoch, array['compensating']);
    update steps s
    set compensation_status = case when p_error is null then 'completed' else 'failed' end,
        compensation_error = p_error,
        compensated_at = clock_timestamp()
    where s.run_id = p_run_id and s.name = p_name and s.compensation_status is null;
end
$$;

-- Ends a saga: the run lands in dead_letter; compensation_ok says whether every compensation
-- succeeded (one never run counts as failed).
create function finish_compensation(p_run_id text, p_epoch bigint) returns boolean
language plpgsql
set search_path from current
as $$
declare
    v_ok boolean;
begin
    perform lock_held_run(p_run_id, p_epoch, array['compensating']);
    v_ok := not exists (select 1 from steps s
                        where s.run_id = p_run_id and s.compensable
                          and s.compensation_status is distinct from 'completed');
    update runs r
    set status = 'dead_letter', compensation_ok = v_ok, finished_at = now(),
        locked_by = null, locked_until = null, lease_epoch = r.lease_epoch + 1
    where r.id = p_run_id;
    return v_ok;
end
$$;

-- Gives a stopping worker's unfinished runs back at once, so another worker takes them now
-- rather than after lease expiry. Runs whose token is stale are left alone. Returns how many
-- were released.
create function release(p_run_ids text[], p_epochs bigint[]) returns integer
language plpgsql
set search_path from current
as $$
declare
    v_count integer := 0;
    v_id text;
begin
    for v_id in
        select r.id from runs r
        join unnest(p_run_ids, p_epochs) as h (id, epoch) on r.id = h.id and r.lease_epoch = h.epoch
        where r.status in ('running', 'compensating')
        order by r.id
        for update of r
    loop
        perform release_held_run(v_id, now());
        v_count := v_count + 1;
    end loop;
    return v_count;
end
$$;

-- Cancels an unfinished run: it becomes cancelled and its lease is revoked (epoch bump), so a
-- worker running it stops at its next heartbeat or write. No compensation runs; cancelling a
-- run in the middle of its compensations records compensation_ok = false. Cancelling a
-- finished run changes nothing. Returns the run's status afterwards.
create function cancel(run_id text) returns text
language plpgsql
set search_path from current
as $$
declare
    v_status text;
begin
    update runs r
    set status = 'cancelled', finished_at = now(), locked_by = null, locked_until = null,
        lease_epoch = r.lease_epoch + 1,
        compensation_ok = case when r.status = 'compensating' then false
                               else r.compensation_ok end
    where r.id = cancel.run_id and r.status in ('pending', 'running', 'compensating');
    select r.status into v_status from runs r where r.id = cancel.run_id;
    if not found then
        raise exception 'run % not found', cancel.run_id using errcode = 'WF002';
    end if;
    return v_status;
end
$$;

-- Restarts a dead-lettered run from where it failed. Steps whose compensation undid them, and
-- the failed step, lose their checkpoints and run again; other completed steps are replayed.
-- Attempts start over (a new generation of step_attempts); the history stays.
create function retry_dead_letter(run_id text) returns text
language plpgsql
set search_path from current
as $$
declare
    v_run runs;
begin
    select * into v_run from runs r where r.id = retry_dead_letter.run_id for update;
    if not found then
        raise exception 'run % not found', retry_dead_letter.run_id using errcode = 'WF002';
    end if;
    if v_run.status <> 'dead_letter' then
        raise exception 'run % is %, only a dead_letter run can be retried',
            v_run.id, v_run.status using errcode = 'WF004';
    end if;
    delete from steps s
    where s.run_id = v_run.id and (s.status = 'failed' or s.compensation_status = 'completed');
    update steps s set compensation_status = null, compensation_error = null, compensated_at = null
    where s.run_id = v_run.id;
    update runs r
    set status = 'pending', attempt = 1, error = null, output = null, compensation_ok = null,
        finished_at = null, scheduled_for = now(), timeout_at = now() + r.timeout,
        generation = r.generation + 1, lease_epoch = r.lease_epoch + 1, takeovers = 0,
        locked_by = null, locked_until = null
    where r.id = v_run.id;
    perform pg_notify(wakeup_channel(), v_run.queue);
    return v_run.id;
exception
    when unique_violation then
        raise exception 'run % cannot be retried while run % of concurrency key % is live',
            v_run.id,
            (select r.id from runs r where r.concurrency_key = v_run.concurrency_key
                and r.status in ('pending', 'running', 'compensating')),
            v_run.concurrency_key
            using errcode = 'WF004';
end
$$;
