-- 0036_hand_offs_checked_at_commit: a run handed to an idle worker is sent to it when the
-- start's transaction commits, as it stands then; a hand-off keeps the start's scheduled time,
-- is never made for a run already past its timeout, and never overtakes a due run that the
-- worker's claim would take first.
--
-- insert_handed_off_run (0030, 0032) sent its NOTIFY while start ran, and nothing later in the
-- transaction could take it back: a run cancelled in the transaction that started it reached
-- the worker anyway, which began its first step on trust (the payload said its lease was
-- fresh). The slot now records the run it was taken for, and a deferred constraint trigger on
-- it sends the run at commit, read again: only when it is still running under the hand-off's
-- lease, held by the slot's worker, and not past its timeout. Otherwise nothing is sent, and
-- the run is what the transaction made of it (cancelled: nothing runs; past its timeout: the
-- claim's sweep dead-letters it once the first lease lapses).
--
-- The run handed off was written with scheduled_for = now() and its timeout counted from
-- there, dropping a start's scheduled_for in the past (a run that insert_run would have timed
-- out ran instead), and a start late in a long transaction could hand off a run whose timeout
-- had already passed. The run now keeps its scheduled time, and one that is past its timeout
-- when start writes it is not handed off (insert_run writes it, and it times out as any).
--
-- run_due_ahead (0032) looked for due runs of the new run's queue, workflow and priority only,
-- but a claim takes the highest priority first across every queue and workflow the worker
-- serves: a start handed a run of priority 0 to a worker while a due run of priority 9 (or of
-- another workflow it serves) waited for its next poll. It now looks at every queue and
-- workflow of the slot, at the new run's priority and above, walking the priority levels from
-- the top as claim does, so it reads one index entry per level and pair, not the runs that are
-- running or sleeping.
--
-- Lock order as in 0030: the slot (skip locked), then the run's row (its insert); at commit
-- the trigger reads the run without locking it and deletes the slot its transaction holds.

alter table handoff_slots add column handed_run_id text;

-- Whether a run of one of these queues and workflows at this priority or above is due: it goes
-- first (a claim takes it), so a new run of this priority is not handed off.
drop function run_due_ahead(text, text, integer);
create function run_due_ahead(p_queues text[], p_workflows text[], p_priority integer)
returns boolean
language plpgsql stable
set search_path from current
-- see 0013 and 0032 for these settings
set plan_cache_mode = force_generic_plan
set enable_seqscan = off
set jit = off
as $$
declare
    -- the levels above this one have no due run; above every integer priority at first
    v_below bigint := 2147483648;
    v_priority integer;
begin
    loop
        -- the next priority level below v_below, and not below p_priority, at which a served
        -- queue has unfinished runs of a served workflow
        select max(l.priority) into v_priority
        from unnest(p_queues) q (name)
        cross join unnest(p_workflows) w (name)
        cross join lateral (
            select r.priority from runs r
            where r.queue = q.name and r.workflow = w.name
              and r.status in ('pending', 'running', 'compensating')
              and r.priority < v_below and r.priority >= p_priority
            order by r.priority desc
            limit 1) l;
        if v_priority is null then
            return false;
        end if;
        -- due as claim counts it: available, and not past its timeout
        if exists (
                select from unnest(p_queues) q (name)
                cross join unnest(p_workflows) w (name)
                cross join lateral (
                    select from runs r
                    where r.queue = q.name and r.workflow = w.name and r.priority = v_priority
                      and r.status in ('pending', 'running', 'compensating')
                      and r.available_at <= now()
                      and (r.timeout_at is null or r.timeout_at >= now()
                           or r.status = 'compensating')
                    limit 1) d) then
            return true;
        end if;
        v_below := v_priority;
    end loop;
end
$$;

-- idle_slot_for as in 0032, among the slots no start has taken yet, and a due run ahead looked
-- for across the slot's queues and workflows.
create or replace function idle_slot_for(p_workflow text, p_queue text, p_priority integer)
returns handoff_slots
language plpgsql
set search_path from current
as $$
declare
    v_slot handoff_slots;
