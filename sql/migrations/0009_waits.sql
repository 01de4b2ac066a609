-- 0009_waits: durable waits for events and for other runs.
--
-- A workflow waits for an event sent to it (send_event) or for another run to finish. The
-- wait is a row in waits, written once under the run's lock (its timeout deadline never moves
-- on replay); its outcome (the event's payload, the timeout, the other run's result) is
-- recorded as a step of the waiting run (kind 'event' or 'run'), so a replay takes the same
-- branch. A run that must wait is parked: released, held by no worker, due at its earliest
-- timeout or never; whatever satisfies a wait (send_event, a run finishing) makes it due now
-- and wakes workers. park checks the waits under the run's lock and the wakers update the
-- run's row, so a wake-up that races a park is never lost.
--
-- Lock order: the waiting run's row before its waits and events rows; a finishing run's row
-- (the statement that finishes it) before the rows of the runs waiting for it.

alter table steps drop constraint steps_kind_valid;
alter table steps add constraint steps_kind_valid
    check (kind in ('step', 'start', 'transaction', 'event', 'run'));

-- Events sent to a run, consumed one per wait, oldest first.
create table events (
    run_id text not null references runs (id) on delete cascade,
    seq bigint not null default nextval('step_seq'),
    name text not null,
    payload jsonb not null default 'null',
    sent_at timestamptz not null default now(),
    -- the wait (the waiting run's step name) that consumed it
    consumed_by text,
    primary key (run_id, seq)
);
create index events_unconsumed on events (run_id, name, seq) where consumed_by is null;

-- What a parked run waits for: an event of a name, or a run to finish, until a deadline.
create table waits (
    run_id text not null references runs (id) on delete cascade,
    step text not null,
    kind text not null,
    target text not null,
    timeout_at timestamptz,
    primary key (run_id, step),
    constraint waits_kind_valid check (kind in ('event', 'run'))
);
create index waits_target on waits (target, kind);

-- Records the outcome of a wait as a step of the waiting run, and forgets the wait.
create function record_wait(
    p_run_id text, p_step text, p_kind text, p_output jsonb, p_position integer
) returns void
language plpgsql
set search_path from current
as $$
begin
    insert into steps (run_id, name, seq, position, kind, status, output, started_at)
    values (p_run_id, p_step, nextval('step_seq'), p_position, p_kind, 'completed', p_output,
            now())
    on conflict do nothing;
    delete from waits w where w.run_id = p_run_id and w.step = p_step;
    update runs r set takeovers = 0 where r.id = p_run_id and r.takeovers > 0;
end
$$;

-- Takes the next event of p_event for the run held at p_epoch: 'received' with its payload
-- (consumed, and recorded as step p_step), 'timeout' once the wait's deadline passed (the
-- deadline is written the first time the wait is reached: p_timeout seconds from then; null
-- waits forever), else 'waiting' (the wait is registered; park the run).
create function wait_for_event(
    p_run_id text, p_epoch bigint, p_step text, p_event text,
    p_timeout double precision default null, p_position integer default null
) returns table (outcome text, payload jsonb)
language plpgsql
set search_path from current
as $$
declare
    v_event events;
    v_timeout_at timestamptz;
begin
    perform check_name('wait name', p_step);
    perform check_name('event name', p_event);
    perform lock_held_run(p_run_id, p_epoch, array['running']);
    select s.output -> 'payload' into payload from steps s
    where s.run_id = p_run_id and s.name = p_step and s.output ? 'payload';
    if found then
        outcome := 'received';
        return next;
        return;
    end if;
    select * into v_event from events e
    where e.run_id = p_run_id and e.name = p_event and e.consumed_by is null
    order by e.seq
    limit 1;
    if found then
        update events e set consumed_by = p_step
        where e.run_id = p_run_id and e.seq = v_event.seq;
        perform record_wait(p_run_id, p_step, 'event',
                            jsonb_build_object('payload', v_event.payload), p_position);
        outcome := 'received';
        payload := v_event.payload;
        return next;
        return;
    end if;
    insert into waits (run_id, step, kind, target, timeout_at)
    values (p_run_id, p_step, 'event', p_event, now() + make_interval(secs => p_timeout))
    on conflict do nothing;
    select w.timeout_at into v_timeout_at from waits w
    where w.run_id = p_run_id and w.step = p_step;
    if v_timeout_at <= now() then
        perform record_wait(p_run_id, p_step, 'event', jsonb_build_object('timeout', true),
                            p_position);
        outcome := 'timeout';
    else
        outcome := 'waiting';
    end if;
    return next;
end
$$;

-- The outcome of run p_target for the run held at p_epoch: 'finished' with its status,
-- output and error (recorded as step p_step), or 'waiting' (the wait is registered; park).
create function wait_for_run(
    p_run_id text, p_epoch bigint, p_step text, p_target text, p_position integer default null
) returns table (outcome text, status text, output jsonb, error jsonb)
language plpgsql
set search_path from current
as $$
declare
    v_target runs;
    v_recorded jsonb;
