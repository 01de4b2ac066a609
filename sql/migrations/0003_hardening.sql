-- 0003_hardening: isolation between runs, exact replay, bounded work per call.
--
-- What changes, and why:
-- * No hot-path function waits on a row lock any more. Batches (heartbeat, checkpoint_steps,
--   complete_runs, release) lock their runs with skip locked and report a locked run as busy
--   (the worker tries that run again shortly); single-run writes raise WF005 (run busy)
--   instead of queueing behind, say, an operator's open transaction. One locked run delays
--   only itself.
-- * Ids and names are limited to 1,000 bytes (WF003 up front, at start too), so no run can
--   make a shared index refuse a batch's row.
-- * claim returns no replay data: the worker reads a run's history afterwards, in bounded
--   pages (replay), in transactions that see every checkpoint committed before the claim.
--   claim scans only due runs of its queues (one index range per queue and priority level).
-- * A takeover counts towards PoisonRun only when the holder's worker stopped heartbeating;
--   the limit is a setting (settings.max_takeovers).
-- * Steps and timers record their position in the body, so compensation and listings follow
--   body order even after retry_dead_letter; a child start is recorded in the parent's steps
--   (kind 'start') in the transaction that starts it, so a replay returns the same child.
-- * retry_dead_letter keeps the retired attempt in step_history and re-arms the timers that
--   follow the first step it re-runs.
--
-- SQLSTATEs: WF001 lease lost, WF002 run not found, WF003 invalid argument, WF004 invalid
-- state, WF005 run busy (its row is locked by another transaction: try again).
--
-- Lock order: as in 0001, a run's row before its steps and timers. No function here waits for
-- a runs row inside the worker's hot path (skip locked); cancel and retry_dead_letter, which
-- people call, wait at most lock_timeout (5 s) and then raise WF005.

-- Engine-wide settings, one row; change them with an update.
create table settings (
    singleton boolean primary key default true,
    -- takeovers in a row, from workers that stopped heartbeating, before a run is PoisonRun
    max_takeovers integer not null default 10,
    constraint settings_singleton check (singleton),
    constraint settings_max_takeovers_valid check (max_takeovers >= 1)
);
insert into settings default values;

create or replace function max_takeovers() returns integer
language sql stable
set search_path from current
as $$
    select s.max_takeovers from settings s
$$;

-- The longest id or name (run id, workflow, queue, concurrency key, step, sleep) in bytes.
-- Keys of (run id, name) indexes stay well inside a btree entry's limit (~2.7 kB).
create function max_name_bytes() returns integer
language sql immutable
set search_path from current
as $$
    select 1000
$$;

-- Refuses a missing, empty or oversized id or name with WF003, naming which one.
create function check_name(p_what text, p_value text) returns void
language plpgsql immutable
set search_path from current
as $$
begin
    if p_value is null or p_value = '' then
        raise exception '% must be a non-empty text', p_what using errcode = 'WF003';
    end if;
    if octet_length(p_value) > max_name_bytes() then
        raise exception '% is % bytes long; the limit is % bytes', p_what,
            octet_length(p_value), max_name_bytes() using errcode = 'WF003';
    end if;
end
$$;

-- Where a step, sleep or child start stands in the workflow body (its order of reaching
-- them), so compensation and listings follow the body, not the order checkpoints committed.
alter table steps add column position integer;
alter table steps add column kind text not null default 'step';
alter table steps add constraint steps_kind_valid check (kind in ('step', 'start'));
create index steps_run_seq on steps (run_id, seq);

alter table timers add column seq bigint not null default nextval('step_seq');
alter table timers add column position integer;
create index timers_run_seq on timers (run_id, seq);
create index timers_unfired_run on timers (run_id) where fired_at is null;

-- Step outcomes a retry_dead_letter retired (failed steps, undone steps, and every
-- compensation outcome), with the generation they belonged to: the audit trail of a saga.
create table step_history (
    run_id text not null references runs (id) on delete cascade,
    generation integer not null,
    name text not null,
    kind text not null,
    seq bigint not null,
    position integer,
    status text not null,
    output jsonb,
    error jsonb,
    attempts integer not null,
    started_at timestamptz not null,
    finished_at timestamptz not null,
    compensable boolean not null,
    compensation_status text,
    compensation_error jsonb,
    compensated_at timestamptz,
    retired_at timestamptz not null default now(),
    primary key (run_id, generation, name)
);

