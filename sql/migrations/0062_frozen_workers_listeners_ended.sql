-- 0062_frozen_workers_listeners_ended: a worker frozen whole no longer holds the server's
-- notification queue.
--
-- A worker stopped by SIGSTOP, a paused container or a suspended VM stops reading its listener
-- connection. The server goes on sending that backend the notifications of its channels (the
-- wake-up every start sends); once the socket is full the backend stalls writing to it, and
-- the notification queue, which all sessions of the server share, cannot be cleared past the
-- place it stalled at. The queue grows by every start and finish until it is full (8 GB), and
-- then every NOTIFY fails, every start with it.
--
-- A worker now records its listener's backend when it listens (record_listener): the pid and
-- the backend's start time, so that a pid the server gives to a later backend is never taken
-- for it. Live workers end (end_stalled_listeners, at each heartbeat) the recorded listener
-- of a worker past its lease whose backend is stalled writing to its client: a worker past
-- its lease has had its runs taken over already, and its stalled backend is what holds the
-- queue. A listener that is merely behind reads on and is left alone. The frozen worker, once
-- woken, finds its listener gone and listens anew, as after any dropped connection.
--
-- Only backends the caller may see and signal are ended: those of its own role, or any when
-- roles are set up (the functions then run with the owner's rights). Lock order: the caller's
-- own workers row only, skipped while another transaction holds it; end_stalled_listeners
-- locks nothing.

alter table workers add column listener_pid integer, add column listener_started_at timestamptz;

-- The calling backend recorded as the listener of p_worker (called on the listener connection
-- once it listens). Nothing is recorded while another transaction holds the row.
create function record_listener(p_worker text) returns void
language plpgsql
set search_path from current
as $$
begin
    perform check_name('worker', p_worker);
    update workers w
    set listener_pid = pg_backend_pid(),
        listener_started_at = (select a.backend_start
                               from pg_stat_get_activity(pg_backend_pid()) a)
    where w.id = (select x.id from workers x where x.id = p_worker
                  for no key update skip locked);
end
$$;

-- Ends the listener backends of workers past their lease that are stalled writing to their
-- client (see the header), and returns those workers' ids.
create function end_stalled_listeners() returns setof text
language plpgsql
set search_path from current
as $$
declare
    v_worker text;
    v_pid integer;
begin
    for v_worker, v_pid in
        select w.id, w.listener_pid from workers w
        cross join lateral pg_stat_get_activity(w.listener_pid) a
        where w.listener_pid is not null and w.last_seen_at + w.lease < now()
          and a.backend_start = w.listener_started_at and a.wait_event = 'ClientWrite'
    loop
        begin
            if pg_terminate_backend(v_pid) then
                return next v_worker;
            end if;
        exception when insufficient_privilege then
            raise warning 'the listener of worker % is stalled, holding the server''s'
                ' notification queue, and this role may not end it (backend %)',
                v_worker, v_pid;
        end;
    end loop;
end
$$;
