-- 0021_cron_search_goes_forward: cron_next no longer cycles for ever near a fall-back.
--
-- Some expressions in zones whose clocks fall back at a time that is not a whole hour
-- (Pacific/Chatham: 03:45 back to 02:45) sent cron_next round a cycle that never ended: the
-- minute search landed in the second pass of the repeated hour, the hour search truncated that
-- to the start of the hour on the wall clock (before the first pass) and ticked to the first
-- pass of the next hour, and the minute search landed in the second pass again. schedule()
-- with such an expression ran until its statement timeout, and a schedule whose next fire time
-- fell there made every tick_schedules time out, holding up the ticks of all schedules.
-- cronsim, which cron_next follows, cycles the same way; the hour search now only takes an
-- hour later in real time than where it started.

-- The first fire time of cron expression `cron` in `timezone` strictly after `after`: cronsim's
-- algorithm (advance month, day, hour, minute, second until all match; ticks on the wall clock
-- for fixed minute and hour, in elapsed time otherwise; a wall time in a gap moves to the first
-- valid minute after it), step for step, except that the search never goes back in real time
-- (where cronsim's cycles for ever). Null when nothing fires within 50 years. A bad
-- expression or unknown zone raises WF003 naming what is wrong.
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
    return v_result;
end
$$;
