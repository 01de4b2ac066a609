-- 0077_idle_workers_keep_their_latency_across_stops_and_lost_listeners: a start that took the
-- slot of a worker that stopped meanwhile, and a run announced due later while a worker's
-- listener was down, no longer wait for a lease or a poll.
--
-- 1. A worker that stops withdraws its offers and leaves flowly.workers (unregister_worker),
-- but a slot a start holds in an open transaction is skipped, never waited for. At that
-- start's commit, send_handed_off_run offered the slot again with one less room, for a worker
-- gone: the next starts took it first (the oldest offer goes first), each run was written as
-- claimed by nobody listening, and each waited out its 5 s first lease and a poll while live
-- workers sat idle; so did the run of the start that held the slot. Now:
--
-- - send_handed_off_run, at commit, finds the slot's worker no longer registered: it deletes
--   the slot, and releases the run (a new epoch, due at its scheduled time) and wakes the
--   workers of its queue, so a live worker claims it at once;
-- - hand_off takes only a slot whose worker is registered, so a slot offered again by a
--   commit that raced the worker's unregistering hands nothing off either (it expires).
--
-- 2. A run started to be due within the hour is announced by NOTIFY with its time (0069). A
-- worker whose LISTEN connection had just been cut (a terminated backend, a restarted server
-- or pooler) heard nothing of it, and claimed it at its next poll, however long after its
-- time. due_within_the_hour gives a worker that listens again the times its runs come due
-- within the hour, the earliest 100, and it times its claims for them (due_timer.py), as it
-- releases the runs handed to it meanwhile (0054).
--
-- Lock order as in 0065: the slot (skip locked), then the run's row (its insert); the
-- worker's row is read, never locked, so unregister_worker and start wait for each other
-- nowhere. due_within_the_hour locks nothing.

