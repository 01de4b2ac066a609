-- 0026_cancelled_families_stay_cancelled: a cancel leaves no run of the family unfinished,
-- whatever starts, retries or other cancels run beside it, and does not deadlock.
--
-- 0015's cancel locked the run it was given, then updated its family; 0024's locked the
-- family for update in id order after the run, and read the family again once it held the
-- locks. Attacks found three ways to leave a run unfinished or fail:
-- - Two cancels of nested families deadlocked (40P01): the run given was locked outside the
--   id order, and so were runs a re-read found (a child started while the cancel waited).
--   cancel now locks the run and its unfinished family in one id-ordered pass, in a
--   subtransaction; when a re-read finds the family grown, it rolls the subtransaction back,
--   which gives the locks back, and takes them all again in id order.
-- - Under REPEATABLE READ the re-read sees the same snapshot, so a child started and
--   committed after it was left pending under a cancelled parent. start now writes a new
--   version of the parent's row with every child, so such a cancel fails to lock the parent
--   (40001: retry the transaction) instead.
-- - retry_dead_letter of a child, in flight while its parent was cancelled (or run after),
--   left the child pending under a cancelled parent, and a child started by hand (no lease
--   epoch) could join a cancelled family. Both now key-share or no-key-update lock the parent
--   (so a cancel in flight ends first) and refuse under a cancelled parent (WF004).
--
-- Lock order: cancel takes the run and the runs it cancels with it, all in id order; start
-- and retry_dead_letter take the run they start or retry, then its parent.

-- The run and the unfinished runs it started, and theirs, by id: what cancel locks. Moves
-- nothing.
create function family_to_cancel(p_run_id text) returns text[]
language sql stable
set search_path from current
as $$
    select array(
        with recursive family as (
            select r.id, r.status from runs r where r.id = p_run_id
            union
            select c.id, c.status from runs c join family f on c.parent_run_id = f.id
        )
        select f.id from family f
        where f.id = p_run_id or f.status in ('pending', 'running', 'compensating')
        order by f.id)
$$;

-- cancel as in 0015, but it locks the run and its family in one id-ordered pass (above).
create or replace function cancel(run_id text) returns text
language plpgsql
set search_path from current
set lock_timeout = '5s'
as $$
declare
    v_family text[];
    v_status text;
begin
    loop
        v_family := family_to_cancel(cancel.run_id);
        begin
            perform from runs r where r.id = any(v_family) order by r.id for update;
            exit when family_to_cancel(cancel.run_id) <@ v_family;
            -- the family grew: give these locks back, and take them all again in id order
            raise exception using errcode = 'WF0FG';
        exception
            when sqlstate 'WF0FG' then
                null;
        end;
    end loop;
    select r.status into v_status from runs r where r.id = cancel.run_id;
    if not found then
        raise exception 'run % not found', cancel.run_id using errcode = 'WF002';
    end if;
    if v_status not in ('pending', 'running', 'compensating') then
        return v_status;
    end if;
    -- the time of the cancel, not of its transaction's start: it may have waited for a step
    -- of the run, which must not seem to finish after its run
    update runs r
    set status = 'cancelled', finished_at = clock_timestamp(), locked_by = null,
        locked_until = null,
        lease_epoch = r.lease_epoch + 1,
        compensation_ok = case when r.status = 'compensating' then false
                               else r.compensation_ok end
    where r.id = any(v_family) and r.status in ('pending', 'running', 'compensating');
    return 'cancelled';
exception
    when lock_not_available then
        raise exception 'run % is busy: another transaction has held its row, or the row of'
            ' a run it started, for over %; try again', cancel.run_id,
            current_setting('lock_timeout') using errcode = 'WF005';
end
$$;

-- start as in 0018, but a child of a cancelled run is refused and a child writes a new
-- version of its parent's row (above).
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
        select r.status into v_parent_status from runs r
        where r.id = start.parent_run_id
        for no key update;
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
    v_started := insert_run(v_id, start.workflow, v_queue, coalesce(start.input, 'null'),
                            coalesce(start.priority, 0), v_due, start.concurrency_key,
                            start.max_attempts, start.timeout, start.parent_run_id);
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

-- retry_dead_letter as in 0015, but not under a cancelled parent (above).
create or replace function retry_dead_letter(run_id text) returns text
language plpgsql
set search_path from current
set lock_timeout = '5s'
as $$
declare
    v_run runs := lock_run_for_operator(retry_dead_letter.run_id);
    v_first_rerun integer;
    v_parent_status text;
begin
    if v_run.status <> 'dead_letter' then
        raise exception 'run % is %, only a dead_letter run can be retried',
            v_run.id, v_run.status using errcode = 'WF004';
    end if;
    if v_run.parent_run_id is not null then
        -- key-share locked: a cancel of the parent's family in flight ends first
        select r.status into v_parent_status from runs r
        where r.id = v_run.parent_run_id
        for key share;
        if v_parent_status = 'cancelled' then
            raise exception 'run % cannot be retried: its parent run % was cancelled',
                v_run.id, v_run.parent_run_id using errcode = 'WF004';
        end if;
    end if;
    insert into step_history (run_id, generation, name, kind, seq, position, status, output,
                              error, attempts, started_at, finished_at, compensable,
                              compensation_status, compensation_error, compensated_at)
    select s.run_id, v_run.generation, s.name, s.kind, s.seq, s.position, s.status, s.output,
           s.error, s.attempts, s.started_at, s.finished_at, s.compensable,
           s.compensation_status, s.compensation_error, s.compensated_at
    from steps s
    where s.run_id = v_run.id and retired_by_retry(s, v_run)
    on conflict do nothing;
    select min(s.position) into v_first_rerun from steps s
    where s.run_id = v_run.id
      and retired_by_retry(s, v_run) and s.compensation_status is distinct from 'failed';
    delete from steps s
    where s.run_id = v_run.id
      and retired_by_retry(s, v_run) and s.compensation_status is distinct from 'failed';
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
exception
    when lock_not_available then
        raise exception 'run % is busy: another transaction has held its row, or its'
            ' parent''s, for over %; try again', retry_dead_letter.run_id,
            current_setting('lock_timeout') using errcode = 'WF005';
end
$$;