begin
    if current_setting('transaction_isolation') <> 'read committed' then
        return null;
    end if;
    select * into v_slot from handoff_slots s
    where p_workflow = any(s.workflows) and p_queue = any(s.queues) and s.expires_at > now()
      and s.handed_run_id is null
    order by s.offered_at
    limit 1
    for update skip locked;
    if not found or run_due_ahead(v_slot.queues, v_slot.workflows, p_priority) then
        return null;
    end if;
    return v_slot;
end
$$;

-- Inserts a new run already claimed by the worker of p_slot (a new epoch, a first lease of
-- handoff_lease from clock_timestamp()) and takes the slot for it: the run is sent at commit
-- (send_handed_off_run). False, with nothing written, when the run id or its concurrency key
-- is taken (insert_run then says which run that is), when the run is past its timeout already,
-- or when it would not fit in a NOTIFY payload (the claim's way then).
drop function insert_handed_off_run(handoff_slots, text, text, text, jsonb, integer, text,
                                    integer, interval, text);
create function insert_handed_off_run(
    p_slot handoff_slots, p_id text, p_workflow text, p_queue text, p_input jsonb,
    p_priority integer, p_scheduled_for timestamptz, p_concurrency_key text,
    p_max_attempts integer, p_timeout interval, p_parent_run_id text
) returns boolean
language plpgsql
set search_path from current
as $$
declare
    v_lease_until timestamptz := clock_timestamp() + handoff_lease(p_slot.lease);
begin
    if p_scheduled_for + p_timeout <= clock_timestamp() then
        return false;
    end if;
    -- a NOTIFY payload must stay under 8000 bytes (the payload is built at commit: the same
    -- fields, and a margin for the lease's end written out then)
    if octet_length(handoff_payload(p_id, p_workflow, p_input, p_slot.lease, v_lease_until))
            >= 7900 then
        return false;
    end if;
    insert into runs (id, workflow, queue, input, priority, scheduled_for, concurrency_key,
                      max_attempts, timeout, timeout_at, parent_run_id, status, lease_epoch,
                      locked_by, locked_until, started_at)
    values (p_id, p_workflow, p_queue, p_input, p_priority, p_scheduled_for, p_concurrency_key,
            p_max_attempts, p_timeout, p_scheduled_for + p_timeout, p_parent_run_id, 'running',
            1, p_slot.worker_id, v_lease_until, now())
    on conflict do nothing;
    if not found then
        return false;
    end if;
    update handoff_slots s set handed_run_id = p_id where s.id = p_slot.id;
    return true;
end
$$;

-- What a worker is sent for a run handed to it (flowly/worker/handoff.py reads it): what a
-- claim would have returned, the first lease's length, and its end on the server's clock.
create function handoff_payload(
    p_id text, p_workflow text, p_input jsonb, p_lease interval, p_lease_until timestamptz
) returns text
language sql stable
set search_path from current
as $$
    select json_build_object(
        'run_id', p_id, 'workflow', p_workflow, 'input', p_input, 'attempt', 1,
        'generation', 1, 'lease_epoch', 1,
        'lease_seconds', extract(epoch from handoff_lease(p_lease)),
        'lease_until', extract(epoch from p_lease_until))::text
$$;

-- At the commit of a start that took a slot: uses the slot up and sends its worker the run,
-- read as the transaction leaves it, if it is still the hand-off's (running, first epoch, held
-- by the slot's worker) and not past its timeout. A run its own transaction cancelled, or
-- otherwise moved on, is not sent: the worker would begin it on trust.
create function send_handed_off_run() returns trigger
language plpgsql
set search_path from current
as $$
declare
    v_run runs;
    v_payload text;
begin
    delete from handoff_slots s where s.id = new.id;
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

create constraint trigger handoff_slots_send_at_commit
    after update of handed_run_id on handoff_slots
    deferrable initially deferred
    for each row when (new.handed_run_id is not null)
    execute function send_handed_off_run();

-- start as in 0030, its scheduled time passed on to a hand-off.
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
