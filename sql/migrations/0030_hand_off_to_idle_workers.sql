-- 0030_hand_off_to_idle_workers: a run started while a worker waits idle for it goes to that
-- worker in the start's own transaction, so the worker begins it without a claim.
--
-- Enqueue to first step used to be a start, its NOTIFY, and then a claim: a round trip and a
-- commit of about as much as the start again. A worker whose claim left it with free slots now
-- offers one (handoff_slots). start takes an offered slot with skip locked, writes the run as
-- claimed by that worker in the start's own transaction and sends the worker the run on a
-- channel of its own: at commit the worker has what a claim would have returned.
--
-- What keeps it safe:
-- - the hand-off is a claim made by start: a new lease epoch, a fencing token like any other;
-- - its first lease is short (handoff_lease, at most 5 s): a worker that died after offering
--   leaves the run to any claim within seconds, not a whole lease; the worker extends it with
--   a heartbeat as soon as it has the run;
-- - only runs with nothing due ahead of them at their priority are handed off (claim order
--   holds), only in READ COMMITTED (under REPEATABLE READ a slot refreshed since the snapshot
--   would fail the start with 40001), and only when the run fits in a NOTIFY payload;
-- - nothing waits on a slot: start takes one with skip locked, and a worker maintains its own
--   with skip locked, so a transaction that took a slot and stays open holds up nobody (the
--   worker offers another meanwhile; if it is full when the run arrives, it releases it).

create table handoff_slots (
    id bigint generated always as identity primary key,
    worker_id text not null,
    -- where to send the runs handed off: the worker instance's own channel (not one derived
    -- from worker_id, which two processes may share by mistake: both would run the run)
    channel text not null,
    workflows text[] not null,
    queues text[] not null,
    lease interval not null,
    offered_at timestamptz not null default now(),
    expires_at timestamptz not null
);
create index handoff_slots_worker on handoff_slots (worker_id);

-- The first lease of a handed-off run: the worker's own lease, but no more than 5 s, so a run
-- handed to a worker that died since it offered its slot is claimable again within seconds.
create function handoff_lease(p_lease interval) returns interval
language plpgsql immutable
set search_path from current
as $$
begin
    return least(p_lease, interval '5 seconds');
end
$$;

