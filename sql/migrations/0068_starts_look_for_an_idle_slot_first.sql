-- 0068_starts_look_for_an_idle_slot_first: a start with no idle worker to hand its run to
-- finds that out by a read, and a start that hands its run off builds its payload once.
--
-- hand_off took an offered slot with one update whose subquery locked it (skip locked).
-- Where no slot was offered, which is most starts while workers are busy, the update found
-- nothing, yet it cost a fifth of the start's time on the server (45 of 227 us a start,
-- track_functions over 600 starts, each after a pause). It also built the hand-off's
-- payload to measure it, and send_handed_off_run built it again at commit. Now:
--
-- - hand_off reads whether a slot of the workflow and queue is offered before it updates
--   one; a slot offered by a transaction that commits meanwhile is missed by both alike;
-- - the payload's length is bounded from its parts (the input's text and the names as JSON
--   strings, and 240 bytes for the rest: the keys, the constant fields, the lease's seconds
--   and end to the microsecond and the room take 172 at most, for an end in the year 1 BC)
--   instead of built: a bound, so a payload judged to fit does fit, as the trigger's check
--   at commit (< 8000) finds.
--
-- Lock order as in 0065: the slot (skip locked), then the run's row (its insert).

-- hand_off as in 0065, a read for an offered slot first, the payload bounded, not built.
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
begin
    if current_setting('transaction_isolation') <> 'read committed'
       or p_scheduled_for + p_timeout <= clock_timestamp()
       or not exists (select from handoff_slots o
                      where p_workflow = any(o.workflows) and p_queue = any(o.queues)
                        and o.expires_at > now() and o.handed_run_id is null) then
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
       and octet_length(p_input::text) + octet_length(to_json(p_id)::text)
           + octet_length(to_json(p_workflow)::text) + 240 < 7900 then
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
