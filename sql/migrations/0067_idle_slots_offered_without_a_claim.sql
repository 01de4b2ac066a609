-- 0067_idle_slots_offered_without_a_claim: an idle slot serves several hand-offs in a row, and
-- a worker whose slot is used up offers another without claiming.
--
-- At a steady rate that a worker keeps up with, most runs are handed off, and the commit of
-- each hand-off used up the slot it took. The worker then called claim_and_offer to offer
-- another, and the claim in it found nothing: the hand-off itself showed that no run was due
-- ahead of it, and a run started since that could not be handed off sent a wake-up of its
-- own, which claims. That call (its sweep of stalled runs included) was half the cost of a
-- handed-off run's calls besides its own writes. Now:
--
-- - a slot carries its worker's room: how many more runs the worker can take besides the
--   one the slot goes to. A hand-off's commit offers the slot again with one less, and uses
--   it up at 0; the payload tells the worker which (room, -1 for used up). Room is an upper
--   bound: a worker that is full when a run arrives gives it back, as before. It is at most
--   7, so a worker that froze or died with its slot offered holds no more than 8 new runs
--   on their short first leases (one before);
-- - offer_slot is the offer half of claim_and_offer (which now calls it), for a worker whose
--   slot was used up.
--
-- Lock order as in 0030 and 0036: the worker's own slots, skip locked, no run's row; at
-- commit the trigger writes the slot its transaction holds and reads the run unlocked.

alter table handoff_slots add column room integer not null default 0;

-- Offers one idle slot of the worker on p_handoff_channel, with p_room (the runs it can take
-- besides that slot's; 7 at most, see above), or withdraws its slots when the channel is
-- null: a slot offered before is kept while it is in the first half of its life and its room
-- is p_room, rewritten otherwise, and any more slots of the worker are deleted. Slots a start
-- holds (an open transaction) are skipped, never waited for. Also deletes a few slots of
-- workers long gone (each expires a lease after its worker's last offer).
create function offer_slot(
    p_worker text, p_workflows text[], p_queues text[], p_lease interval,
    p_handoff_channel text, p_room integer default 0
) returns void
language plpgsql
set search_path from current
as $$
declare
    v_free_slots bigint[];
    v_room integer := least(greatest(p_room, 0), 7);
begin
    perform check_lease(p_lease);
    if p_handoff_channel is not null and exists (
            select from handoff_slots s
            where s.worker_id = p_worker and s.expires_at > now() + p_lease / 2
              and s.channel = p_handoff_channel and s.workflows = p_workflows
              and s.queues = p_queues and s.lease = p_lease
              and s.room = v_room) then
        return;
    end if;
    v_free_slots := array(
        select s.id from handoff_slots s
        where s.worker_id = p_worker
        order by s.id
        for update skip locked);
    if p_handoff_channel is not null then
        if cardinality(v_free_slots) = 0 then
            insert into handoff_slots (worker_id, channel, workflows, queues, lease, expires_at,
                                       room)
            values (p_worker, p_handoff_channel, p_workflows, p_queues, p_lease,
                    now() + p_lease, v_room);
        else
            update handoff_slots s
            set channel = p_handoff_channel, workflows = p_workflows, queues = p_queues,
                lease = p_lease, expires_at = now() + p_lease, room = v_room
            where s.id = v_free_slots[1];
            delete from handoff_slots s where s.id = any(v_free_slots[2:]);
        end if;
    elsif cardinality(v_free_slots) > 0 then
        delete from handoff_slots s where s.id = any(v_free_slots);
    end if;
    delete from handoff_slots s
    where s.id in (select x.id from handoff_slots x
                   where x.expires_at < now() - interval '1 minute'
                   limit 10
                   for update skip locked);
end
$$;

-- claim_and_offer as in 0030: the claim, then offer_slot, which offers a slot only when the
-- claim left the worker a free one (p_limit is the worker's room before the claim).
create or replace function claim_and_offer(
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
begin
    return query select * from claim(p_worker, p_workflows, p_queues, p_limit, p_lease);
    get diagnostics v_claimed = row_count;
    perform offer_slot(p_worker, p_workflows, p_queues, p_lease,
                       case when v_claimed < p_limit then p_handoff_channel end,
                       p_limit - v_claimed - 1);
end
$$;

-- handoff_payload as in 0037, with the room left in the slot the run came by (-1: used up);
-- null (as hand_off's check of the payload's length passes it) leaves it out.
drop function handoff_payload(text, text, jsonb, interval, timestamptz);
create function handoff_payload(
    p_id text, p_workflow text, p_input jsonb, p_lease interval, p_lease_until timestamptz,
    p_room integer default null
) returns text
language plpgsql stable
set search_path from current
as $$
begin
    return json_build_object(
        'run_id', p_id, 'workflow', p_workflow, 'input', p_input, 'attempt', 1,
        'generation', 1, 'lease_epoch', 1,
        'lease_seconds', extract(epoch from handoff_lease(p_lease)),
        'lease_until', extract(epoch from p_lease_until), 'room', p_room)::text;
end
$$;

-- send_handed_off_run as in 0065, for a slot still marked for the run its event names: the
-- slot is offered again with one less room while it has room, else used up (deleted).
create or replace function send_handed_off_run() returns trigger
language plpgsql
set search_path from current
as $$
declare
    v_run runs;
    v_room integer;
    v_payload text;
begin
    update handoff_slots s set handed_run_id = null, room = s.room - 1
    where s.id = new.id and s.handed_run_id = new.handed_run_id and s.room > 0
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
    v_payload := handoff_payload(v_run.id, v_run.workflow, v_run.input, new.lease,
                                 v_run.locked_until, v_room);
    if octet_length(v_payload) < 8000 then
        perform pg_notify(new.channel, v_payload);
    end if;
    return null;
end
$$;
