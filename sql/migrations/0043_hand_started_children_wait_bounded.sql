-- 0043_hand_started_children_wait_bounded: a child started by hand under a parent another
-- transaction holds gives up after 5 s (WF005), and a parent that does not exist is an error.
--
-- start(parent_run_id => ...) called from psql or an application (not by a worker, which
-- passes its lease epoch and waits 50 ms at a time) locked the parent's row with no bound:
-- behind an operator's open `begin; select flowly.cancel(...)` it waited as long as that
-- transaction stayed open, where cancel, retry_dead_letter and send_event give up after 5 s
-- with WF005 (RunBusy). It now does the same. A parent_run_id naming no run created a child
-- of nobody; it now raises WF002, as every other call naming a missing run does.

-- Locks the parent of a child started by hand and returns its status, waiting at most 5 s
-- (WF005 after); WF002 if there is no such run.
create function lock_parent_by_hand(p_run_id text) returns text
language plpgsql
set search_path from current
set lock_timeout = '5s'
as $$
declare
    v_status text;
begin
    select r.status into v_status from runs r where r.id = p_run_id for no key update;
    if not found then
        raise exception 'run % not found', p_run_id using errcode = 'WF002';
    end if;
    return v_status;
exception
    when lock_not_available then
        raise exception 'run % is busy: another transaction has held its row for over %;'
            ' try again', p_run_id, current_setting('lock_timeout') using errcode = 'WF005';
end
$$;

-- start as in 0036, the parent of a child started by hand locked by lock_parent_by_hand.
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
    if not isfinite(v_due) or v_due >= readable_time_end() then
        raise exception 'scheduled_for must be a finite time before the year 10000, got %',
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