-- hand_off as in 0070, the slot's worker required to be registered (see the header).
create or replace function hand_off(
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
    v_timeout_at timestamptz := (p_scheduled_for at time zone 'UTC' + p_timeout) at time zone 'UTC';
begin
    if current_setting('transaction_isolation') <> 'read committed'
       or v_timeout_at <= clock_timestamp()
       or not exists (select from handoff_slots o
                      where p_workflow = any(o.workflows) and p_queue = any(o.queues)
                        and o.expires_at > now() and o.handed_run_id is null) then
        return false;
    end if;
    update handoff_slots s set handed_run_id = p_id
    where s.id = (select o.id from handoff_slots o
                  where p_workflow = any(o.workflows) and p_queue = any(o.queues)
                    and o.expires_at > now() and o.handed_run_id is null
                    and exists (select from workers w where w.id = o.worker_id)
                  order by o.offered_at
                  limit 1
                  for update of o skip locked)
    returning s.* into v_slot;
    if not found then
        return false;
    end if;
    v_lease_until := clock_timestamp() + handoff_lease(v_slot.lease);
    if not run_due_ahead(v_slot.queues, v_slot.workflows, p_priority)
       and octet_length(p_input::text) + octet_length(to_json(p_id)::text)
           + octet_length(to_json(p_workflow)::text) + 240 < 7900 then
        insert into runs (id, workflow, queue, input, priority, scheduled_for, concurrency_key,
                          max_attempts, timeout, timeout_at, parent_run_id, status, lease_epoch,
                          locked_by, locked_until, started_at)
        values (p_id, p_workflow, p_queue, p_input, p_priority, p_scheduled_for,
                p_concurrency_key, p_max_attempts, p_timeout, v_timeout_at,
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

-- At the commit of a start that took a slot (a deferred trigger): offers the slot again
-- with one less room, or uses it up at none left, and sends its worker the run, as the
-- transaction leaves it (not cancelled, not past its timeout). When the slot's worker is no
-- longer registered (it stopped while the start held its slot), deletes the slot and
-- releases the run to a claim instead, waking the workers of its queue.
create or replace function send_handed_off_run() returns trigger
language plpgsql
set search_path from current
as $$
declare
    v_run runs;
    v_room integer;
    v_payload text;
    v_worker_gone boolean := not exists (select from workers w where w.id = new.worker_id);
begin
    update handoff_slots s set handed_run_id = null, room = s.room - 1
    where s.id = new.id and s.handed_run_id = new.handed_run_id and s.room > 0
      and not v_worker_gone
    returning s.room into v_room;
    if not found then
        delete from handoff_slots s where s.id = new.id and s.handed_run_id = new.handed_run_id;
        if not found then
            return null;
        end if;
        v_room := -1;
    end if;
    select * into v_run from runs r where r.id = new.handed_run_id;
    if not found or v_run.status <> 'running' or v_run.lease_epoch <> 1
            or v_run.locked_by is distinct from new.worker_id
            or v_run.timeout_at <= clock_timestamp() then
        return null;
    end if;
    if v_worker_gone then
        -- due since its start (hand_off takes only due runs): released, it wakes the claim
        perform release_held_run(v_run.id, v_run.scheduled_for);
        return null;
    end if;
    v_payload := handoff_payload(v_run.id, v_run.workflow, v_run.input, new.lease,
                                 v_run.locked_until, v_room);
    if octet_length(v_payload) < 8000 then
        perform pg_notify(new.channel, v_payload);
    end if;
    return null;
end
$$;

-- The times within the hour at which pending runs of the given queues and workflows come
-- due, the earliest 100 (see the header): for a worker that listens again to time its claims.
-- It reads the claim's index (runs_claimable) over what the worker serves, and moves nothing.
create function due_within_the_hour(p_workflows text[], p_queues text[])
returns setof timestamptz
language sql stable
set search_path from current
as $$
    select distinct r.available_at from runs r
    where r.queue = any(p_queues) and r.workflow = any(p_workflows) and r.status = 'pending'
      and r.available_at > now() and r.available_at <= now() + interval '1 hour'
    order by r.available_at
    limit 100
$$;

-- apply_roles as in 0072, due_within_the_hour granted to the worker role with the calls a
-- worker makes.
create or replace function apply_roles() returns void
language plpgsql
set search_path from current
as $$
declare
    v_settings settings;
    v_function regprocedure;
    -- what workers and clients call (flowly/db.py, flowly/schedules.py), what the README
    -- documents for users, triggers and workers, and what trigger_run_id calls
    v_worker_calls constant text[] := array[
        'begin_compensation_transaction', 'begin_transaction_step', 'cancel', 'checkpoint',
        'checkpoint_steps', 'checkpoint_transaction', 'claim', 'claim_and_offer', 'complete',
        'complete_runs', 'cron_next', 'due_within_the_hour', 'end_stalled_listeners',
        'fail_run', 'fail_step', 'finish_compensation', 'finished_channel', 'fold_run_counts',
        'heartbeat', 'key_run_id', 'offer_slot', 'park', 'pause_schedule', 'purge', 'record_compensation',
        'record_compensation_transaction', 'record_listener', 'records_predate_branch_names',
        'register_worker', 'release', 'release_missed_handoffs', 'replay',
        'restart_takeovers', 'resume_schedule', 'retry_dead_letter', 'schedule',
        'send_event', 'sleep', 'start', 'tick_schedules', 'trigger_key_columns',
        'trigger_run_id', 'undone_steps', 'unregister_worker', 'unschedule',
        'wait_for_event', 'wait_for_run', 'wake_missed_waiters', 'wakeup_channel'];
begin
    select * into v_settings from settings;
    if v_settings.worker_role is null then
        return;
    end if;
    -- setup_roles and apply_roles stay the caller's: only an administrator manages roles;
    -- trigger_run_id stays the caller's too (see 0020)
    for v_function in
        select p.oid::regprocedure from pg_proc p
        join pg_namespace n on n.oid = p.pronamespace
        where n.nspname = current_schema()
          and p.proname not in ('setup_roles', 'apply_roles', 'trigger_run_id')
    loop
        execute format('alter function %s security definer', v_function);
    end loop;
    alter function trigger_run_id(text, text, anyelement) security invoker;
    execute format('revoke all on all functions in schema %I from public, %I',
                   current_schema(), v_settings.worker_role);
    execute format('revoke all on all tables in schema %I from public', current_schema());
    execute format('grant usage on schema %I to %I, %I', current_schema(),
                   v_settings.worker_role, v_settings.reader_role);
    for v_function in
        select p.oid::regprocedure from pg_proc p
        join pg_namespace n on n.oid = p.pronamespace
        where n.nspname = current_schema() and p.proname = any(v_worker_calls)
    loop
        execute format('grant execute on function %s to %I', v_function,
                       v_settings.worker_role);
    end loop;
    execute format('grant select on all tables in schema %I to %I, %I', current_schema(),
                   v_settings.worker_role, v_settings.reader_role);
end
$$;

