-- 0070_timeouts_counted_in_utc: a run's timeout ends where it ends whatever the session's
-- TimeZone, and start checks that end, not the timeout's length read with a month as 30 days.
--
-- timeout_at was scheduled_for + timeout, and PostgreSQL adds an interval's days and months
-- to a timestamptz as calendar days and months of the session's TimeZone: with the
-- database set to Europe/Berlin (alter database ... set timezone), a timeout of '1 day' from
-- 2027-03-27 12:00 UTC ended 23 hours later, across the change to summer time. What an
-- application sets for its sessions does not reach into flowly, so a timeout is now counted in
-- UTC: (scheduled_for at time zone 'UTC' + timeout) at time zone 'UTC'. Its days are 24 hours
-- and its hours, minutes and seconds what they say, as justify_hours and extract(epoch) read
-- them; its months and years are calendar ones, of UTC ('1 month' from 2027-01-31 ends on
-- 2027-02-28, as PostgreSQL's own rule has it), not the 30 days extract(epoch) makes of a
-- month (and 365.25 of a year, while interval comparison makes 360 of it): a month that is
-- sometimes 31 days is what a caller who wrote one means. The expression costs two fixed-zone
-- conversions; a function-level `set timezone` would have cost a setting saved and restored
-- at every call. Python sends its durations in seconds alone (flowly.db.seconds_interval), so
-- there the rule and PostgreSQL's agree.
--
-- start refused a timeout that was not positive or not shorter than the time from its due
-- time to the year 10000, comparing intervals, which reads a month as 30 days: '1 month' from
-- 9999-12-01 passed and ended at 10000-01-01, which no client reads back (every listing of
-- runs then failed), and '1 mon -29 days' from 2027-02-01 passed as positive and ended a day
-- before the run was due. start now computes where the timeout ends and checks that: after
-- the run is due and before the year 10000, else WF003. A timeout whose parts run millennia
-- in opposite directions ('-5000 years 1830000 days') may pass the first or last time
-- PostgreSQL holds on the way to its end (22008): start computes such an end in a block that
-- catches that, as no end; a plain start takes the cheap way, its months, days and length
-- first seen to be small enough for the way to stay in range.
--
-- retry_dead_letter counts a retried run's timeout from the retry the same way, and ends it
-- no later than the last readable time: from a later start, a timeout that start accepted may
-- end after the year 10000.

-- start as in 0065, its timeout's end counted in UTC and checked where it ends.
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
    v_timeout_end timestamptz;
    v_started text;
    v_parent_status text;
begin
    if start.timeout is not null then
        -- months under 2000 years, days under 700,000 and a length under 10000 years keep
        -- every step of the addition within the years PostgreSQL holds, from a due time
        -- start accepts; any other timeout or due time is added where an overflow is caught
        if start.timeout > interval '0' and start.timeout < interval '10000 years'
           and abs(date_part('year', start.timeout)) < 2000
           and abs(date_part('day', start.timeout)) < 700000
           and v_due >= readable_time_start() and v_due < readable_time_end() then
            v_timeout_end := (v_due at time zone 'UTC' + start.timeout) at time zone 'UTC';
        else
            begin
                v_timeout_end := (v_due at time zone 'UTC' + start.timeout) at time zone 'UTC';
            exception when datetime_field_overflow then
                v_timeout_end := null;
            end;
        end if;
    end if;
    -- a start without a parent whose arguments are all plainly in bounds passes every check
    -- below: most starts are told so by this one expression; any other start goes through
    -- the checks one by one, which name what is wrong
    if (start.parent_run_id is null and start.parent_lease_epoch is null
        and start.parent_step is null
        and octet_length(start.workflow) between 1 and max_name_bytes()
        and octet_length(v_id) between 1 and max_name_bytes()
        and octet_length(v_queue) between 1 and max_name_bytes()
        and (start.concurrency_key is null
             or octet_length(start.concurrency_key) between 1 and max_name_bytes())
        and v_due >= readable_time_start() and v_due < readable_time_end()
        and start.max_attempts >= 1
        and (start.timeout is null
             or (v_timeout_end > v_due and v_timeout_end < readable_time_end()))
       ) is not true then
        perform check_name('workflow', start.workflow);
        perform check_name('run_id', v_id);
        perform check_name('queue', v_queue);
        if start.concurrency_key is not null then
            perform check_name('concurrency_key', start.concurrency_key);
        end if;
        if not isfinite(v_due) or v_due >= readable_time_end() or v_due < readable_time_start()
        then
            raise exception 'scheduled_for must be a finite time between the years 1 and 10000, got %',
                v_due using errcode = 'WF003';
        end if;
        if start.max_attempts is null or start.max_attempts < 1 then
            raise exception 'max_attempts must be at least 1, got %', start.max_attempts
                using errcode = 'WF003';
        end if;
        if start.timeout is not null and (v_timeout_end is null or v_timeout_end <= v_due
                                          or v_timeout_end >= readable_time_end()) then
            raise exception 'timeout must end after scheduled_for and before the year 10000'
                ' (counted in UTC), got % from %, which ends %', start.timeout, v_due,
                coalesce(v_timeout_end::text, 'past the times PostgreSQL holds')
                using errcode = 'WF003';
        end if;
        if start.parent_step is not null and start.parent_lease_epoch is null then
            raise exception 'parent_step needs parent_run_id and parent_lease_epoch'
                using errcode = 'WF003';
        end if;
        if start.parent_run_id is not null and start.parent_lease_epoch is null then
            -- a child started by hand: not under a cancelled run (a cancel in flight ends first)
            v_parent_status := lock_parent_by_hand(start.parent_run_id);
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
    end if;
    -- nested, not one condition: hand_off writes, and only a due run fitting a payload is
    -- handed off
    if v_due <= now() and pg_column_size(start.input) < 7900 then
        if hand_off(v_id, start.workflow, v_queue, coalesce(start.input, 'null'),
                    coalesce(start.priority, 0), v_due, start.concurrency_key,
                    start.max_attempts, start.timeout, start.parent_run_id) then
            v_started := v_id;
        end if;
    end if;
    if v_started is null then
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

-- hand_off as in 0068, the run's timeout_at counted in UTC (see the header).
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

-- insert_run as in 0069, the run's timeout_at counted in UTC (see the header).
create or replace function insert_run(
    p_id text, p_workflow text, p_queue text, p_input jsonb, p_priority integer,
    p_scheduled_for timestamptz, p_concurrency_key text, p_max_attempts integer,
    p_timeout interval, p_parent_run_id text
) returns text
language plpgsql
set search_path from current
as $$
declare
    v_existing text;
    v_timeout_at timestamptz := (p_scheduled_for at time zone 'UTC' + p_timeout) at time zone 'UTC';
begin
    if current_setting('transaction_isolation') <> 'read committed' then
        select r.id into v_existing from runs r
        where r.id = p_id
           or (r.concurrency_key = p_concurrency_key
               and r.status in ('pending', 'running', 'compensating'))
        order by r.id = p_id desc
        limit 1;
        if found then
            return v_existing;
        end if;
        begin
            insert into runs (id, workflow, queue, input, priority, scheduled_for,
                              concurrency_key, max_attempts, timeout, timeout_at, parent_run_id)
            values (p_id, p_workflow, p_queue, p_input, p_priority, p_scheduled_for,
                    p_concurrency_key, p_max_attempts, p_timeout, v_timeout_at,
                    p_parent_run_id);
        exception when unique_violation or serialization_failure then
            raise exception 'flowly.start: run % or the live run of concurrency key % was'
                ' committed after this % transaction took its snapshot, so it cannot see it;'
                ' retry the transaction', p_id, coalesce(p_concurrency_key, '(none)'),
                upper(current_setting('transaction_isolation'))
                using errcode = '40001';
        end;
        if p_scheduled_for <= now() then
            perform pg_notify(wakeup_channel(), p_queue);
        else
            perform announce_run_due_later(p_queue, p_scheduled_for);
        end if;
        return p_id;
    end if;
    -- a concurrency-key winner may finish between our insert and our look-up: then try again
    for v_try in 1..3 loop
        insert into runs (id, workflow, queue, input, priority, scheduled_for, concurrency_key,
                          max_attempts, timeout, timeout_at, parent_run_id)
        values (p_id, p_workflow, p_queue, p_input, p_priority, p_scheduled_for,
                p_concurrency_key, p_max_attempts, p_timeout, v_timeout_at,
                p_parent_run_id)
        on conflict do nothing;
        if found then
            if p_scheduled_for <= now() then
                perform pg_notify(wakeup_channel(), p_queue);
            else
                perform announce_run_due_later(p_queue, p_scheduled_for);
            end if;
            return p_id;
        end if;
        select r.id into v_existing from runs r where r.id = p_id;
        if found then
            return v_existing;
        end if;
        select r.id into v_existing from runs r
        where r.concurrency_key = p_concurrency_key
          and r.status in ('pending', 'running', 'compensating');
        if found then
            return v_existing;
        end if;
    end loop;
    raise exception 'could not start run %: concurrency key % keeps changing hands',
        p_id, p_concurrency_key using errcode = 'WF004';
end
$$;

-- retry_dead_letter as in 0026, the retried run's timeout counted in UTC from the retry and
-- ended by the last readable time (see the header).
create or replace function retry_dead_letter(run_id text) returns text
language plpgsql
set search_path from current
set lock_timeout = '5s'
as $$
declare
    v_run runs := lock_run_for_operator(retry_dead_letter.run_id);
    v_first_rerun integer;
    v_parent_status text;
begin
    if v_run.status <> 'dead_letter' then
        raise exception 'run % is %, only a dead_letter run can be retried',
            v_run.id, v_run.status using errcode = 'WF004';
    end if;
    if v_run.parent_run_id is not null then
        -- key-share locked: a cancel of the parent's family in flight ends first
        select r.status into v_parent_status from runs r
        where r.id = v_run.parent_run_id
        for key share;
        if v_parent_status = 'cancelled' then
            raise exception 'run % cannot be retried: its parent run % was cancelled',
                v_run.id, v_run.parent_run_id using errcode = 'WF004';
        end if;
    end if;
    insert into step_history (run_id, generation, name, kind, seq, position, status, output,
                              error, attempts, started_at, finished_at, compensable,
                              compensation_status, compensation_error, compensated_at)
    select s.run_id, v_run.generation, s.name, s.kind, s.seq, s.position, s.status, s.output,
           s.error, s.attempts, s.started_at, s.finished_at, s.compensable,
           s.compensation_status, s.compensation_error, s.compensated_at
    from steps s
    where s.run_id = v_run.id and retired_by_retry(s, v_run)
    on conflict do nothing;
    select min(s.position) into v_first_rerun from steps s
    where s.run_id = v_run.id
      and retired_by_retry(s, v_run) and s.compensation_status is distinct from 'failed';
    delete from steps s
    where s.run_id = v_run.id
      and retired_by_retry(s, v_run) and s.compensation_status is distinct from 'failed';
    update steps s set compensation_status = null, compensation_error = null, compensated_at = null
    where s.run_id = v_run.id and s.compensation_status is not null;
    delete from timers t where t.run_id = v_run.id and t.position > v_first_rerun;
    begin
        update runs r
        set status = 'pending', attempt = 1, error = null, output = null, compensation_ok = null,
            finished_at = null, scheduled_for = now(),
            timeout_at = case when r.timeout is not null then
                least((now() at time zone 'UTC' + r.timeout) at time zone 'UTC',
                      readable_time_end() - interval '1 microsecond') end,
            generation = r.generation + 1, lease_epoch = r.lease_epoch + 1, takeovers = 0,
            locked_by = null, locked_until = null
        where r.id = v_run.id;
    exception
        when unique_violation then
            raise exception 'run % cannot be retried while run % of concurrency key % is live',
                v_run.id,
                (select r.id from runs r where r.concurrency_key = v_run.concurrency_key
                    and r.status in ('pending', 'running', 'compensating')),
                v_run.concurrency_key
                using errcode = 'WF004';
    end;
    perform pg_notify(wakeup_channel(), v_run.queue);
    return v_run.id;
exception
    when lock_not_available then
        raise exception 'run % is busy: another transaction has held its row, or its'
            ' parent''s, for over %; try again', retry_dead_letter.run_id,
            current_setting('lock_timeout') using errcode = 'WF005';
end
$$;
