-- 0045_cron_steps_over_one_value_ranges: a step over a range of one value ("16-16/6") keeps
-- that value alone, as cronsim and Debian's cron read it.
--
-- cron_field read a step's base as a starting value (running to the field's end, as "16/6"
-- does) whenever it held one value, so "16-16/6" in the day-of-month field fired on the 16th,
-- 22nd and 28th. Only a base written as one value starts such a run now. Found by the
-- property test against cronsim (tests/test_cron.py).

-- cron_field as in 0006, a base written as a range kept as its values.
create or replace function cron_field(p_field integer, p_text text, p_cron text)
returns integer[]
language plpgsql immutable
set search_path from current
as $$
declare
    v_low integer := (array[0, 0, 1, 1, 0])[p_field + 1];
    v_high integer := (array[59, 23, 31, 12, 7])[p_field + 1];
    v_values integer[] := '{}';
    v_term text;
    v_base text;
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
        v_base := split_part(p_text, '/', 1);
        v_step := substr(p_text, strpos(p_text, '/') + 1);
        if v_step !~ '^[0-9]+$' or v_step::numeric = 0 then
            perform cron_refuse(p_field, p_text, p_cron);
        end if;
        v_values := cron_field(p_field, v_base, p_cron);
        if v_base <> '*' and strpos(v_base, '-') = 0 then
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
