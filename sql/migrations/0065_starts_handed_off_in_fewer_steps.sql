-- 0065_starts_handed_off_in_fewer_steps: a start that an idle worker takes does less before
-- its commit, which is on the enqueue-to-first-step path.
--
-- A start checked each of its arguments in a statement of its own, three of them through
-- check_name, and took an offered slot in three writes of its row: idle_slot_for locked it,
-- insert_handed_off_run marked it for the run, and at commit send_handed_off_run deleted it.
-- Each statement and each call of a helper (a search_path set and restored) costs a little,
-- and several times more on an idle server, which is where latency counts. Now:
--
-- - start tells a run without a parent whose arguments are all plainly in bounds (most
--   starts) by one expression, and goes through the checks one by one only when it does not
--   hold: they raise what they raised, naming what is wrong;
-- - hand_off takes the slot and marks it for the run with one update, and clears the mark
--   when it does not hand the run off after all (a due run ahead of it, a payload too long,
--   its id or concurrency key taken), so a slot marked and cleared in one transaction stays
--   offered; send_handed_off_run uses the slot up at commit only while it is still marked for
--   the run its trigger event names.
--
-- Lock order as in 0036: the slot (skip locked), then the run's row (its insert); at commit
-- the trigger deletes the slot its transaction holds and reads the run without locking it.

-- Hands a new run to an idle worker: takes an offered slot of its workflow and queue, marked
-- for the run, and writes the run as claimed by that worker (a new epoch, a first lease of
-- handoff_lease from clock_timestamp()); send_handed_off_run sends it at commit. False, with
-- the slot left offered and the run not written, inside a transaction that is not READ
-- COMMITTED (a slot rewritten since its snapshot would fail the start with 40001), when no
-- slot is free, when the run is past its timeout already, when a run is due that the
-- worker's claim would take first (run_due_ahead), when the run would not fit in a NOTIFY
-- payload (the payload is built again at commit: the same fields, and a margin for the
-- lease's end written out then), or when its id or concurrency key is taken (insert_run then
-- says which run that is).
create function hand_off(
    p_id text, p_workflow text, p_queue text, p_input jsonb, p_priority integer,
    p_scheduled_for timestamptz, p_concurrency_key text, p_max_attempts integer,
    p_timeout interval, p_parent_run_id text
) returns boolean
language plpgsql
set search_path from current
as $$
declare
    v_slot handoff_slots;
    v_lease_until timestamptz;
begin
    if current_setting('transaction_isolation') <> 'read committed'
       or p_scheduled_for + p_timeout <= clock_timestamp() then
        return false;
    end if;
    update handoff_slots s set handed_run_id = p_id
    where s.id = (select o.id from handoff_slots o
                  where p_workflow = any(o.workflows) and p_queue = any(o.queues)
                    and o.expires_at > now() and o.handed_run_id is null
                  order by o.offered_at
                  limit 1
                  for update skip locked)
    returning s.* into v_slot;
    if not found then
        return false;
    end if;
    v_lease_until := clock_timestamp() + handoff_lease(v_slot.lease);
    if not run_due_ahead(v_slot.queues, v_slot.workflows, p_priority)
       and octet_length(handoff_payload(p_id, p_workflow, p_input, v_slot.lease,
                                        v_lease_until)) < 7900 then
        insert into runs (id, workflow, queue, input, priority, scheduled_for, concurrency_key,
                          max_attempts, timeout, timeout_at, parent_run_id, status, lease_epoch,
                          locked_by, locked_until, started_at)
        values (p_id, p_workflow, p_queue, p_input, p_priority, p_scheduled_for,
                p_concurrency_key, p_max_attempts, p_timeout, p_scheduled_for + p_timeout,
                p_parent_run_id, 'running', 1, v_slot.worker_id, v_lease_until, now())
        on conflict do nothing;
        if found then
            return true;
        end if;
    end if;
    update handoff_slots s set handed_run_id = null where s.id = v_slot.id;
    return false;
end
$$;

-- send_handed_off_run as in 0036, for a slot still marked for the run its event names: one
-- whose mark hand_off cleared stays offered, and its run (if any) was not handed off.
create or replace function send_handed_off_run() returns trigger
language plpgsql
set search_path from current
as $$
declare
    v_run runs;
    v_payload text;
begin
    delete from handoff_slots s where s.id = new.id and s.handed_run_id = new.handed_run_id;
    if not found then
        return null;
    end if;
    select * into v_run from runs r where r.id = new.handed_run_id;
    if not found or v_run.status <> 'running' or v_run.lease_epoch <> 1
            or v_run.locked_by is distinct from new.worker_id
            or v_run.timeout_at <= clock_timestamp() then
        return null;
    end if;
    v_payload := handoff_payload(v_run.id, v_run.workflow, v_run.input, new.lease,
                                 v_run.locked_until);
    if octet_length(v_payload) < 8000 then
        perform pg_notify(new.channel, v_payload);
    end if;
    return null;
end
$$;

-- start as in 0048, a plain start's arguments told in one expression, hand-offs by hand_off.
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
    -- a start without a parent whose arguments are all plainly in bounds passes every check
    -- below: most starts are told so by this one expression; any other start goes through
    -- the checks one by one, which name what is wrong
    if (start.parent_run_id is null and start.parent_lease_epoch is null
        and start.parent_step is null
        and octet_length(start.workflow) between 1 and max_name_bytes()
        and octet_length(v_id) between 1 and max_name_bytes()
        and octet_length(v_queue) between 1 and max_name_bytes()
        and (start.concurrency_key is null
             or octet_length(start.concurrency_key) between 1 and max_name_bytes())
        and v_due >= readable_time_start() and v_due < readable_time_end()
        and start.max_attempts >= 1
        and (start.timeout is null
             or (start.timeout > interval '0' and start.timeout < readable_time_end() - v_due))
       ) is not true then
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
    end if;
    -- nested, not one condition: hand_off writes, and only a due run fitting a payload is
    -- handed off
    if v_due <= now() and pg_column_size(start.input) < 7900 then
        if hand_off(v_id, start.workflow, v_queue, coalesce(start.input, 'null'),
                    coalesce(start.priority, 0), v_due, start.concurrency_key,
                    start.max_attempts, start.timeout, start.parent_run_id) then
            v_started := v_id;
        end if;
    end if;
    if v_started is null then
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
drop function idle_slot_for(text, text, integer);
drop function insert_handed_off_run(handoff_slots, text, text, text, jsonb, integer, timestamptz,
                                    text, integer, interval, text);
