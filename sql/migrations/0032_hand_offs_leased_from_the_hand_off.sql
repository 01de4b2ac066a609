-- 0032_hand_offs_leased_from_the_hand_off: a handed-off run's first lease counts from the
-- moment start writes it, and the worker is told when that lease ends; start's check for runs
-- due ahead of a hand-off never reads the finished runs.
--
-- insert_handed_off_run (0030) set the lease from now(), the start of the caller's
-- transaction: a start made late in a transaction open for longer than the first lease wrote a
-- run whose lease had already lapsed, so a claim could take it while the worker it was sent
-- to began it. The lease now counts from clock_timestamp(). The transaction may still commit
-- (and so send the run) late, and the worker may read it late (frozen, its event loop
-- blocked): the payload carries the lease's end on the server's clock ('lease_until', epoch
-- seconds), so the worker can tell a run it may begin at once from one it must confirm first
-- (flowly/worker/handoff.py).

-- insert_handed_off_run as in 0030, leased from clock_timestamp(), the lease's end sent along.
create or replace function insert_handed_off_run(
    p_slot handoff_slots, p_id text, p_workflow text, p_queue text, p_input jsonb,
    p_priority integer, p_concurrency_key text, p_max_attempts integer, p_timeout interval,
    p_parent_run_id text
) returns boolean
language plpgsql
set search_path from current
as $$
declare
    v_lease_until timestamptz := clock_timestamp() + handoff_lease(p_slot.lease);
    v_payload text;
begin
    v_payload := json_build_object(
        'run_id', p_id, 'workflow', p_workflow, 'input', p_input, 'attempt', 1,
        'generation', 1, 'lease_epoch', 1,
        'lease_seconds', extract(epoch from handoff_lease(p_slot.lease)),
        'lease_until', extract(epoch from v_lease_until))::text;
    -- a NOTIFY payload must stay under 8000 bytes
    if octet_length(v_payload) >= 7900 then
        return false;
    end if;
    insert into runs (id, workflow, queue, input, priority, scheduled_for, concurrency_key,
                      max_attempts, timeout, timeout_at, parent_run_id, status, lease_epoch,
                      locked_by, locked_until, started_at)
    values (p_id, p_workflow, p_queue, p_input, p_priority, now(), p_concurrency_key,
            p_max_attempts, p_timeout, now() + p_timeout, p_parent_run_id, 'running', 1,
            p_slot.worker_id, v_lease_until, now())
    on conflict do nothing;
    if not found then
        return false;
    end if;
    delete from handoff_slots s where s.id = p_slot.id;
    perform pg_notify(p_slot.channel, v_payload);
    return true;
end
$$;

-- Whether a run of this queue, workflow and priority is due already: it goes before a new one,
-- so that one is not handed off. A function of its own, without sequential scans: inside
-- idle_slot_for, once PL/pgSQL had settled on a generic plan under statistics taken while the
-- runs were pending (a drain that ended before autovacuum analyzed again), the check read the
-- whole of runs, so every start paid for the finished history (2.3 ms at 10,000 runs). The
-- claim index answers it, as it answers claim. (Not set on idle_slot_for itself: its slot
-- look-up has no index to use, and the cost of a disabled scan would have it JIT-compiled at
-- every call.)
create function run_due_ahead(p_queue text, p_workflow text, p_priority integer)
returns boolean
language plpgsql stable
set search_path from current
set enable_seqscan = off
set jit = off
as $$
begin
    return exists (
        select from runs r
        where r.queue = p_queue and r.workflow = p_workflow and r.priority = p_priority
          and r.status in ('pending', 'running', 'compensating')
          and r.available_at <= now());
end
$$;

-- idle_slot_for as in 0030, its check for runs due ahead in run_due_ahead.
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
    order by s.offered_at
    limit 1
    for update skip locked;
    if not found or run_due_ahead(p_queue, p_workflow, p_priority) then
        return null;
    end if;
    return v_slot;
end
$$;

-- heartbeat refuses sequential scans (0011) but, unlike claim, checkpoint_steps and
-- complete_runs, did not turn JIT off: the stalled-run sweep it runs reads settings through
-- max_takeovers(), a sequential scan at a disabled scan's cost (10^10), so every heartbeat
-- JIT-compiled that query, about 100 ms of server CPU, and so did the heartbeat that extends
-- every handed-off run's lease.
alter function heartbeat(text, text[], bigint[], interval) set jit = off;