-- The claim reads one range per queue, workflow and priority level: due runs of what the worker
-- serves only, whatever waits behind them or belongs to a workflow it does not serve.
drop index runs_claimable;
create index runs_claimable on runs (queue, workflow, priority desc, available_at)
    where status in ('pending', 'running', 'compensating');
-- Listings newest first, filtered by nothing, a status or a workflow, read only what they show.
drop index runs_workflow_status;
create index runs_created on runs (created_at desc, id);
create index runs_status_created on runs (status, created_at desc, id);
create index runs_workflow_created on runs (workflow, created_at desc, id);

-- Whether the worker p_worker has heartbeated within its lease. A run whose holder is not
-- alive lost it to a crash (or a freeze); a live holder lost it to lock waits or abandonment.
create function worker_alive(p_worker text) returns boolean
language sql stable
set search_path from current
as $$
    select exists (select from workers w
                   where w.id = p_worker and w.last_seen_at + w.lease >= now())
$$;

-- Moves to dead_letter the unfinished runs that must not go on, held or not (the epoch bump
-- fences a worker still running one): runs past their overall timeout (a compensating run is
-- exempt, its saga finishes), and poison runs: taken over max_takeovers() times in a row from
-- workers that died on them, and now expired again under a worker that is not alive either.
-- A lease that lapsed under a live worker (lock waits, an abandoned write) is no evidence.
create or replace function dead_letter_stalled_runs() returns void
language plpgsql
set search_path from current
as $$
declare
    v_max_takeovers integer := max_takeovers();
begin
    update runs r
    set status = 'dead_letter',
        error = case
            when r.timeout_at < now() and r.status <> 'compensating' then jsonb_build_object(
                'type', 'Timeout',
                'message', format('run exceeded its timeout of %s', r.timeout))
            else jsonb_build_object(
                'type', 'PoisonRun',
                'message', format('the workers holding this run stopped heartbeating %s times'
                                  ' in a row without a new checkpoint: its workers keep dying'
                                  ' on it', r.takeovers + 1))
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
                 or (t.locked_until < now() and t.takeovers >= v_max_takeovers
                     and not worker_alive(t.locked_by)))
          for update skip locked) stalled
    where r.id = stalled.id;
end
$$;

