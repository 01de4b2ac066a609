-- 0067_idle_slots_offered_without_a_claim: a worker that took a hand-off offers its next idle
-- slot without claiming.
--
-- At a steady rate that a worker keeps up with, most runs are handed off, and the commit of
-- each hand-off uses up the slot it took. The worker then called claim_and_offer to offer
-- another, and the claim in it found nothing: the hand-off itself showed that no run was due
-- ahead of it, and a run started since that could not be handed off sent a wake-up of its
-- own, which claims. That claim (its sweep of stalled runs included) was half the cost of a
-- handed-off run's calls besides its own writes. offer_slot is the offer half of
-- claim_and_offer, which now calls it.
--
-- Lock order as in 0030: the worker's own slots, skip locked; no run's row.

-- Offers one idle slot of the worker on p_handoff_channel, or withdraws its slots when that is
-- null: a slot offered before is kept while it is in the first half of its life, rewritten
-- after, and any more slots of the worker are deleted. Slots a start holds (an open
-- transaction) are skipped, never waited for. Also deletes a few slots of workers long gone
-- (each expires a lease after its worker's last offer).
create function offer_slot(
    p_worker text, p_workflows text[], p_queues text[], p_lease interval,
    p_handoff_channel text
) returns void
language plpgsql
set search_path from current
as $$
declare
    v_free_slots bigint[];
begin
    perform check_lease(p_lease);
    if p_handoff_channel is not null and exists (
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
    if p_handoff_channel is not null then
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
    delete from handoff_slots s
    where s.id in (select x.id from handoff_slots x
                   where x.expires_at < now() - interval '1 minute'
                   limit 10
                   for update skip locked);
end
$$;

-- claim_and_offer as in 0030: the claim, then offer_slot, which offers a slot only when the
-- claim left the worker a free one.
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
                       case when v_claimed < p_limit then p_handoff_channel end);
end
$$;
