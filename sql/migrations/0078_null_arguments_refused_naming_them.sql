-- 0078_null_arguments_refused_naming_them: a SQL NULL given for any argument of a function
-- users call by hand does what that argument's default does, or is refused as WF003 naming
-- the argument (tests/test_sql_null_arguments.py calls each with each argument NULL).
--
-- Before this, a NULL:
-- - cancel(NULL) and retry_dead_letter(NULL) answered WF002 "run <NULL> not found", as for
--   a run that is gone (send_event had this until 0075); so did start(parent_run_id => NULL)
--   with a parent_lease_epoch, from the lock of the parent's fence.
-- - unschedule(NULL) returned false, as if there were no such schedule; pause_schedule(NULL)
--   and resume_schedule(NULL) said "no schedule named <NULL>".
-- - tick_schedules(NULL) fired nothing and returned no row: its batch was read as a limit
--   of greatest(NULL, 0) = 0, so a NULL given by a caller's scheduler skipped every due
--   schedule silently. Its default is 100.
-- - a NULL timezone of schedule and cron_next was refused as "time zone must be ...", and a
--   NULL key_columns of trigger_run_id as "the key column list must ...": WF003, but naming
--   neither argument as it is spelt.
-- Each now raises WF003 "<argument> must not be null" (or, for a timezone or key_columns,
-- names the argument in the message it had). What a NULL already did right stays: start's
-- NULL input, run_id, queue, priority, scheduled_for, concurrency_key and timeout, schedule's
-- NULL input, queue and priority, and send_event's NULL payload act as their defaults; every
-- other NULL was already refused naming its argument. Signatures, lock orders and settings
-- are unchanged.

-- cancel as in 0071, a NULL run_id refused (WF003) before the family is looked for. It
-- moves a run and its unfinished descendants to cancelled; lock order as in 0071: the
-- family, for update, in id order.
create or replace function cancel(run_id text) returns text
language plpgsql
set search_path from current
set lock_timeout = '5s'
as $$
declare
    v_family text[];
    v_status text;
    v_began timestamptz := clock_timestamp();
begin
    if cancel.run_id is null then
        raise exception 'run_id must not be null' using errcode = 'WF003';
    end if;
    loop
        v_family := family_to_cancel(cancel.run_id);
        begin
            perform from runs r where r.id = any(v_family) order by r.id for update;
            exit when not exists (select unnest(family_to_cancel(cancel.run_id))
                                  except
                                  select unnest(v_family));
            -- the family grew: give these locks back, and take them all again in id order
            raise exception using errcode = 'WF0FG';
        exception
            when sqlstate 'WF0FG' then
                if clock_timestamp() - v_began > current_setting('lock_timeout')::interval then
                    raise exception 'run % is busy: the runs it started kept starting runs'
                        ' for over %; try again', cancel.run_id,
                        current_setting('lock_timeout') using errcode = 'WF005';
                end if;
        end;
    end loop;
    select r.status into v_status from runs r where r.id = cancel.run_id;
    if not found then
        raise exception 'run % not found', cancel.run_id using errcode = 'WF002';
    end if;
    if v_status not in ('pending', 'running', 'compensating', 'cancelled') then
        return v_status;
    end if;
    -- the time of the cancel, not of its transaction's start: it may have waited for a step
    -- of the run, which must not seem to finish after its run
    update runs r
    set status = 'cancelled', finished_at = clock_timestamp(), locked_by = null,
        locked_until = null,
        lease_epoch = r.lease_epoch + 1,
        compensation_ok = case when r.status = 'compensating' then false
                               else r.compensation_ok end
    where r.id = any(v_family) and r.status in ('pending', 'running', 'compensating');
    return 'cancelled';
exception
    when lock_not_available then
        raise exception 'run % is busy: another transaction has held its row, or the row of'
            ' a run it started, for over %; try again', cancel.run_id,
            current_setting('lock_timeout') using errcode = 'WF005';
end
$$;

-- retry_dead_letter as in 0071, a NULL run_id refused (WF003) before the run is locked
-- (the lock moved from the declaration into the body for it). It moves a dead-lettered run
-- back to pending as a new generation; lock order as in 0071: the run, for update, then its
-- ancestors up to the nearest cancelled one, key share, in id order.
create or replace function retry_dead_letter(run_id text) returns text
language plpgsql
set search_path from current
set lock_timeout = '5s'
as $$
declare
    v_run runs;
    v_first_rerun integer;
    v_ancestors text[];
    v_cancelled text;
