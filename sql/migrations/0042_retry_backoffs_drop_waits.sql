-- 0042_retry_backoffs_drop_waits: a run released for a retry's backoff forgets the waits its
-- body registered, so that what they wait for cannot end the backoff early.
--
-- A body that waits for a run (or an event) in one branch of a gather while a step fails in
-- another registered its wait, then the step's failure released the run until the stored
-- retry time; the park the worker then tried lost its lease, and the waits row stayed. When
-- the awaited run finished, wake_waiters took the released run for a parked one and made it
-- due at once: the failed step ran again within a second of its failure instead of after its
-- backoff (README: "The database decides and stores each delay; the run is released while it
-- waits"). A body failure retried by fail_run had the same hole. The waits are dropped where
-- the retry releases the run; the replay after the backoff registers them again (or finds
-- their outcome). Nothing registers a wait after the release: wait_for_run and
-- wait_for_event are fenced by the lease the release revoked.

-- Releases a held run until p_due for a retry, after deleting the waits its body registered
-- that have no deadline.
-- Lock order: the run's row (held by the caller), then its waits.
create function release_for_retry(p_run_id text, p_due timestamptz) returns void
language plpgsql
set search_path from current
as $$
begin
    -- a wait with a deadline keeps its row: the deadline is written when the wait is first
    -- reached and never moves (such a wait can still wake the run before the backoff ends)
    delete from waits w where w.run_id = p_run_id and w.timeout_at is null;
    perform release_held_run(p_run_id, p_due);
end
$$;

-- fail_run as in 0024, released through release_for_retry.
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
        perform release_for_retry(p_run_id, retry_at);
        decision := 'retry';
    else
        decision := begin_compensation(p_run_id, as_error(p_error));
    end if;
    return next;
end
$$;

-- fail_step as in 0024, released through release_for_retry.
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
