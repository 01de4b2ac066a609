-- 0079_the_worker_protocol_refuses_null_arguments: the fenced functions of the worker's
-- protocol refuse a NULL run id, and fail_step and fail_run a NULL error or flag, naming the
-- argument (WF003), as the functions users call do since 0078.
--
-- The worker role may call these by hand (0072's grants), and flowly's worker never passes
-- them NULL; but given one:
-- - every fenced function (sleep, the waits, fail_step, fail_run, park, the compensation and
--   transaction-step calls) said "run <NULL> not found" (WF002) for a NULL run id, as for a
--   run that is gone;
-- - fail_step and fail_run with a NULL p_retryable (whose default is true) dead-lettered the
--   run, as if its failure could never be retried; fail_step with a NULL p_max_attempts did
--   the same;
-- - fail_step with a NULL p_error or p_started_at failed with a raw 23502 from its insert,
--   and fail_run with a NULL p_error stored a run error of NULL.
-- Each is refused before any row is locked, so nothing about the run changes.

-- check_fence as in 0046, a NULL run id refused by name (where a run that is not there was
-- told apart from one another transaction holds: nothing else is reached with a NULL id).
create or replace function check_fence(
    p_run_id text, p_epoch bigint, p_statuses text[], p_run runs, p_locked boolean
) returns runs
language plpgsql
set search_path from current
as $$
begin
    if not p_locked then
        if p_run_id is null then
            raise exception 'run_id must not be null' using errcode = 'WF003';
        end if;
        if exists (select from runs r where r.id = p_run_id) then
            raise exception 'run % is busy: another transaction holds its row; try again',
                p_run_id using errcode = 'WF005';
        end if;
        raise exception 'run % not found', p_run_id using errcode = 'WF002';
    end if;
    if p_epoch is null or p_run.lease_epoch is distinct from p_epoch
       or p_run.status <> all(p_statuses) then
        raise exception 'lease lost on run %: fencing token % is stale (run is % at epoch %)',
            p_run_id, coalesce(p_epoch::text, 'null'), p_run.status, p_run.lease_epoch
            using errcode = 'WF001';
    end if;
    if p_run.timeout_at < now() and p_run.status <> 'compensating' then
        raise exception 'lease lost on run %: its timeout ended at %', p_run_id,
            p_run.timeout_at using errcode = 'WF001';
    end if;
    return p_run;
end
$$;

-- fail_run as in 0042, a NULL error or retryable flag refused by name. It releases the run
-- for a retry after a backoff, or begins its compensation.
create or replace function fail_run(
    p_run_id text, p_epoch bigint, p_error jsonb, p_retryable boolean default true
) returns table (decision text, retry_at timestamptz)
language plpgsql
set search_path from current
as $$
declare
    v_run runs;
begin
    if p_error is null or p_retryable is null then
        raise exception '% must not be null',
            case when p_error is null then 'error' else 'retryable' end
            using errcode = 'WF003';
    end if;
    v_run := lock_held_run_for_update(p_run_id, p_epoch, array['running']);
    if p_retryable and v_run.attempt < v_run.max_attempts then
        retry_at := now() + backoff_delay('exponential', 1, 300, v_run.attempt);
        update runs r set attempt = r.attempt + 1, error = as_error(p_error)
        where r.id = p_run_id;
        perform release_for_retry(p_run_id, retry_at);
        decision := 'retry';
    else
        decision := begin_compensation(p_run_id, as_error(p_error));
    end if;
    return next;
end
$$;

-- fail_step as in 0042, a NULL error, start time, attempt limit or retryable flag refused by
-- name. It records the failed attempt, then releases the run for the step's retry or
-- begins the run's compensation.
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
    if p_error is null or p_started_at is null or p_max_attempts is null
       or p_retryable is null then
        raise exception '% must not be null',
            case when p_error is null then 'error'
                 when p_started_at is null then 'started_at'
                 when p_max_attempts is null then 'max_attempts' else 'retryable' end
            using errcode = 'WF003';
    end if;
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
        perform release_for_retry(p_run_id, retry_at);
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
