-- 0006_schedules: cron schedules, parsed and advanced in PL/pgSQL.
--
-- A schedule (the schedules table) starts a run of its workflow at every fire time of a
-- five-field cron expression in an IANA time zone. cron_next gives the first fire time strictly
-- after a point in time, with the semantics of the cronsim library (which follows Debian cron),
-- daylight saving included:
-- * fields: minute hour day-of-month month day-of-week, each a list of values, ranges and
--   steps (*/n, a-b/n, a/n); JAN-DEC and SUN-SAT names; Sunday is 0 or 7; the macros @hourly,
--   @daily, @midnight, @weekly, @monthly, @yearly, @annually;
-- * when both day fields are restricted (neither starts with '*'), a day matching either fires;
--   when one of them starts with '*', a day must match both;
-- * an expression whose minute and hour fields both name fixed values (neither starts with '*')
--   is matched against the wall clock: a wall time that a spring-forward skips fires at the
--   first valid minute after the gap, one that a fall-back repeats fires once, at its first
--   pass; an expression with '*' in its minute or hour field follows elapsed time (hourly fires
--   at both 01:00s of a fall-back night);
-- * cronsim's first answer lies before `after` when `after` is in the second pass of a
--   repeated hour and the expression names a later wall time of that hour (which fired in the
--   first pass): cron_next, strictly after, takes cronsim's next answer then.
-- cron_next and the functions that convert wall clock times run with the zone as the session's
-- TimeZone (set inside cron_next, restored when it returns), so zone names are IANA names
-- (PostgreSQL's own tz database), never abbreviations: CET has summer time.
--
-- Firing: tick_schedules, which every worker calls about every poll interval, takes the due
-- schedules with skip locked and starts one run per fire time through start(), named
-- "<schedule>@<fire time in UTC>", so racing workers, restarts and manual re-ticks never start
-- a fire time twice. missed ('skip' or 'run_once') says what a tick does with fire times more
-- than schedule_grace() old (the workers were down); overlap => 'skip' skips a fire time while
-- the schedule's previous run is unfinished.
--
-- SQLSTATEs: WF003 for a bad expression (the message names the field), an unknown time zone or
-- any other bad argument, and for a schedule name that does not exist.
--
-- Lock order: tick_schedules locks a schedules row (skip locked), then start() inserts runs;
-- schedule, pause_schedule, resume_schedule and unschedule lock only their schedules row.

-- A parsed cron expression: one bit per allowed value of each field.
create type cron_spec as (
    minutes bigint,
    hours bigint,
    days bigint,
    months bigint,
    weekdays bigint,
    -- the minute, when the minute field allows exactly one
    only_minute integer,
    -- a day must match both day fields (one of them starts with '*'), else either
    day_and boolean,
    -- minute and hour fields are both fixed: matched on the wall clock, with DST fix-ups
    wall_clock boolean
);

-- The number a cron value stands for in field p_field (0 minute, 1 hour, 2 day-of-month,
-- 3 month, 4 day-of-week): digits in the field's range, or a month or weekday name.
create function cron_value(p_field integer, p_text text, p_cron text) returns integer
language plpgsql immutable
set search_path from current
as $$
declare
    v_names text[] := case p_field
        when 3 then array['JAN', 'FEB', 'MAR', 'APR', 'MAY', 'JUN', 'JUL', 'AUG', 'SEP', 'OCT',
                          'NOV', 'DEC']
        when 4 then array['SUN', 'MON', 'TUE', 'WED', 'THU', 'FRI', 'SAT'] end;
    v_low integer := (array[0, 0, 1, 1, 0])[p_field + 1];
    v_high integer := (array[59, 23, 31, 12, 7])[p_field + 1];
    v_index integer := array_position(v_names, p_text);
begin
    if v_index is not null then
        return v_index - (p_field = 4)::integer;
    end if;
    if p_text ~ '^[0-9]+$' and p_text::numeric between v_low and v_high then
        return p_text::integer;
    end if;
    perform cron_refuse(p_field, p_text, p_cron);
    return null;
end
$$;

-- Raises WF003 for a bad part of field p_field of a cron expression, naming the field.
create function cron_refuse(p_field integer, p_text text, p_cron text) returns void
language plpgsql immutable
set search_path from current
as $$
begin
    raise exception 'bad % "%" in cron expression "%": expected %',
        (array['minute', 'hour', 'day-of-month', 'month', 'day-of-week'])[p_field + 1],
        p_text, p_cron,
        (array['0-59', '0-23', '1-31', '1-12 or JAN-DEC', '0-7 (0 and 7 are Sunday) or SUN-SAT']
        )[p_field + 1] || ' in a value, list (1,5), range (1-5) or step (*/10, 1-30/5)'
        using errcode = 'WF003';
end
$$;

-- The sorted values one field's text allows, parsed the way cronsim parses it: '*', lists,
-- steps (a single start value runs to the field's end), ranges, values. Raises WF003 naming
-- the field.
create function cron_field(p_field integer, p_text text, p_cron text) returns integer[]
language plpgsql immutable
set search_path from current
as $$
declare
    v_low integer := (array[0, 0, 1, 1, 0])[p_field + 1];
    v_high integer := (array[59, 23, 31, 12, 7])[p_field + 1];
    v_values integer[] := '{}';
    v_term text;
    v_step text;
    v_first integer;
    v_last integer;
begin
    if p_text = '*' then
        return array(select generate_series(v_low, v_high));
    end if;
    if strpos(p_text, ',') > 0 then
        foreach v_term in array string_to_array(p_text, ',') loop
            v_values := v_values || cron_field(p_field, v_term, p_cron);
        end loop;
        return array(select distinct v from unnest(v_values) v order by v);
    end if;
    if strpos(p_text, '/') > 0 then
        v_step := substr(p_text, strpos(p_text, '/') + 1);
        if v_step !~ '^[0-9]+$' or v_step::numeric = 0 then
            perform cron_refuse(p_field, p_text, p_cron);
        end if;
        v_values := cron_field(p_field, split_part(p_text, '/', 1), p_cron);
        if cardinality(v_values) = 1 then
            v_values := array(select generate_series(v_values[1], v_high));
        end if;
        return array(select v from unnest(v_values) with ordinality as u (v, i)
                     where (u.i - 1) % least(v_step::numeric, 100) = 0 order by u.i);
    end if;
    if strpos(p_text, '-') > 0 then
        v_first := cron_value(p_field, split_part(p_text, '-', 1), p_cron);
        v_last := cron_value(p_field, substr(p_text, strpos(p_text, '-') + 1), p_cron);
        if v_last < v_first then
            perform cron_refuse(p_field, p_text, p_cron);
        end if;
        return array(select generate_series(v_first, v_last));
    end if;
    return array[cron_value(p_field, p_text, p_cron)];
end
$$;

-- Parses a cron expression (five fields, or a macro such as @daily) into a cron_spec; a bad
-- one raises WF003 naming the field, as cronsim refuses it.
create function cron_parse(p_cron text) returns cron_spec
language plpgsql immutable
set search_path from current
as $$
declare
    v_macros constant text[] := array[
        '@HOURLY', '0 * * * *', '@DAILY', '0 0 * * *', '@MIDNIGHT', '0 0 * * *',
        '@WEEKLY', '0 0 * * 0', '@MONTHLY', '0 0 1 * *', '@YEARLY', '0 0 1 1 *',
        '@ANNUALLY', '0 0 1 1 *'];
    v_parts text[];
    v_fields bigint[] := '{}';
    v_values integer[];
    v_spec cron_spec;
begin
    if p_cron is null then
        raise exception 'cron expression must not be null' using errcode = 'WF003';
    end if;
    v_parts := array(select t from regexp_split_to_table(upper(p_cron), '\s+') t where t <> '');
    if cardinality(v_parts) = 1 and left(v_parts[1], 1) = '@' then
        if array_position(v_macros, v_parts[1]) is null
                or array_position(v_macros, v_parts[1]) % 2 = 0 then
            raise exception 'unknown cron macro "%": expected @hourly, @daily, @midnight,'
                ' @weekly, @monthly, @yearly or @annually', btrim(p_cron) using errcode = 'WF003';
        end if;
        v_parts := regexp_split_to_array(v_macros[array_position(v_macros, v_parts[1]) + 1], ' ');
    end if;
    if cardinality(v_parts) <> 5 then
        raise exception 'cron expression "%" has % fields: expected 5 fields (minute hour'
            ' day-of-month month day-of-week) or a macro such as @daily', p_cron,
            cardinality(v_parts) using errcode = 'WF003';
    end if;
    for v_field in 0..4 loop
        if v_field = 2 and v_parts[3] ~ 'L|W' or v_field = 4 and v_parts[5] ~ '[L#]' then
            perform cron_refuse(v_field, v_parts[v_field + 1], p_cron);
        end if;
        v_values := cron_field(v_field, v_parts[v_field + 1], p_cron);
        v_fields := v_fields || (select bit_or(1::bigint << v) from unnest(v_values) v);
        if v_field = 0 and cardinality(v_values) = 1 then
            v_spec.only_minute := v_values[1];
        end if;
    end loop;
    v_spec.minutes := v_fields[1];
    v_spec.hours := v_fields[2];
    v_spec.days := v_fields[3];
    v_spec.months := v_fields[4];
    v_spec.weekdays := v_fields[5];
    v_spec.day_and := left(v_parts[3], 1) = '*' or left(v_parts[5], 1) = '*';
    v_spec.wall_clock := left(v_parts[1], 1) <> '*' and left(v_parts[2], 1) <> '*';
    -- days that no allowed month has, when they must match (cronsim's check)
    v_values := cron_field(2, v_parts[3], p_cron);
    if v_spec.day_and and v_values[1] > 29 and v_values[1] > (
            select max((array[31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31])[m])
            from unnest(cron_field(3, v_parts[4], p_cron)) m) then
        raise exception 'bad day-of-month "%" in cron expression "%": no month it allows has'
            ' that day', v_parts[3], p_cron using errcode = 'WF003';
    end if;
    return v_spec;
end
$$;

-- Makes p_zone the TimeZone of the calling function (whose own SET clause restores the
-- caller's when it returns) and returns the zone's name as the tz database spells it. Refuses
-- with WF003 what is not an IANA zone: unknown names, abbreviations (TimeZone takes none) and
-- POSIX TZ strings such as ABC5 (which TimeZone takes, but are no zone).
create function cron_use_zone(p_zone text) returns text
language plpgsql
set search_path from current
as $$
declare
    v_name text;
begin
    if p_zone is null or p_zone = '' then
        raise exception 'time zone must be an IANA zone name such as Europe/Berlin, got %',
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

-- The instant of wall clock time p_wall in the session's TimeZone, as Python reads an aware
-- datetime with fold p_fold: a time repeated by a fall-back is its first pass (fold false) or
-- its second; a time skipped by a spring-forward takes the offset from before the gap (fold
-- false) or after it. PostgreSQL itself reads the first as the second pass, the second as
-- before the gap.
create function cron_instant(p_wall timestamp, p_fold boolean) returns timestamptz
language plpgsql stable
set search_path from current
as $$
declare
    v_later timestamptz := p_wall::timestamptz;
    v_earlier timestamptz;
begin
    if v_later::timestamp <> p_wall then  -- in a gap
        if not p_fold then
            return v_later;
        end if;
        return (p_wall - (v_later::timestamp - (v_later at time zone 'UTC'))) at time zone 'UTC';
    end if;
    v_earlier := (p_wall - ((v_later - interval '1 day')::timestamp
                            - ((v_later - interval '1 day') at time zone 'UTC')))
                 at time zone 'UTC';
    if not p_fold and v_earlier < v_later and v_earlier::timestamp = p_wall then
        return v_earlier;
    end if;
    return v_later;
end
$$;

-- The wall clock time of p_instant in the session's TimeZone and whether it is the second pass
-- of a repeated time (Python's fold).
create function cron_local(p_instant timestamptz, out wall timestamp, out fold boolean)
language plpgsql stable
set search_path from current
as $$
declare
    v_offset interval;
    v_before interval;
    v_earlier timestamptz;
begin
    wall := p_instant::timestamp;
    v_offset := wall - (p_instant at time zone 'UTC');
    v_before := (p_instant - interval '1 day')::timestamp
                - ((p_instant - interval '1 day') at time zone 'UTC');
    fold := false;
    if v_before > v_offset then
        v_earlier := (wall - v_before) at time zone 'UTC';
        fold := v_earlier < p_instant and v_earlier::timestamp = wall;
    end if;
end
$$;

-- One tick of cronsim's clock: p_seconds later on the wall clock (p_naive), or in elapsed time
-- seen on the wall clock of the session's TimeZone.
create function cron_tick(
    p_wall timestamp, p_fold boolean, p_seconds integer, p_naive boolean,
    out wall timestamp, out fold boolean
)
language plpgsql stable
set search_path from current
as $$
begin
    if p_naive then
        wall := p_wall + make_interval(secs => p_seconds);
        fold := false;
    else
        select l.wall, l.fold into wall, fold
        from cron_local(cron_instant(p_wall, p_fold) + make_interval(secs => p_seconds)) l;
    end if;
end
$$;

-- Whether a day matches the day-of-month and day-of-week fields (both, or either: day_and).
create function cron_day_matches(p_spec cron_spec, p_day date) returns boolean
language sql immutable
set search_path from current
as $$
    select case when (p_spec).day_and then dom and dow else dom or dow end
    from (select ((p_spec).days >> extract(day from p_day)::integer) & 1 = 1 as dom,
                 ((p_spec).weekdays >> extract(isodow from p_day)::integer) & 1 = 1
                 or ((p_spec).weekdays >> (extract(isodow from p_day)::integer % 7)) & 1 = 1
                 as dow) d
$$;

-- The first fire time of cron expression `cron` in `timezone` strictly after `after`: cronsim's
-- algorithm (advance month, day, hour, minute, second until all match; ticks on the wall clock
-- for fixed minute and hour, in elapsed time otherwise; a wall time in a gap moves to the first
-- valid minute after it), step for step. Null when nothing fires within 50 years. A bad
-- expression or unknown zone raises WF003 naming what is wrong.
create function cron_next(cron text, after timestamptz, timezone text default 'UTC')
returns timestamptz
language plpgsql stable
set search_path from current
set timezone = 'UTC'
as $$
declare
    v_spec cron_spec := cron_parse(cron_next.cron);
    v_zone text := cron_use_zone(cron_next.timezone);
    v_naive boolean;
    v_wall timestamp;
    v_fold boolean := false;
    v_day date;
    v_start_year integer;
    v_result timestamptz;
begin
    if cron_next.after is null or not isfinite(cron_next.after) then
        raise exception 'after must be a finite time, got %',
            coalesce(cron_next.after::text, 'null') using errcode = 'WF003';
    end if;
    v_naive := v_spec.wall_clock or v_zone = 'UTC';
    if v_naive then
        v_wall := date_trunc('second', cron_next.after::timestamp);
    else
        select date_trunc('second', l.wall), l.fold into v_wall, v_fold
        from cron_local(cron_next.after) l;
    end if;
    loop
        select t.wall, t.fold into v_wall, v_fold from cron_tick(v_wall, v_fold, 1, v_naive) t;
        v_start_year := extract(year from v_wall);
        <<advance>>
        loop
            if (v_spec.months >> extract(month from v_wall)::integer) & 1 = 0 then
                v_day := v_wall::date;
                loop
                    v_day := (date_trunc('month', v_day) + interval '1 month')::date;
                    exit when (v_spec.months >> extract(month from v_day)::integer) & 1 = 1;
                end loop;
                v_wall := v_day::timestamp;
                v_fold := false;
            end if;
            if extract(year from v_wall) > v_start_year + 50 then
                return null;
            end if;
            v_day := v_wall::date;
            if not cron_day_matches(v_spec, v_day) then
                loop
                    v_day := v_day + 1;
                    exit when extract(day from v_day) = 1 or cron_day_matches(v_spec, v_day);
                end loop;
                v_wall := v_day::timestamp;
                v_fold := false;
                continue advance;
            end if;
            if (v_spec.hours >> extract(hour from v_wall)::integer) & 1 = 0 then
                v_wall := date_trunc('hour', v_wall);
                loop
                    select t.wall, t.fold into v_wall, v_fold
                    from cron_tick(v_wall, v_fold, 3600, v_naive) t;
                    exit when (v_spec.hours >> extract(hour from v_wall)::integer) & 1 = 1
                        or extract(hour from v_wall) = 0;
                end loop;
                continue advance;
            end if;
            if (v_spec.minutes >> extract(minute from v_wall)::integer) & 1 = 0 then
                v_wall := date_trunc('minute', v_wall);
                if v_spec.only_minute is not null then
                    select t.wall, t.fold into v_wall, v_fold
                    from cron_tick(v_wall, v_fold,
                                   ((v_spec.only_minute - extract(minute from v_wall)::integer
                                     + 60) % 60) * 60, v_naive) t;
                end if;
                while (v_spec.minutes >> extract(minute from v_wall)::integer) & 1 = 0 loop
                    select t.wall, t.fold into v_wall, v_fold
                    from cron_tick(v_wall, v_fold, 60, v_naive) t;
                    exit when extract(minute from v_wall) = 0;
                end loop;
                continue advance;
            end if;
            if extract(second from v_wall) <> 0 then
                select t.wall, t.fold into v_wall, v_fold
                from cron_tick(v_wall, v_fold, 60 - extract(second from v_wall)::integer,
                               v_naive) t;
                while extract(second from v_wall) <> 0 loop
                    select t.wall, t.fold into v_wall, v_fold
                    from cron_tick(v_wall, v_fold, 1, v_naive) t;
                end loop;
                continue advance;
            end if;
            exit advance;
        end loop;
        if v_spec.wall_clock then
            -- a wall time skipped by a spring-forward: the first valid minute after the gap
            while v_wall::timestamptz::timestamp <> v_wall loop
                v_wall := v_wall + interval '1 minute';
            end loop;
            v_fold := false;
        end if;
        v_result := cron_instant(v_wall, v_fold);
        exit when v_result > cron_next.after;
    end loop;
    return v_result;
end
$$;

-- Schedules: a workflow to start at every fire time of a cron expression in a time zone.
create table schedules (
    name text primary key,
    cron text not null,
    timezone text not null default 'UTC',
    workflow text not null,
    input jsonb not null default 'null',
    queue text not null default 'default',
    priority integer not null default 0,
    max_attempts integer not null default 3,
    -- fire times more than schedule_grace() old at a tick: skipped, or one run for them all
    missed text not null default 'skip',
    -- 'skip': no run for a fire time while the previous run of this schedule is unfinished
    overlap text not null default 'allow',
    paused boolean not null default false,
    -- the next fire time to handle (null: the expression fires no more)
    next_fire_at timestamptz,
    last_fire_at timestamptz,
    last_run_id text,
    -- why the last tick could not handle this schedule (it tries again at the next tick)
    last_error text,
    created_at timestamptz not null default now(),
    updated_at timestamptz not null default now(),
    constraint schedules_missed_valid check (missed in ('skip', 'run_once')),
    constraint schedules_overlap_valid check (overlap in ('allow', 'skip'))
);

-- The ticks' only access path: due schedules that are not paused, soonest first.
create index schedules_due on schedules (next_fire_at) where not paused;

-- How late a fire time may be handled and still count as on time; older ones were missed.
create function schedule_grace() returns interval
language sql immutable
set search_path from current
as $$
    select interval '1 minute'
$$;

-- The id of the run a schedule starts for a fire time: the same for every worker, every
-- restart and every re-tick, so start() returns the run already there instead of a second one.
create function schedule_run_id(p_name text, p_fire_at timestamptz) returns text
language sql immutable
set search_path from current
as $$
    select p_name || '@' || to_char(p_fire_at at time zone 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"')
$$;

-- Creates or replaces (by name) a schedule: a run of `workflow` with `input` at every fire time
-- of `cron` in `timezone`. A bad expression or zone raises WF003 naming it. Declaring a
-- schedule again unchanged keeps its next fire time (deploy scripts may run it every time); a
-- new expression or zone moves it to the next fire time from now. A paused schedule stays
-- paused. Returns the schedule.
create function schedule(
    name text,
    cron text,
    workflow text,
    input jsonb default 'null',
    timezone text default 'UTC',
    queue text default 'default',
    priority integer default 0,
    missed text default 'skip',
    overlap text default 'allow',
    max_attempts integer default 3
) returns schedules
language plpgsql
set search_path from current
set timezone = 'UTC'
as $$
declare
    v_zone text;
    v_next timestamptz;
    v_row schedules;
begin
    perform check_name('name', schedule.name);
    if octet_length(schedule.name) > max_name_bytes() - 21 then
        raise exception 'name is % bytes long; a schedule name may have % bytes (its runs are'
            ' named <name>@<fire time>)', octet_length(schedule.name), max_name_bytes() - 21
            using errcode = 'WF003';
    end if;
    perform check_name('workflow', schedule.workflow);
    perform check_name('queue', coalesce(schedule.queue, 'default'));
    if schedule.missed is null or schedule.missed not in ('skip', 'run_once') then
        raise exception 'missed must be skip or run_once, got %',
            coalesce(schedule.missed, 'null') using errcode = 'WF003';
    end if;
    if schedule.overlap is null or schedule.overlap not in ('allow', 'skip') then
        raise exception 'overlap must be allow or skip, got %',
            coalesce(schedule.overlap, 'null') using errcode = 'WF003';
    end if;
    if schedule.max_attempts is null or schedule.max_attempts < 1 then
        raise exception 'max_attempts must be at least 1, got %', schedule.max_attempts
            using errcode = 'WF003';
    end if;
    v_next := cron_next(schedule.cron, now(), schedule.timezone);
    v_zone := cron_use_zone(schedule.timezone);
    insert into schedules as s (name, cron, timezone, workflow, input, queue, priority,
                                max_attempts, missed, overlap, next_fire_at)
    values (schedule.name, btrim(schedule.cron), v_zone, schedule.workflow,
            coalesce(schedule.input, 'null'), coalesce(schedule.queue, 'default'),
            coalesce(schedule.priority, 0), schedule.max_attempts, schedule.missed,
            schedule.overlap, v_next)
    on conflict on constraint schedules_pkey do update
    set cron = excluded.cron, timezone = excluded.timezone, workflow = excluded.workflow,
        input = excluded.input, queue = excluded.queue, priority = excluded.priority,
        max_attempts = excluded.max_attempts, missed = excluded.missed,
        overlap = excluded.overlap,
        next_fire_at = case when s.cron = excluded.cron and s.timezone = excluded.timezone
                            then s.next_fire_at else excluded.next_fire_at end,
        updated_at = now()
    returning * into v_row;
    return v_row;
end
$$;

-- Deletes a schedule; its runs stay. Returns whether there was one.
create function unschedule(name text) returns boolean
language plpgsql
set search_path from current
as $$
begin
    delete from schedules s where s.name = unschedule.name;
    return found;
end
$$;

-- Pauses a schedule: no tick fires it until resume_schedule. Raises WF003 for an unknown name.
create function pause_schedule(name text) returns schedules
language plpgsql
set search_path from current
as $$
declare
    v_row schedules;
begin
    update schedules s set paused = true, updated_at = now()
    where s.name = pause_schedule.name
    returning * into v_row;
    if not found then
        raise exception 'no schedule named %', pause_schedule.name using errcode = 'WF003';
    end if;
    return v_row;
end
$$;

-- Resumes a paused schedule at its next fire time from now: the fire times that passed while
-- it was paused are not fired (not even with missed => 'run_once'). Raises WF003 for an
-- unknown name.
create function resume_schedule(name text) returns schedules
language plpgsql
set search_path from current
as $$
declare
    v_row schedules;
begin
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

-- Fires the due schedules (at most `batch` of them, soonest first; each handles at most ten
-- fire times per call): takes each with skip locked, so workers ticking at once share the work
-- and never wait, and for each due fire time starts a run through start() named
-- schedule_run_id(schedule, fire time), so no fire time starts twice. A fire time more than
-- schedule_grace() old is missed: with missed => 'skip' it starts nothing, with 'run_once' it
-- starts one run for all the missed fire times; either way the schedule goes on with the fire
-- times from schedule_grace() ago. With overlap => 'skip', a fire time while the schedule's
-- previous run is unfinished starts nothing. One schedule's failure (its zone vanished from
-- the tz database, say) is recorded in its last_error, and leaves the others firing. Returns
-- one row per fire time handled: outcome started, caught_up (run_once), already_started (its
-- run was there), missed, overlap or error.
create function tick_schedules(batch integer default 100)
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
    for v_row in
        select * from schedules s
        where not s.paused and s.next_fire_at <= now()
        order by s.next_fire_at
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
