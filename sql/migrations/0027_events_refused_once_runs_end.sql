-- 0027_events_refused_once_runs_end: an event is refused by a run that an ending in flight
-- ends, and is stamped when it is sent, not when its transaction began.
--
-- send_event read the run's status without a lock, then inserted the event, whose foreign key
-- waited for an ending in flight (a cancel, the timeout sweep: 0024 has them lock the run for
-- update) and then let the insert through: the event was stored on a cancelled or
-- dead-lettered run, and send_event returned as if it had been delivered. The status is now
-- read under a key-share lock, which waits for such an ending and then reads the run as it
-- ended (under REPEATABLE READ, 40001).
--
-- sent_at defaulted to now(), the start of the sender's transaction: an event sent after a
-- wait's deadline from a transaction that began before it counted, although only events sent
-- by the deadline do. It is now the time of the send.

-- send_event as in 0009, with the run key-share locked and sent_at the time of the send.
create or replace function send_event(run_id text, name text, payload jsonb default 'null')
returns bigint
language plpgsql
set search_path from current
as $$
declare
    v_status text;
    v_seq bigint;
begin
    perform check_name('event name', send_event.name);
    select r.status into v_status from runs r where r.id = send_event.run_id for key share;
    if not found then
        raise exception 'run % not found', send_event.run_id using errcode = 'WF002';
    end if;
    if v_status in ('completed', 'dead_letter', 'cancelled') then
        raise exception 'run % is %: it takes no more events', send_event.run_id, v_status
            using errcode = 'WF004';
    end if;
    insert into events (run_id, name, payload, sent_at)
    values (send_event.run_id, send_event.name, coalesce(send_event.payload, 'null'),
            clock_timestamp())
    returning seq into v_seq;
    perform wake_waiters(array[send_event.run_id], send_event.name);
    return v_seq;
end
$$;
