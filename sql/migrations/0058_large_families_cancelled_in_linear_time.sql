-- 0058_large_families_cancelled_in_linear_time: cancelling a run with thousands of unfinished
-- descendants takes time in proportion to the family, not to its square.
--
-- After locking the family, cancel (0033) reads it again and starts over if it grew. It
-- compared the two lists with the array operator <@, which looks every member up in the
-- other list one by one: 22,001 runs (a parent, 20,000 children, a chain 2,000 deep) took
-- 2.9 s, nearly all of it in that comparison, with every row of the family locked
-- meanwhile. The lists are compared as sets now (except, hashed). Lock order as in 0026.

-- cancel as in 0033, the family read again compared as a set.
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
    if v_status not in ('pending', 'running', 'compensating') then
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
