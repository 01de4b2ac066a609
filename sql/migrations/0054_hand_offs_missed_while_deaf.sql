-- 0054_hand_offs_missed_while_deaf: a worker that listens again releases the runs handed to
-- it that it never received, so they start at once instead of seconds later.
--
-- A hand-off is sent by NOTIFY on the worker's own channel (0030). When the worker's LISTEN
-- connection was cut between its offer and a start that took it (a restarted pooler, a
-- terminated backend), the notification reached nobody: the run, leased to that worker, waited
-- for its first lease (up to 5 s) to lapse and then for the worker's next poll. Nothing was
-- lost, but the run started up to max(5 s, poll interval) late.
--
-- A handed-off run is the one a start claimed in its own transaction (started_at = created_at)
-- under the first epoch. A worker that listens again calls release_missed_handoffs with the
-- runs it holds; the others handed to its name are released (a new epoch: a notification of
-- one read late can no longer begin it) and wake the claim. Two processes that share a worker
-- name by mistake (0030's case) release each other's hand-offs when one of them listens
-- again: the epoch fences the other off, and the run is claimed again, as after a takeover.
--
-- Lock order: the runs' rows, skip locked (as release), never the slots.

create function release_missed_handoffs(p_worker text, p_held text[]) returns setof text
language plpgsql
set search_path from current
as $$
declare
    v_id text;
begin
    if p_worker is null or p_worker = '' then
        raise exception 'worker name must be a non-empty string, got %',
            coalesce('"' || p_worker || '"', 'null') using errcode = 'WF003';
    end if;
    for v_id in
        select r.id from runs r
        where r.locked_until > now() and r.locked_by = p_worker and r.status = 'running'
          and r.lease_epoch = 1 and r.started_at = r.created_at
          and r.id <> all(coalesce(p_held, '{}'))
        order by r.id
        for update skip locked
    loop
        perform release_held_run(v_id, now());
        return next v_id;
    end loop;
end
$$;