-- The fence check of a run the caller tried to lock (p_locked: whether it got the row):
-- raises WF005 if another transaction holds the row, WF002 if there is no such run, WF001 if
-- the fencing token p_epoch is stale or the status is not one of p_statuses; else returns it.
create function check_fence(
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
    return p_run;
end
$$;

-- Locks a run the caller holds, or raises WF001 if its fencing token is stale, WF002 if the run
-- does not exist, WF005 if another transaction holds its row (never waits for it).
create or replace function lock_held_run(p_run_id text, p_epoch bigint, p_statuses text[])
returns runs
language plpgsql
set search_path from current
as $$
declare
    v_run runs;
begin
    select * into v_run from runs r where r.id = p_run_id for update skip locked;
    return check_fence(p_run_id, p_epoch, p_statuses, v_run, found);
end
$$;

-- Inserts a new run, or finds the run that makes it unnecessary (same id, or the live run of
-- the same concurrency key); returns the id that stands. Under REPEATABLE READ or SERIALIZABLE
-- a run committed after the transaction's snapshot cannot be seen, let alone returned: that
-- case raises 40001 (serialization failure: retry the transaction), with a message that says
-- so. The caller has validated the arguments.
create function insert_run(
    p_id text, p_workflow text, p_queue text, p_input jsonb, p_priority integer,
    p_scheduled_for timestamptz, p_concurrency_key text, p_max_attempts integer,
    p_timeout interval, p_parent_run_id text
) returns text
language plpgsql
set search_path from current
as $$
declare
    v_existing text;
begin
    if current_setting('transaction_isolation') <> 'read committed' then
        select r.id into v_existing from runs r
        where r.id = p_id
           or (r.concurrency_key = p_concurrency_key
               and r.status in ('pending', 'running', 'compensating'))
        order by r.id = p_id desc
        limit 1;
        if found then
            return v_existing;
        end if;
        begin
            insert into runs (id, workflow, queue, input, priority, scheduled_for,
                              concurrency_key, max_attempts, timeout, timeout_at, parent_run_id)
            values (p_id, p_workflow, p_queue, p_input, p_priority, p_scheduled_for,
                    p_concurrency_key, p_max_attempts, p_timeout, p_scheduled_for + p_timeout,
                    p_parent_run_id);
        exception when unique_violation or serialization_failure then
            raise exception 'flowly.start: run % or the live run of concurrency key % was'
                ' committed after this % transaction took its snapshot, so it cannot see it;'
                ' retry the transaction', p_id, coalesce(p_concurrency_key, '(none)'),
                upper(current_setting('transaction_isolation'))
                using errcode = '40001';
        end;
        perform pg_notify(wakeup_channel(), p_queue);
        return p_id;
    end if;
    -- a concurrency-key winner may finish between our insert and our look-up: then try again
    for v_try in 1..3 loop
        insert into runs (id, workflow, queue, input, priority, scheduled_for, concurrency_key,
                          max_attempts, timeout, timeout_at, parent_run_id)
        values (p_id, p_workflow, p_queue, p_input, p_priority, p_scheduled_for,
                p_concurrency_key, p_max_attempts, p_timeout, p_scheduled_for + p_timeout,
                p_parent_run_id)
        on conflict do nothing;
        if found then
            perform pg_notify(wakeup_channel(), p_queue);
            return p_id;
        end if;
        select r.id into v_existing from runs r where r.id = p_id;
        if found then
            return v_existing;
        end if;
        select r.id into v_existing from runs r
        where r.concurrency_key = p_concurrency_key
          and r.status in ('pending', 'running', 'compensating');
        if found then
            return v_existing;
        end if;
    end loop;
    raise exception 'could not start run %: concurrency key % keeps changing hands',
        p_id, p_concurrency_key using errcode = 'WF004';
end
$$;

drop function start(text, jsonb, text, text, integer, timestamptz, text, integer, interval,
                    text, bigint);

-- Enqueues a run and returns its id. Idempotent: an existing run id returns that run, and a
-- concurrency key that already has a live run returns the live run, never a duplicate, so it
-- is safe inside triggers and application transactions (it commits or rolls back with them).
-- Wakes idle workers with NOTIFY at commit. A workflow starting a child passes its own lease
-- epoch (a worker that lost the parent starts nothing) and the name under which the parent
-- records the child's id: the record is written in this transaction, and a replay of the
-- parent gets the recorded id back, whatever happened to the concurrency key since.
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
    parent_lease_epoch bigint default null,
    parent_step text default null,
    parent_position integer default null
) returns text
language plpgsql
set search_path from current
as $$
declare
    v_id text := coalesce(start.run_id, gen_random_uuid()::text);
    v_queue text := coalesce(start.queue, 'default');
    v_due timestamptz := coalesce(start.scheduled_for, now());
    v_started text;