begin
    if retry_dead_letter.run_id is null then
        raise exception 'run_id must not be null' using errcode = 'WF003';
    end if;
    v_run := lock_run_for_operator(retry_dead_letter.run_id);
    if v_run.status <> 'dead_letter' then
        raise exception 'run % is %, only a dead_letter run can be retried',
            v_run.id, v_run.status using errcode = 'WF004';
    end if;
    -- key-share locked: a cancel in flight of any of them ends first
    v_ancestors := ancestors_to_cancelled(v_run.id);
    perform from runs r where r.id = any(v_ancestors) order by r.id for key share;
    v_cancelled := first_cancelled(v_ancestors);
    if v_cancelled is not null then
        raise exception 'run % cannot be retried: its % run % was cancelled', v_run.id,
            case when v_cancelled = v_run.parent_run_id then 'parent' else 'ancestor' end,
            v_cancelled using errcode = 'WF004';
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
        raise exception 'run % is busy: another transaction has held its row, or the row'
            ' of a run above it, for over %; try again', retry_dead_letter.run_id,
            current_setting('lock_timeout') using errcode = 'WF005';
end
$$;

-- start as in 0075, a NULL parent_run_id with a parent_lease_epoch refused (WF003) rather
-- than looked up as a parent not found (WF002). It writes a pending run, or one claimed by an
-- idle worker in this transaction; lock order as in 0075.
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
    v_input jsonb := coalesce(start.input, 'null');
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
        if start.parent_lease_epoch is not null and start.parent_run_id is null then
            raise exception 'parent_run_id must not be null when parent_lease_epoch is given'
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
    if v_due <= now() and pg_column_size(v_input) < 7900 then
        if hand_off(v_id, start.workflow, v_queue, v_input,
                    coalesce(start.priority, 0), v_due, start.concurrency_key,
                    start.max_attempts, start.timeout, start.parent_run_id) then
            v_started := v_id;
        end if;
    end if;
    if v_started is null then
        v_started := insert_run(v_id, start.workflow, v_queue, v_input,
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

-- unschedule as in 0006, a NULL name refused (WF003) rather than answered false. It
-- deletes a schedule; its runs stay.
create or replace function unschedule(name text) returns boolean
language plpgsql
set search_path from current
as $$
begin
    if unschedule.name is null then
        raise exception 'name must not be null' using errcode = 'WF003';
    end if;
    delete from schedules s where s.name = unschedule.name;
    return found;
end
$$;

-- pause_schedule as in 0006, a NULL name refused as such (WF003). It pauses a schedule:
-- no tick fires it until resume_schedule.
create or replace function pause_schedule(name text) returns schedules
language plpgsql
set search_path from current
as $$
declare
    v_row schedules;
begin
    if pause_schedule.name is null then
        raise exception 'name must not be null' using errcode = 'WF003';
    end if;
    update schedules s set paused = true, updated_at = now()
    where s.name = pause_schedule.name
    returning * into v_row;
    if not found then
        raise exception 'no schedule named %', pause_schedule.name using errcode = 'WF003';
    end if;
    return v_row;
end
$$;

-- resume_schedule as in 0006, a NULL name refused as such (WF003). It resumes a paused
-- schedule at its next fire time from now.
create or replace function resume_schedule(name text) returns schedules
language plpgsql
set search_path from current
as $$
declare
    v_row schedules;
begin
    if resume_schedule.name is null then
        raise exception 'name must not be null' using errcode = 'WF003';
    end if;
    update schedules s
    set paused = false, updated_at = now(),
        next_fire_at = case when s.paused then cron_next(s.cron, now(), s.timezone)
                            else s.next_fire_at end
    where s.name = resume_schedule.name
    returning * into v_row;
    if not found then
        raise exception 'no schedule named %', resume_schedule.name using errcode = 'WF003';
    end if;
    return v_row;
end
$$;

-- cron_use_zone as in 0006, a NULL or empty zone refused naming timezone, the argument of
-- schedule and cron_next that hands it in. It sets the calling function's TimeZone and
-- writes nothing.
create or replace function cron_use_zone(p_zone text) returns text
language plpgsql
set search_path from current
as $$
declare
    v_name text;
begin
    if p_zone is null or p_zone = '' then
        raise exception 'timezone must be an IANA time zone name such as Europe/Berlin, got %',
            coalesce('"' || p_zone || '"', 'null') using errcode = 'WF003';
    end if;
    begin
        perform set_config('TimeZone', p_zone, true);
    exception when invalid_parameter_value then
        raise exception 'unknown time zone "%": expected an IANA zone name such as'
            ' Europe/Berlin', p_zone using errcode = 'WF003';
    end;
    v_name := current_setting('TimeZone');
    -- a POSIX string comes back in capitals with an offset; a few zones look alike (EST5EDT)
    if v_name !~ '[a-z]' and v_name ~ '[0-9<]'
            and not exists (select from pg_timezone_names z where z.name = v_name) then
        raise exception 'unknown time zone "%": expected an IANA zone name such as'
            ' Europe/Berlin', p_zone using errcode = 'WF003';
    end if;
    return v_name;
end
$$;

-- tick_schedules as in 0039, a NULL batch refused (WF003) rather than read as a batch of
-- none. It fires the due schedules, starting their runs; lock order as in 0006: a schedules
-- row (skip locked), then the runs start inserts.
create or replace function tick_schedules(batch integer default 100)
returns table (schedule text, fire_at timestamptz, run_id text, outcome text)
language plpgsql
set search_path from current
as $$
declare
    v_row schedules;
    v_slot timestamptz;
    v_late boolean;
    v_id text;
    v_outcome text;
    v_fires integer;
    v_message text;
    v_slots timestamptz[];
    v_ids text[];
    v_outcomes text[];
begin
    if tick_schedules.batch is null then
        raise exception 'batch must not be null' using errcode = 'WF003';
    end if;
    for v_row in
        select * from schedules s
        where not s.paused and s.next_fire_at <= now()
        -- those whose last tick failed after the others: they may fail again
        order by s.last_error is not null, s.next_fire_at
        limit greatest(tick_schedules.batch, 0)
        for update skip locked
    loop
        v_slots := '{}';
        v_ids := '{}';
        v_outcomes := '{}';
        begin
            v_slot := v_row.next_fire_at;
            v_fires := 0;
            while v_slot <= now() and v_fires < 10 loop
                v_fires := v_fires + 1;
                v_late := v_slot < now() - schedule_grace();
                v_id := null;
                if v_late and v_row.missed = 'skip' then
                    v_outcome := 'missed';
                elsif v_row.overlap = 'skip' and exists (
                        select from runs r where r.id = v_row.last_run_id
                          and r.status in ('pending', 'running', 'compensating')) then
                    v_outcome := 'overlap';
                else
                    v_id := schedule_run_id(v_row.name, v_slot);
                    v_outcome := case when exists (select from runs r where r.id = v_id)
                                      then 'already_started'
                                      when v_late then 'caught_up' else 'started' end;
                    perform start(workflow => v_row.workflow, input => v_row.input,
                                  run_id => v_id, queue => v_row.queue,
                                  priority => v_row.priority, scheduled_for => v_slot,
                                  max_attempts => v_row.max_attempts);
                    v_row.last_fire_at := v_slot;
                    v_row.last_run_id := v_id;
                end if;
                v_slots := v_slots || v_slot;
                v_ids := v_ids || v_id;
                v_outcomes := v_outcomes || v_outcome;
                v_slot := cron_next(v_row.cron,
                                    case when v_late then now() - schedule_grace() else v_slot end,
                                    v_row.timezone);
            end loop;
            update schedules s
            set next_fire_at = v_slot, last_fire_at = v_row.last_fire_at,
                last_run_id = v_row.last_run_id, last_error = null
            where s.name = v_row.name;
        exception when others then
            get stacked diagnostics v_message = message_text;
            update schedules s set last_error = v_message where s.name = v_row.name;
            v_slots := array[v_row.next_fire_at];
            v_ids := array[null];
            v_outcomes := array['error'];
        end;
        return query select v_row.name, u.slot, u.id, u.outcome
                     from unnest(v_slots, v_ids, v_outcomes) as u (slot, id, outcome);
    end loop;
end
$$;

-- trigger_key_columns as in 0007, a NULL or empty list refused naming key_columns, the
-- argument of trigger_run_id and start_trigger that hands it in. It reads a key column list
-- into column names and writes nothing.
create or replace function trigger_key_columns(p_list text) returns text[]
language plpgsql immutable
set search_path from current
as $$
declare
    v_columns text[] := '{}';
    v_item text;
    v_column text;
begin
    if p_list ~ '^[a-z_][a-z0-9_$]*$' then  -- the common case, one plain name
        return array[p_list];
    end if;
    if p_list is null or btrim(p_list) = '' then
        raise exception 'key_columns must name at least one column, got %',
            coalesce('"' || p_list || '"', 'null') using errcode = 'WF003';
    end if;
    if (p_list || ',') !~ '^((?:[^,"]|"(?:[^"]|"")*")*,)+$' then
        raise exception 'the key column list % has unbalanced double quotes', p_list
            using errcode = 'WF003';
    end if;
    for v_item in
        select btrim(m[1]) from regexp_matches(p_list || ',', '((?:[^,"]|"(?:[^"]|"")*")*),',
                                               'g') m
    loop
        if v_item = '' then
            raise exception 'the key column list % has an empty entry', p_list
                using errcode = 'WF003';
        elsif v_item !~ '^("([^"]|"")+"|[[:alpha:]_][[:alnum:]_$]*)$' then
            raise exception 'the key column list % holds %, which is not a column name:'
                ' quote a name with spaces, commas or capitals ("Order No")', p_list, v_item
                using errcode = 'WF003';
        end if;
        v_column := (parse_ident(v_item))[1];
        if v_column = any(v_columns) then
            raise exception 'the key column list % names column % more than once', p_list,
                v_column using errcode = 'WF003';
        end if;
        v_columns := v_columns || v_column;
    end loop;
    return v_columns;
end
$$;
