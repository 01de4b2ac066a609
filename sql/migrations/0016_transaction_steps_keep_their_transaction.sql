-- 0016_transaction_steps_keep_their_transaction: a transactional step whose function ends the
-- step's transaction itself is refused, not checkpointed in a transaction of its own.
--
-- A function that sent COMMIT (or ROLLBACK) as SQL ended the transaction begin_transaction_step
-- had opened; the next statements ran in a new one, and checkpoint_transaction, locking the run
-- again there, wrote the checkpoint anyway. After COMMIT the function's effects were no
-- longer tied to the checkpoint (a failure after it ran them twice); after ROLLBACK the step
-- was recorded completed with its effects lost. begin_* now marks its transaction (a setting
-- local to it, which ends with it), and the checkpoint and the compensation's record refuse
-- (WF003, not retried: the same function would do it again) a transaction without the mark.

-- Marks the caller's transaction as the one a transactional step or compensation of run
-- p_run_id opened.
create function mark_step_transaction(p_run_id text) returns void
language sql
set search_path from current
as $$
    select set_config('flowly.step_transaction_of', p_run_id, true);
$$;

-- Raises WF003 unless the caller's transaction is the one begin_* marked for run p_run_id.
create function check_step_transaction(p_run_id text, p_what text) returns void
language plpgsql
set search_path from current
as $$
begin
    if coalesce(current_setting('flowly.step_transaction_of', true), '') <> p_run_id then
        raise exception '% of run %: its function ended the transaction flowly opened'
            ' (a COMMIT or ROLLBACK in its SQL), so its effects and its record cannot commit'
            ' together; let flowly commit', p_what, p_run_id using errcode = 'WF003';
    end if;
end
$$;

-- begin_transaction_step as in 0008, and marks the transaction.
create or replace function begin_transaction_step(p_run_id text, p_epoch bigint) returns void
language plpgsql
set search_path from current
as $$
begin
    perform lock_run_for_transaction(p_run_id, p_epoch, array['running', 'compensating']);
    perform mark_step_transaction(p_run_id);
end
$$;

-- checkpoint_transaction as in 0008, in the transaction begin_transaction_step marked only.
create or replace function checkpoint_transaction(
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
    perform check_step_transaction(p_run_id, format('transactional step %L', p_name));
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

-- begin_compensation_transaction as in 0008, and marks the transaction.
create or replace function begin_compensation_transaction(p_run_id text, p_epoch bigint)
returns void
language plpgsql
set search_path from current
as $$
begin
    perform lock_run_for_transaction(p_run_id, p_epoch, array['compensating']);
    perform mark_step_transaction(p_run_id);
end
$$;

-- record_compensation_transaction as in 0008, in the transaction
-- begin_compensation_transaction marked only.
create or replace function record_compensation_transaction(
    p_run_id text, p_epoch bigint, p_name text
) returns void
language plpgsql
set search_path from current
as $$
begin
    perform check_step_transaction(p_run_id,
                                   format('the transactional compensation of step %L', p_name));
    perform lock_run_for_transaction(p_run_id, p_epoch, array['compensating']);
    update steps s
    set compensation_status = 'completed', compensation_error = null,
        compensated_at = clock_timestamp()
    where s.run_id = p_run_id and s.name = p_name and s.compensation_status is null;
end
$$;