begin
    perform check_name('workflow', start.workflow);
    perform check_name('run_id', v_id);
    perform check_name('queue', v_queue);
    if start.concurrency_key is not null then
        perform check_name('concurrency_key', start.concurrency_key);
    end if;
    if not isfinite(v_due) then
        raise exception 'scheduled_for must be a finite time, got %', v_due
            using errcode = 'WF003';
    end if;
    if start.max_attempts is null or start.max_attempts < 1 then
        raise exception 'max_attempts must be at least 1, got %', start.max_attempts
            using errcode = 'WF003';
    end if;
    if start.timeout is not null and (start.timeout <= interval '0'
                                      or not isfinite(v_due + start.timeout)) then
        raise exception 'timeout must be a positive, finite interval, got %', start.timeout
            using errcode = 'WF003';
    end if;
    if start.parent_step is not null and start.parent_lease_epoch is null then
        raise exception 'parent_step needs parent_run_id and parent_lease_epoch'
            using errcode = 'WF003';
    end if;
    if start.parent_lease_epoch is not null then
        perform lock_held_run(start.parent_run_id, start.parent_lease_epoch, array['running']);
        if start.parent_step is not null then
            perform check_name('parent_step', start.parent_step);
            select s.output #>> '{}' into v_started from steps s
            where s.run_id = start.parent_run_id and s.name = start.parent_step;
            if found then
                return v_started;
            end if;
        end if;
    end if;
    v_started := insert_run(v_id, start.workflow, v_queue, coalesce(start.input, 'null'),
                            coalesce(start.priority, 0), v_due, start.concurrency_key,
                            start.max_attempts, start.timeout, start.parent_run_id);
    if start.parent_step is not null then
        insert into steps (run_id, name, seq, position, kind, status, output, started_at)
        values (start.parent_run_id, start.parent_step, nextval('step_seq'),
                start.parent_position, 'start', 'completed', to_jsonb(v_started), now());
        update runs r set takeovers = 0 where r.id = start.parent_run_id and r.takeovers > 0;
    end if;
    return v_started;
end
$$;

drop function claim(text, text[], text[], integer, interval);

