-- 0033_cancels_that_end: a cancel of a family that keeps growing ends within its lock timeout.
--
-- cancel (0026) locks the run and its unfinished family in id order, reads the family again,
-- and when it grew meanwhile gives the locks back and starts over. A large family whose
-- running members keep starting children grew within every pass, so the cancel looped for as
-- long as children came (a test held it for over two minutes; a CI run on a busy machine
-- lost a cancel of a small such family for over 20 s). It now stops starting over once it has
-- tried for its lock timeout, and raises WF005 (busy: try again), as when a lock waits that
-- long. Lock order as in 0026.

-- cancel as in 0026, its passes bounded by its lock timeout.
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
            exit when family_to_cancel(cancel.run_id) <@ v_family;
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
