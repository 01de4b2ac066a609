-- 0008_transactional_steps: steps whose SQL and checkpoint commit in one transaction.
--
-- The worker opens a transaction on a connection of its pool, calls begin_transaction_step
-- (which locks the run and checks the lease: a worker that lost the run gets WF001 and
-- commits nothing), runs the user's SQL, then checkpoint_transaction, and commits: the step's
-- database effects and its checkpoint are one transaction, so they happen exactly once. A
-- transactional compensation likewise runs between begin_compensation_transaction and
-- record_compensation_transaction.
--
-- Lock order: the run's row (key share, skip locked) first, then whatever the user's SQL
-- touches, then the steps row.

alter table steps drop constraint steps_kind_valid;
alter table steps add constraint steps_kind_valid
    check (kind in ('step', 'start', 'transaction'));

-- Locks the run held by the caller at p_epoch for the rest of the caller's transaction, in
-- key share mode: the heartbeat (for no key update) still extends the lease while the
-- transaction runs, but a takeover, a cancel or a timeout (for update) waits for it or skips
-- the run, and no engine function changes the run's epoch meanwhile. Raises WF001 if the lease
-- is lost, WF005 if another transaction holds the row exclusively, WF002 for no such run.
create function lock_run_for_transaction(p_run_id text, p_epoch bigint, p_statuses text[])
returns runs
language plpgsql
set search_path from current
as $$
declare
    v_run runs;
begin
    select * into v_run from runs r where r.id = p_run_id for key share skip locked;
    return check_fence(p_run_id, p_epoch, p_statuses, v_run, found);
end
$$;

-- Opens a transactional step: fences the caller's transaction on the run.
create function begin_transaction_step(p_run_id text, p_epoch bigint) returns void
language plpgsql
set search_path from current
as $$
begin
    perform lock_run_for_transaction(p_run_id, p_epoch, array['running', 'compensating']);
end
$$;

-- Writes a transactional step's checkpoint in the caller's transaction, opened by
-- begin_transaction_step (the run is locked and its epoch cannot have moved). A checkpoint
-- already there keeps its first output, which is returned.
create function checkpoint_transaction(
    p_run_id text, p_epoch bigint, p_name text, p_output jsonb, p_started_at timestamptz,
    p_compensable boolean, p_position integer
) returns table (output jsonb, seq bigint)
language plpgsql
set search_path from current
as $$
declare
    v_run runs;
begin
    perform check_name('step name', p_name);
    v_run := lock_run_for_transaction(p_run_id, p_epoch, array['running', 'compensating']);
    insert into steps as s (run_id, name, seq, position, kind, status, output, attempts,
                            started_at, compensable)
    values (p_run_id, p_name, nextval('step_seq'), p_position, 'transaction', 'completed',
            p_output,
            1 + (select count(*) from step_attempts a
                 where a.run_id = p_run_id and a.step_name = p_name
                   and a.generation = v_run.generation),
            p_started_at, p_compensable)
    on conflict do nothing;
    return query select s.output, s.seq from steps s
                 where s.run_id = p_run_id and s.name = p_name;
end
$$;

-- Opens a transactional compensation: fences the caller's transaction on the compensating run.
create function begin_compensation_transaction(p_run_id text, p_epoch bigint) returns void
language plpgsql
set search_path from current
as $$
begin
    perform lock_run_for_transaction(p_run_id, p_epoch, array['compensating']);
end
$$;

-- Records, in the caller's transaction (opened by begin_compensation_transaction), that a
-- transactional compensation succeeded, so it commits with the compensation's own SQL.
create function record_compensation_transaction(p_run_id text, p_epoch bigint, p_name text)
returns void
language plpgsql
set search_path from current
as $$
begin
    perform lock_run_for_transaction(p_run_id, p_epoch, array['compensating']);
    update steps s
    set compensation_status = 'completed', compensation_error = null,
        compensated_at = clock_timestamp()
    where s.run_id = p_run_id and s.name = p_name and s.compensation_status is null;
end
$$;