-- claim, then the worker's offer of one idle slot brought up to date: offered, with the
-- channel it listens on, when it gives one (p_handoff_channel) and the claim left it a free
-- slot; withdrawn otherwise. The worker's slots that a start holds (an open transaction) are
-- skipped, never waited for. An offer that stands is rewritten only in the second half of its
-- life: a start finds it locked meanwhile (and goes the claim's way), so it is not locked at
-- every claim.
create function claim_and_offer(
    p_worker text, p_workflows text[], p_queues text[], p_limit integer, p_lease interval,
    p_handoff_channel text
) returns table (
    run_id text, workflow text, status text, input jsonb, attempt integer, generation integer,
    lease_epoch bigint, has_history boolean
)
language plpgsql
set search_path from current
as $$
declare
    v_claimed integer;
    v_free_slots bigint[];
begin
    return query select * from claim(p_worker, p_workflows, p_queues, p_limit, p_lease);
    get diagnostics v_claimed = row_count;
    if p_handoff_channel is not null and v_claimed < p_limit and exists (
            select from handoff_slots s
            where s.worker_id = p_worker and s.expires_at > now() + p_lease / 2
              and s.channel = p_handoff_channel and s.workflows = p_workflows
              and s.queues = p_queues and s.lease = p_lease) then
        return;
    end if;
    v_free_slots := array(
        select s.id from handoff_slots s
        where s.worker_id = p_worker
        order by s.id
        for update skip locked);
    if p_handoff_channel is not null and v_claimed < p_limit then
        if cardinality(v_free_slots) = 0 then
            insert into handoff_slots (worker_id, channel, workflows, queues, lease, expires_at)
            values (p_worker, p_handoff_channel, p_workflows, p_queues, p_lease,
                    now() + p_lease);
        else
            update handoff_slots s
            set channel = p_handoff_channel, workflows = p_workflows, queues = p_queues,
                lease = p_lease, expires_at = now() + p_lease
            where s.id = v_free_slots[1];
            delete from handoff_slots s where s.id = any(v_free_slots[2:]);
        end if;
    elsif cardinality(v_free_slots) > 0 then
        delete from handoff_slots s where s.id = any(v_free_slots);
    end if;
    -- the slots of workers long gone (each expires a lease after its worker's last claim)
    delete from handoff_slots s
    where s.id in (select x.id from handoff_slots x
                   where x.expires_at < now() - interval '1 minute'
                   limit 10
                   for update skip locked);
end
$$;

-- The idle slot a run of this workflow, queue and priority may be handed to, locked (skip
-- locked, so no start waits for another), or null: none offered, or a run due at this priority
-- waits already (it goes first: a claim takes it). Only in READ COMMITTED: under REPEATABLE
-- READ a slot its worker refreshed since the snapshot would fail the start with 40001.
create function idle_slot_for(p_workflow text, p_queue text, p_priority integer)
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
    order by s.offered_at
    limit 1
    for update skip locked;
    if not found or exists (
            select from runs r
            where r.queue = p_queue and r.workflow = p_workflow and r.priority = p_priority
              and r.status in ('pending', 'running', 'compensating')
              and r.available_at <= now()) then
        return null;
    end if;
    return v_slot;
end
$$;

-- Inserts a new run already claimed by the worker of p_slot (a new epoch, a first lease of
-- handoff_lease), takes the slot and sends the worker the run at commit; false, with nothing
-- written, when the run id or its concurrency key is taken (insert_run then says which run
-- that is) or the run would not fit in a NOTIFY payload (the claim's way then).
create function insert_handed_off_run(
    p_slot handoff_slots, p_id text, p_workflow text, p_queue text, p_input jsonb,
    p_priority integer, p_concurrency_key text, p_max_attempts integer, p_timeout interval,
    p_parent_run_id text
) returns boolean
language plpgsql
set search_path from current
as $$
declare
    v_payload text;
begin
    v_payload := json_build_object(
        'run_id', p_id, 'workflow', p_workflow, 'input', p_input, 'attempt', 1,
        'generation', 1, 'lease_epoch', 1,
        'lease_seconds', extract(epoch from handoff_lease(p_slot.lease)))::text;
    -- a NOTIFY payload must stay under 8000 bytes
    if octet_length(v_payload) >= 7900 then
        return false;
    end if;
    insert into runs (id, workflow, queue, input, priority, scheduled_for, concurrency_key,
                      max_attempts, timeout, timeout_at, parent_run_id, status, lease_epoch,
                      locked_by, locked_until, started_at)
    values (p_id, p_workflow, p_queue, p_input, p_priority, now(), p_concurrency_key,
            p_max_attempts, p_timeout, now() + p_timeout, p_parent_run_id, 'running', 1,
            p_slot.worker_id, now() + handoff_lease(p_slot.lease), now())
    on conflict do nothing;
    if not found then
        return false;
    end if;
    delete from handoff_slots s where s.id = p_slot.id;
    perform pg_notify(p_slot.channel, v_payload);
    return true;
end
$$;

-- unregister_worker as in 0001, and its idle slots withdrawn (those a start holds are left
-- to expire: the runs handed off through them go to any claim after handoff_lease).
create or replace function unregister_worker(p_worker text) returns void
language sql
set search_path from current
as $$
    delete from handoff_slots s
    where s.id in (select x.id from handoff_slots x where x.worker_id = p_worker
                   for update skip locked);
    delete from workers where id = p_worker
$$;

-- start as in 0026, but a run due now goes straight to an idle worker when one offered a slot
-- (above).
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
            coalesce(start.priority, 0), start.concurrency_key, start.max_attempts,
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