begin
    perform check_name('wait name', p_step);
    perform lock_held_run(p_run_id, p_epoch, array['running']);
    select s.output into v_recorded from steps s
    where s.run_id = p_run_id and s.name = p_step;
    if not found then
        select * into v_target from runs r where r.id = p_target;
        if not found then
            raise exception 'run % not found', p_target using errcode = 'WF002';
        end if;
        if v_target.status not in ('completed', 'dead_letter', 'cancelled') then
            insert into waits (run_id, step, kind, target)
            values (p_run_id, p_step, 'run', p_target)
            on conflict do nothing;
            outcome := 'waiting';
            return next;
            return;
        end if;
        v_recorded := jsonb_build_object('status', v_target.status, 'output', v_target.output,
                                         'error', v_target.error);
        perform record_wait(p_run_id, p_step, 'run', v_recorded, p_position);
    end if;
    outcome := 'finished';
    status := v_recorded ->> 'status';
    output := v_recorded -> 'output';
    error := v_recorded -> 'error';
    return next;
end
$$;

-- Releases a run whose body stopped at waits (p_steps, the waits this execution reached;
-- others are forgotten): due now if one of them is already satisfied (an event arrived or a
-- run finished since it was registered), else at the earliest timeout, else never (until a
-- waker makes it due; scheduled_for shows 9999-12-31 meanwhile). Returns when it is due, null
-- for never.
create function park(p_run_id text, p_epoch bigint, p_steps text[]) returns timestamptz
language plpgsql
set search_path from current
as $$
declare
    v_due timestamptz;
begin
    perform lock_held_run(p_run_id, p_epoch, array['running']);
    delete from waits w where w.run_id = p_run_id and w.step <> all(p_steps);
    if exists (
        select from waits w
        where w.run_id = p_run_id
          and (w.timeout_at <= now()
               or (w.kind = 'event' and exists (
                       select from events e
                       where e.run_id = p_run_id and e.name = w.target
                         and e.consumed_by is null))
               or (w.kind = 'run' and exists (
                       select from runs t
                       where t.id = w.target
                         and t.status in ('completed', 'dead_letter', 'cancelled'))))) then
        v_due := now();
    else
        -- "never" is the last day clients can read ('infinity' would break every reader)
        select coalesce(min(w.timeout_at), timestamptz '9999-12-31 00:00:00+00') into v_due
        from waits w
        where w.run_id = p_run_id;
    end if;
    perform release_held_run(p_run_id, v_due);
    return nullif(v_due, timestamptz '9999-12-31 00:00:00+00');
end
$$;

-- Makes parked runs due now and wakes workers: the ones waiting for one of p_run_ids to
-- finish or, with p_event, those of p_run_ids waiting for an event of that name.
create function wake_waiters(p_run_ids text[], p_event text default null) returns void
language plpgsql
set search_path from current
as $$
declare
    v_queues text[];
begin
    with woken as (
        update runs r set scheduled_for = now()
        from (select distinct w.run_id from waits w
              where (p_event is null and w.kind = 'run' and w.target = any(p_run_ids))
                 or (p_event is not null and w.kind = 'event' and w.target = p_event
                     and w.run_id = any(p_run_ids))) w
        where r.id = w.run_id and r.status = 'pending' and r.scheduled_for > now()
        returning r.queue
    )
    select array_agg(distinct woken.queue) into v_queues from woken;
    perform pg_notify(wakeup_channel(), q) from unnest(v_queues) q;
end
$$;

-- The NOTIFY channel on which a run's id is sent when it finishes (Client.wait listens).
create function finished_channel() returns text
language plpgsql stable
set search_path from current
as $$
declare
    v_channel text := current_schema() || '_finished';
begin
    if octet_length(v_channel) > 63 then
        v_channel := 'flowly_finished_' || md5(current_schema());
    end if;
    return v_channel;
end
$$;

-- After a run finished: wakes the runs waiting for it and announces it on finished_channel().
-- A trigger of its own beside 0004's counting one, with the same kind of when clause: updates
-- that finish nothing fire neither.
create function wake_on_finish() returns trigger
language plpgsql
set search_path from current
as $$
begin
    if exists (select from waits w where w.target = new.id and w.kind = 'run') then
        perform wake_waiters(array[new.id]);
    end if;
    perform pg_notify(finished_channel(), new.id);
    return null;
end
$$;

create trigger runs_wake_on_finish after update of status on runs
    for each row
    when (old.status is distinct from new.status
          and new.status in ('completed', 'dead_letter', 'cancelled'))
    execute function wake_on_finish();

-- Sends an event to a run: the oldest unconsumed event of a name is what the run's next
-- wait_for_event of that name receives, whether the wait comes before or after it. A run
-- parked on such a wait becomes due now. Returns the event's sequence number. Raises WF002
-- for an unknown run, WF004 for a finished one.
create function send_event(run_id text, name text, payload jsonb default 'null')
returns bigint
language plpgsql
set search_path from current
as $$
declare
    v_status text;
    v_seq bigint;
begin
    perform check_name('event name', send_event.name);
    select r.status into v_status from runs r where r.id = send_event.run_id;
    if not found then
        raise exception 'run % not found', send_event.run_id using errcode = 'WF002';
    end if;
    if v_status in ('completed', 'dead_letter', 'cancelled') then
        raise exception 'run % is %: it takes no more events', send_event.run_id, v_status
            using errcode = 'WF004';
    end if;
    insert into events (run_id, name, payload)
    values (send_event.run_id, send_event.name, coalesce(send_event.payload, 'null'))
    returning seq into v_seq;
    perform wake_waiters(array[send_event.run_id], send_event.name);
    return v_seq;
end
$$;
