-- 0052_cron_next_within_readable_times: cron_next answers only with times clients can read.
--
-- cron_next searched past the year 9999: cron_next('* * * * *', '9999-12-31 23:59:30+00')
-- returned 10000-01-01 00:00, which psycopg (and Python's datetime) cannot read, so
-- Client.cron_next failed with a raw DataError and a schedule's next_fire_at could hold a time
-- no dashboard could list. An `after` before the year 1 (0048's first readable time) found
-- fire times there too. Now a fire time at or past the year 10000 is null, as for an
-- expression that fires no more (a schedule stops there), and an `after` before the year 1
-- is refused with WF003, as a run's times are.

-- cron_next as in 0021, bounded by readable_time_start and readable_time_end.
create or replace function cron_next(cron text, after timestamptz, timezone text default 'UTC')
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
    v_floor timestamptz;
begin
    if cron_next.after is null or not isfinite(cron_next.after)
       or cron_next.after < readable_time_start() then
        raise exception 'after must be a finite time from the year 1, got %',
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
                -- a matching hour counts only later in real time than the time that did not
                -- match: from the second pass of a repeated hour, the start of that hour on
                -- the wall clock lies before the first pass, and the next hour from there
                -- can be the first pass of the hour after, earlier than where the search was
                v_floor := cron_instant(v_wall, v_fold);
                v_wall := date_trunc('hour', v_wall);
                loop
                    select t.wall, t.fold into v_wall, v_fold
                    from cron_tick(v_wall, v_fold, 3600, v_naive) t;
                    exit when extract(hour from v_wall) = 0
                        or (v_spec.hours >> extract(hour from v_wall)::integer) & 1 = 1
                           and (v_naive or cron_instant(v_wall, v_fold) > v_floor);
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
    if v_result >= readable_time_end() then
        return null;
    end if;
    return v_result;
end
$$;
