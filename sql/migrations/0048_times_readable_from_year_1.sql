-- 0048_times_readable_from_year_1: the times a caller gives must lie between the years 1 and
-- 10000, and a retry policy's delays are numbers of seconds within a year.
--
-- 0018 and 0040 kept run times before the year 10000, the last time clients can read back,
-- but not after the year 1, the first: a run scheduled_for '0001-01-01 BC' (or a sleep's
-- wake time there) was stored, and every listing of runs that met it failed in the client
-- (Python's datetime starts at the year 1). A sleep of 10^15 seconds, NaN or infinity
-- failed with PostgreSQL's own 22008; a retry policy's NaN or NULL delay was reported as an
-- unknown backoff kind, and a delay past the year 10000 failed fail_step with 22008.

-- The first time clients can read back in any time zone: run times must not come before it
-- (a day after the first of the year 1, so that no session's time zone renders it in year 0).
create function readable_time_start() returns timestamptz
language sql immutable
set search_path from current
as $$
    select timestamptz '0001-01-02 00:00:00+00'
$$;

-- backoff_delay as in 0001, its delays checked: numbers of seconds from 0 to a year.
create or replace function backoff_delay(
    p_kind text, p_initial_delay double precision, p_max_delay double precision, p_failures integer
) returns interval
language plpgsql immutable
set search_path from current
as $$
declare
    v_seconds double precision;
begin
    -- NaN is above every number: `between` refuses it
    if not p_initial_delay between 0 and 31536000 or not p_max_delay between 0 and 31536000
       or p_initial_delay is null or p_max_delay is null then
        raise exception 'retry delays must be from 0 to 31536000 seconds (a year), got % and %',
            coalesce(p_initial_delay::text, 'null'), coalesce(p_max_delay::text, 'null')
            using errcode = 'WF003';
    end if;
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

-- sleep as in 0040, a wake time from the year 1 on, its seconds checked before adding them.
create or replace function sleep(
    p_run_id text, p_epoch bigint, p_name text,
    p_wake_at timestamptz default null, p_seconds double precision default null,
    p_position integer default null, p_release boolean default true
) returns table (wake_at timestamptz, released boolean)
language plpgsql
set search_path from current
as $$
declare
    v_wake_at timestamptz;
begin
    perform check_name('sleep name', p_name);
    -- NaN is above every number in PostgreSQL: `not <=` refuses it with the infinity
    if p_wake_at is null and p_seconds is not null
       and not p_seconds <= extract(epoch from readable_time_end() - now()) then
        raise exception 'sleep % needs a wake time before the year 10000, got % seconds',
            p_name, p_seconds using errcode = 'WF003';
    end if;
    -- a sleep of no time or less is due at once
    v_wake_at := coalesce(p_wake_at, now() + make_interval(secs => greatest(p_seconds, 0)));
    if v_wake_at is null or not isfinite(v_wake_at) or v_wake_at >= readable_time_end()
       or v_wake_at < readable_time_start() then
        raise exception 'sleep % needs a finite wake time between the years 1 and 10000, got %',
            p_name, coalesce(v_wake_at::text, 'none') using errcode = 'WF003';
    end if;
    perform lock_held_run(p_run_id, p_epoch, array['running']);
    insert into timers (run_id, name, wake_at, position)
    values (p_run_id, p_name, v_wake_at, p_position)
    on conflict do nothing;
    select t.wake_at into v_wake_at from timers t where t.run_id = p_run_id and t.name = p_name;
    wake_at := v_wake_at;
    -- with p_release false: whether the caller must release the run (the wake time is ahead)
    released := v_wake_at > now();
    if released and p_release then
        perform release_held_run(p_run_id, v_wake_at);
    elsif not released then
        update timers t set fired_at = now()
        where t.run_id = p_run_id and t.name = p_name and t.fired_at is null;
    end if;
    return next;
end
$$;


-- start as in 0043, scheduled_for from the year 1 on.
create or replace function start(
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
    v_parent_status text;
    v_slot handoff_slots;
begin
    perform check_name('workflow', start.workflow);
    perform check_name('run_id', v_id);
    perform check_name('queue', v_queue);
    if start.concurrency_key is not null then
        perform check_name('concurrency_key', start.concurrency_key);
    end if;
    if not isfinite(v_due) or v_due >= readable_time_end() or v_due < readable_time_start()
    then
        raise exception 'scheduled_for must be a finite time between the years 1 and 10000, got %',
            v_due using errcode = 'WF003';
    end if;
    if start.max_attempts is null or start.max_attempts < 1 then
        raise exception 'max_attempts must be at least 1, got %', start.max_attempts
            using errcode = 'WF003';
    end if;
    if start.timeout is not null and (start.timeout <= interval '0'
                                      or start.timeout >= readable_time_end() - v_due) then
        raise exception 'timeout must be a positive interval that ends before the year 10000,'
            ' got %', start.timeout using errcode = 'WF003';
    end if;
    if start.parent_step is not null and start.parent_lease_epoch is null then
        raise exception 'parent_step needs parent_run_id and parent_lease_epoch'
            using errcode = 'WF003';
    end if;
    if start.parent_run_id is not null and start.parent_lease_epoch is null then
        -- a child started by hand: not under a cancelled run (a cancel in flight ends first)
        v_parent_status := lock_parent_by_hand(start.parent_run_id);
        if v_parent_status = 'cancelled' then
            raise exception 'run % was cancelled: it takes no more children',
                start.parent_run_id using errcode = 'WF004';
        end if;
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
    if v_due <= now() and pg_column_size(start.input) < 7900 then
        v_slot := idle_slot_for(start.workflow, v_queue, coalesce(start.priority, 0));
    end if;
    if v_slot.id is not null and insert_handed_off_run(
            v_slot, v_id, start.workflow, v_queue, coalesce(start.input, 'null'),
            coalesce(start.priority, 0), v_due, start.concurrency_key, start.max_attempts,
            start.timeout, start.parent_run_id) then
        v_started := v_id;
    else
        v_started := insert_run(v_id, start.workflow, v_queue, coalesce(start.input, 'null'),
                                coalesce(start.priority, 0), v_due, start.concurrency_key,
                                start.max_attempts, start.timeout, start.parent_run_id);
    end if;
    if start.parent_step is not null then
        insert into steps (run_id, name, seq, position, kind, status, output, started_at)
        values (start.parent_run_id, start.parent_step, nextval('step_seq'),
                start.parent_position, 'start', 'completed', to_jsonb(v_started), now());
    end if;
    if start.parent_run_id is not null then
        -- a new version of the parent's row, even where nothing in it changes: a cancel
        -- under REPEATABLE READ whose snapshot misses this child then fails to lock the
        -- parent (40001, retry the transaction) instead of leaving the child unfinished
        update runs r
        set takeovers = case when start.parent_step is not null then 0 else r.takeovers end
        where r.id = start.parent_run_id;
    end if;
    return v_started;
end
$$;