-- Hands up to p_limit due runs to a worker: pending runs whose time has come and running or
-- compensating runs whose lease expired (taken over as they are, without counting an attempt;
-- a takeover from a worker that stopped heartbeating counts towards PoisonRun), highest
-- priority first, then longest due (across the queues and workflows served). Each claim bumps
-- the fencing token. Reads one index range of due runs per queue, workflow and priority level,
-- so runs that are not due, in other queues, or of workflows the worker does not serve (a
-- typo, a newer release's) cost nothing. The due runs are first read without locks, then
-- locked with skip locked: runs another claim holds are passed over, never waited for, and
-- no more rows are locked than handed out. Runs past their timeout are never handed out.
-- has_history says whether the run has steps or timers to replay (read them with replay),
-- computed after the runs are locked, so it sees every checkpoint their former holders
-- committed.
create function claim(
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
           exists (select from steps s where s.run_id = r.id)
               or exists (select from timers t where t.run_id = r.id)
    from unnest(v_ids) with ordinality as c (id, ord)
    join runs r on r.id = c.id
    order by c.ord;
end
$$;

-- One bounded page of a run's replay data, in checkpoint order after p_after_seq: its step
-- outcomes (kind 'step' or 'start') and its timers (kind 'timer', with wake_at and whether it
-- is due). A page holds at most p_limit rows and stops after the row that passes p_max_bytes
-- of output, so no run's history, however long or large, makes one call large; more says
-- whether rows are left after this page. Read it after claim, page after page.
create function replay(
    p_run_id text, p_after_seq bigint default 0, p_limit integer default 500,
    p_max_bytes bigint default 4194304
) returns table (
    kind text, name text, seq bigint, "position" integer, status text, output jsonb,
    compensable boolean, compensation_status text, wake_at timestamptz, due boolean,
    more boolean
)
language plpgsql stable
set search_path from current
as $$
begin
    if p_limit is null or p_limit < 1 then
        raise exception 'replay page size must be positive, got %',
            coalesce(p_limit::text, 'null') using errcode = 'WF003';
    end if;
    return query
    with candidates as (
        (select s.kind, s.name, s.seq, s.position, s.status, s.output, s.compensable,
                s.compensation_status, null::timestamptz as wake_at, null::boolean as due
         from steps s
         where s.run_id = p_run_id and s.seq > coalesce(p_after_seq, 0)
         order by s.seq
         limit p_limit + 1)
        union all
        (select 'timer', t.name, t.seq, t.position, null, null, false, null, t.wake_at,
                t.wake_at <= now()
         from timers t
         where t.run_id = p_run_id and t.seq > coalesce(p_after_seq, 0)
         order by t.seq
         limit p_limit + 1)
        order by 3
        limit p_limit + 1
    ), measured as (
        select c.*, row_number() over (order by c.seq) as n,
               sum(coalesce(pg_column_size(c.output), 0)) over (order by c.seq)
                   - coalesce(pg_column_size(c.output), 0) as bytes_before
        from candidates c
    ), page as (
        select * from measured m where m.n <= p_limit and m.bytes_before <= p_max_bytes
    )
    select p.kind, p.name, p.seq, p.position, p.status, p.output, p.compensable,
           p.compensation_status, p.wake_at, p.due,
           (select count(*) from candidates) > (select count(*) from page)
    from page p
    order by p.seq;
end
$$;

drop function heartbeat(text, text[], bigint[], interval);

-- Extends, in one statement, the leases of the runs a worker holds, and marks the worker
-- alive. Never waits: a run whose row another transaction holds is skipped this time and
-- reported busy (its lease is extended at a later beat, or lapses, which is no poison
-- evidence while this worker lives). Returns the runs among p_run_ids it did not extend:
-- 'lost' (taken over, cancelled, timed out, released) so the worker cancels them in-process,
-- or 'busy'.
create function heartbeat(
    p_worker text, p_run_ids text[], p_epochs bigint[], p_lease interval
) returns table (run_id text, outcome text)
language plpgsql
set search_path from current
as $$
declare
    v_extended text[];
begin
    perform check_lease(p_lease);
    update workers set last_seen_at = now() where id = p_worker;
    with held as (
        select r.id from runs r
        join unnest(p_run_ids, p_epochs) as h (id, epoch)
            on r.id = h.id and r.lease_epoch = h.epoch
        where r.id = any(p_run_ids) and r.status in ('running', 'compensating')
        order by r.id
        for no key update of r skip locked
    ), extended as (
        update runs r set locked_until = now() + p_lease
        from held h
        where r.id = h.id
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

drop function checkpoint(text, bigint, text, jsonb, timestamptz, boolean);
drop function checkpoint_steps(text[], bigint[], text[], jsonb[], timestamptz[], boolean[]);

-- Stores the outputs of completed steps of many runs in one statement (the worker
-- group-commits concurrent runs' steps). Each item is fenced on its own: its run row is locked
-- while the epoch is checked, so a takeover cannot slip in between; a stale item writes
-- nothing and comes back lease_lost, an item whose run row another transaction holds writes
-- nothing and comes back busy (never waited for), the others go through. A step already
-- checkpointed keeps its first output (on conflict do nothing) and that stored output is
-- returned, so a racing duplicate continues with the value every replay will see. A name
-- that is missing or too long fails the whole call with WF003 before anything is written.
-- Rows come back in input order.
create function checkpoint_steps(
    p_run_ids text[], p_epochs bigint[], p_names text[], p_outputs jsonb[],
    p_started_at timestamptz[], p_compensable boolean[], p_positions integer[]
) returns table (
    run_id text, name text, lease_lost boolean, busy boolean, output jsonb, seq bigint
)
language plpgsql
set search_path from current
-- a lone checkpoint's exact arguments made a custom plan look cheaper than the generic one,
-- so it was planned afresh at every call (a third of its time); the generic plan reaches
-- each run and step by primary key whatever the batch size (and no JIT, as for claim)
set plan_cache_mode = force_generic_plan
set jit = off
as $$
-- plpgsql rather than sql: it keeps the plan between calls
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
            select r.id, r.lease_epoch, r.generation from runs r
            where r.id = any(p_run_ids) and r.status in ('running', 'compensating')
            order by r.id
            for no key update of r skip locked
        ), valid as (
            select i.*, f.generation from items i
            join fenced f on f.id = i.run_id and f.lease_epoch = i.epoch
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
               v.ord is null and exists (
                   select from runs r
                   where r.id = i.run_id and r.lease_epoch = i.epoch
                     and r.status in ('running', 'compensating')) as busy,
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

-- Single-run form of checkpoint_steps for SQL callers: returns the stored output; raises
-- WF001 if the lease was lost, WF005 if the run's row is busy. Without a position the step
-- goes after the run's last one.
create function checkpoint(
    p_run_id text, p_epoch bigint, p_name text, p_output jsonb,
    p_started_at timestamptz default now(), p_compensable boolean default false,
    p_position integer default null
) returns jsonb
language plpgsql
set search_path from current
as $$
declare
    v_row record;
begin
    select * into v_row from checkpoint_steps(
        array[p_run_id], array[p_epoch], array[p_name], array[p_output], array[p_started_at],
        array[p_compensable],
        array[coalesce(p_position, (select coalesce(max(s.position), 0) + 1 from steps s
                                    where s.run_id = p_run_id))]);
    if v_row.busy then
        raise exception 'run % is busy: another transaction holds its row; try again',
            p_run_id using errcode = 'WF005';
    end if;
    if v_row.lease_lost then
        perform lock_held_run(p_run_id, p_epoch, array['running', 'compensating']);
    end if;
    return v_row.output;
end
$$;

drop function complete(text, bigint, jsonb);
drop function complete_runs(text[], bigint[], jsonb[]);

-- Finishes many runs in one statement: status completed with their output, lease dropped.
-- Items whose fencing token is stale come back lease_lost, items whose row another
-- transaction holds come back busy (never waited for); neither changes anything.
create function complete_runs(p_run_ids text[], p_epochs bigint[], p_outputs jsonb[])
returns table (run_id text, lease_lost boolean, busy boolean)
language plpgsql
set search_path from current
set plan_cache_mode = force_generic_plan  -- as checkpoint_steps
set jit = off
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
        for no key update skip locked
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
    select i.id, d.id is null and not b.busy, d.id is null and b.busy
    from items i
    left join done d on d.id = i.id
    cross join lateral (
        select not exists (select from locked l where l.id = i.id)
               and exists (select from runs r
                           where r.id = i.id and r.lease_epoch = i.epoch
                             and r.status = 'running') as busy
    ) b
    order by i.ord;
end
$$;

-- Single-run form of complete_runs for SQL callers; raises WF001 if the lease was lost, WF005
-- if the run's row is busy.
create function complete(p_run_id text, p_epoch bigint, p_output jsonb default 'null')
returns void
language plpgsql
set search_path from current
as $$
declare
    v_row record;
begin
    select * into v_row from complete_runs(array[p_run_id], array[p_epoch], array[p_output]);
    if v_row.busy then
        raise exception 'run % is busy: another transaction holds its row; try again',
            p_run_id using errcode = 'WF005';
    end if;
    if v_row.lease_lost then
        perform lock_held_run(p_run_id, p_epoch, array['running']);
    end if;
end
$$;

drop function sleep(text, bigint, text, timestamptz, double precision);

-- Durable sleep. The timer row is written once: on replay the stored wake time is returned,
-- never recomputed, so a restart cannot push the wake-up later. While the wake time is ahead,
-- the run is released (pending, nobody holds it) and becomes claimable at wake time. Give
-- either p_wake_at or p_seconds (from the database clock).
create function sleep(
    p_run_id text, p_epoch bigint, p_name text,
    p_wake_at timestamptz default null, p_seconds double precision default null,
    p_position integer default null
) returns table (wake_at timestamptz, released boolean)
language plpgsql
set search_path from current
as $$
declare
    v_wake_at timestamptz := coalesce(p_wake_at, now() + make_interval(secs => p_seconds));
begin
    perform check_name('sleep name', p_name);
    if v_wake_at is null or not isfinite(v_wake_at) then
        raise exception 'sleep % needs a finite wake time or number of seconds', p_name
            using errcode = 'WF003';
    end if;
    perform lock_held_run(p_run_id, p_epoch, array['running']);
    insert into timers (run_id, name, wake_at, position)
    values (p_run_id, p_name, v_wake_at, p_position)
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

drop function fail_step(text, bigint, text, jsonb, timestamptz, integer, text,
                        double precision, double precision, boolean);

-- Records a failed attempt of a step and decides, from the step's retry policy, what comes
-- next: 'retry' (the run is released until retry_at, the backoff computed here), or, once the
-- attempts are spent or the failure is not retryable, the step is stored as failed and the run
-- goes to begin_compensation ('compensate' or 'dead_letter'). A step of a run that is already
-- compensating (a parallel sibling failed first) is stored as failed and gets 'compensate'.
create function fail_step(
    p_run_id text, p_epoch bigint, p_name text, p_error jsonb, p_started_at timestamptz,
    p_max_attempts integer, p_backoff text, p_initial_delay double precision,
    p_max_delay double precision, p_retryable boolean default true,
    p_position integer default null
) returns table (decision text, retry_at timestamptz)
language plpgsql
set search_path from current
as $$
declare
    v_run runs;
    v_failures integer;
    v_failed_at timestamptz := clock_timestamp();
begin
    perform check_name('step name', p_name);
    v_run := lock_held_run(p_run_id, p_epoch, array['running', 'compensating']);
    select count(*) + 1 into v_failures from step_attempts a
    where a.run_id = p_run_id and a.step_name = p_name and a.generation = v_run.generation;
    if p_retryable and v_failures < p_max_attempts and v_run.status = 'running' then
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
    insert into steps (run_id, name, seq, position, status, error, attempts, started_at)
    values (p_run_id, p_name, nextval('step_seq'), p_position, 'failed', p_error, v_failures,
            p_started_at)
    on conflict do nothing;
    if v_run.status = 'compensating' then
        decision := 'compensate';
    else
        decision := begin_compensation(p_run_id,
                                       as_error(p_error) || jsonb_build_object('step', p_name));
    end if;
    return next;
end
$$;

drop function fail_run(text, bigint, jsonb);

-- Records a failure of the workflow body itself (outside any step). Retries the whole run
-- (replaying its checkpoints) with exponential backoff while attempts remain and the failure
-- is retryable (a mistake in the workflow's code, such as a step name used twice, is not:
-- every attempt would fail alike), else starts the saga like an exhausted step.
create function fail_run(
    p_run_id text, p_epoch bigint, p_error jsonb, p_retryable boolean default true
) returns table (decision text, retry_at timestamptz)
language plpgsql
set search_path from current
as $$
declare
    v_run runs;
begin
    v_run := lock_held_run(p_run_id, p_epoch, array['running']);
    if p_retryable and v_run.attempt < v_run.max_attempts then
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

-- Ends a saga: the run lands in dead_letter; compensation_ok says whether every compensation
-- succeeded (one never run counts as failed; null when no step had one).
create or replace function finish_compensation(p_run_id text, p_epoch bigint) returns boolean
language plpgsql
set search_path from current
as $$
declare
    v_ok boolean;
begin
    perform lock_held_run(p_run_id, p_epoch, array['compensating']);
    if exists (select from steps s where s.run_id = p_run_id and s.compensable) then
        v_ok := not exists (select from steps s
                            where s.run_id = p_run_id and s.compensable
                              and s.compensation_status is distinct from 'completed');
    end if;
    update runs r
    set status = 'dead_letter', compensation_ok = v_ok, finished_at = now(),
        locked_by = null, locked_until = null, lease_epoch = r.lease_epoch + 1
    where r.id = p_run_id;
    return v_ok;
end
$$;

-- Gives a stopping worker's unfinished runs back at once, so another worker takes them now
-- rather than after lease expiry. Runs whose token is stale are left alone, and so are runs
-- whose row another transaction holds (never waited for: a stopping worker must exit; their
-- leases expire). Returns how many were released.
create or replace function release(p_run_ids text[], p_epochs bigint[]) returns integer
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
        for update of r skip locked
    loop
        perform release_held_run(v_id, now());
        v_count := v_count + 1;
    end loop;
    return v_count;
end
$$;

-- Locks a run for an operator's call (cancel, retry_dead_letter), waiting at most
-- lock_timeout (5 s, set by the callers): a run busy longer raises WF005 rather than hanging.
-- Raises WF002 for an unknown run.
create function lock_run_for_operator(p_run_id text) returns runs
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
    return v_run;
exception
    when lock_not_available then
        raise exception 'run % is busy: another transaction has held its row for over %;'
            ' try again', p_run_id, current_setting('lock_timeout') using errcode = 'WF005';
end
$$;

-- Cancels an unfinished run and, with it, its unfinished descendants (runs it started,
-- theirs, ...): each becomes cancelled and its lease is revoked (epoch bump), so a worker
-- running one stops at its next heartbeat or write. No compensation runs; cancelling a run in
-- the middle of its compensations records compensation_ok = false. Cancelling a finished run
-- changes nothing. Returns the run's status afterwards.
create or replace function cancel(run_id text) returns text
language plpgsql
set search_path from current
set lock_timeout = '5s'
as $$
declare
    v_run runs := lock_run_for_operator(cancel.run_id);
begin
    if v_run.status not in ('pending', 'running', 'compensating') then
        return v_run.status;
    end if;
    with recursive family as (
        select v_run.id as id
        union
        select c.id from runs c join family f on c.parent_run_id = f.id
    )
    update runs r
    set status = 'cancelled', finished_at = now(), locked_by = null, locked_until = null,
        lease_epoch = r.lease_epoch + 1,
        compensation_ok = case when r.status = 'compensating' then false
                               else r.compensation_ok end
    from family f
    where r.id = f.id and r.status in ('pending', 'running', 'compensating');
    return 'cancelled';
end
$$;

-- Restarts a dead-lettered run from where it failed, as a new generation. Steps whose
-- compensation undid them, and the failed step, run again; other completed steps are
-- replayed. What this retires (those steps, and every compensation outcome) moves to
-- step_history first, so the saga's audit trail stays. Timers after the first step that runs
-- again are re-armed, so a sleep between re-run steps lasts as long as it did the first time.
-- Attempts start over (step_attempts of the new generation).
create or replace function retry_dead_letter(run_id text) returns text
language plpgsql
set search_path from current
set lock_timeout = '5s'
as $$
declare
    v_run runs := lock_run_for_operator(retry_dead_letter.run_id);
    v_first_rerun integer;
begin
    if v_run.status <> 'dead_letter' then
        raise exception 'run % is %, only a dead_letter run can be retried',
            v_run.id, v_run.status using errcode = 'WF004';
    end if;
    insert into step_history (run_id, generation, name, kind, seq, position, status, output,
                              error, attempts, started_at, finished_at, compensable,
                              compensation_status, compensation_error, compensated_at)
    select s.run_id, v_run.generation, s.name, s.kind, s.seq, s.position, s.status, s.output,
           s.error, s.attempts, s.started_at, s.finished_at, s.compensable,
           s.compensation_status, s.compensation_error, s.compensated_at
    from steps s
    where s.run_id = v_run.id and (s.status = 'failed' or s.compensation_status is not null)
    on conflict do nothing;
    select min(s.position) into v_first_rerun from steps s
    where s.run_id = v_run.id and (s.status = 'failed' or s.compensation_status = 'completed');
    delete from steps s
    where s.run_id = v_run.id and (s.status = 'failed' or s.compensation_status = 'completed');
    update steps s set compensation_status = null, compensation_error = null, compensated_at = null
    where s.run_id = v_run.id and s.compensation_status is not null;
    delete from timers t where t.run_id = v_run.id and t.position > v_first_rerun;
    begin
        update runs r
        set status = 'pending', attempt = 1, error = null, output = null, compensation_ok = null,
            finished_at = null, scheduled_for = now(), timeout_at = now() + r.timeout,
            generation = r.generation + 1, lease_epoch = r.lease_epoch + 1, takeovers = 0,
            locked_by = null, locked_until = null
        where r.id = v_run.id;
    exception
        when unique_violation then
            raise exception 'run % cannot be retried while run % of concurrency key % is live',
                v_run.id,
                (select r.id from runs r where r.concurrency_key = v_run.concurrency_key
                    and r.status in ('pending', 'running', 'compensating')),
                v_run.concurrency_key
                using errcode = 'WF004';
    end;
    perform pg_notify(wakeup_channel(), v_run.queue);
    return v_run.id;
end
$$;
