-- 0024_waits_wait_only_for_endings: a run that waits for another registers its wait and parks
-- while the other's worker writes to it; only a write that ends the other holds it up.
--
-- park share-locked the runs it waits for, and wait_for_run key-share-locked its target, so
-- that a write ending a target, in flight and invisible to them, reports the waiter busy
-- (WF005) instead of letting it park for ever. But the share lock conflicted with every write
-- to the target (a checkpoint, a heartbeat, a completion batch of other runs), and the key
-- share with every write that locked it FOR UPDATE (a claim, a sleep, a child's start): in a
-- fan-in over busy children one of them nearly always is being written, and the parent went
-- on asking instead of parking, holding its lease and a slot of its worker, until its
-- children were done.
--
-- Lock modes now say what a write is:
-- - FOR UPDATE: the writes that a run depending on this one must not miss: those that end
--   the run (complete_runs, fail_run, fail_step, finish_compensation, cancel and the runs it
--   cancels with it (0026), the timeout sweep, purge) and park, which must not miss an event being
--   sent to the run (its insert key-share-locks the run through the foreign key). claim too,
--   so that a run whose transactional step is still open in a stalled worker's session is not
--   taken over before that session ends; a claim is short, and a waiter asks again soon.
-- - FOR NO KEY UPDATE: every other write of a worker (checkpoint, heartbeat, sleep, start,
--   wait registration, compensation records).
-- - FOR KEY SHARE: what depends on a run: a wait registering on it or parking on it, an
--   event sent to it, its own transactional step. These conflict with the FOR UPDATE writes
--   only.
--
-- Lock order as in 0014: the waiting run's row, then the rows of the runs it waits for.

-- Locks a run the caller's worker holds for a write that does not end it; see
-- lock_held_run_for_update for one that may.
create or replace function lock_held_run(p_run_id text, p_epoch bigint, p_statuses text[])
returns runs
language plpgsql
set search_path from current
as $$
declare
    v_run runs;
begin
    select * into v_run from runs r where r.id = p_run_id for no key update skip locked;
    return check_fence(p_run_id, p_epoch, p_statuses, v_run, found);
end
$$;

-- Locks a run the caller's worker holds for a write that may end it or park it: the lock
-- conflicts with the key-share locks of waits and events that depend on the run.
create function lock_held_run_for_update(p_run_id text, p_epoch bigint, p_statuses text[])
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

-- park as in 0022, with its own row locked for update and the runs it waits for key-share
-- locked: busy only while one of them is being ended.
create or replace function park(p_run_id text, p_epoch bigint, p_steps text[])
returns timestamptz
language plpgsql
set search_path from current
as $$
declare
    v_targets text[];
    v_due timestamptz;
begin
    perform lock_held_run_for_update(p_run_id, p_epoch, array['running']);
    delete from waits w where w.run_id = p_run_id and w.step <> all(p_steps);
    v_targets := array(
        select t.id from waits w join runs t on t.id = w.target
        where w.run_id = p_run_id and w.kind = 'run');
    if cardinality(v_targets) > cardinality(array(
            select t.id from runs t where t.id = any(v_targets)
            order by t.id
            for key share skip locked)) then
        raise exception 'run % is busy: a run it waits for is held by another transaction;'
            ' try again', p_run_id using errcode = 'WF005';
    end if;
    if parked_run_is_due(p_run_id) then
        v_due := now();
    else
        -- "never" is the last day clients can read ('infinity' would break every reader)
        select coalesce(min(w.timeout_at), timestamptz '9999-12-31 00:00:00+00') into v_due
        from waits w
        where w.run_id = p_run_id;
    end if;
    perform release_held_run(p_run_id, v_due);
    return nullif(v_due, timestamptz '9999-12-31 00:00:00+00');
end
$$;

-- fail_run, fail_step and finish_compensation as in 0003, their run locked for update: each
-- may end it.
create or replace function fail_run(
    p_run_id text, p_epoch bigint, p_error jsonb, p_retryable boolean default true
) returns table (decision text, retry_at timestamptz)
language plpgsql
set search_path from current
as $$
declare
    v_run runs;
begin
    v_run := lock_held_run_for_update(p_run_id, p_epoch, array['running']);
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

create or replace function fail_step(
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
    v_run := lock_held_run_for_update(p_run_id, p_epoch, array['running', 'compensating']);
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

create or replace function finish_compensation(p_run_id text, p_epoch bigint) returns boolean
language plpgsql
set search_path from current
as $$
declare
    v_ok boolean;
begin
    perform lock_held_run_for_update(p_run_id, p_epoch, array['compensating']);
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

-- complete_runs as in 0011, its runs locked for update.
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
