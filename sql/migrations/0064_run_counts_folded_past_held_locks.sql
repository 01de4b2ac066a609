-- 0064_run_counts_folded_past_held_locks: another transaction holding run_count_totals no
-- longer costs a worker its leases.
--
-- Each heartbeat of a worker folds the finished-run counters into their totals
-- (fold_run_counts) after it extends the leases, on the same connection. The fold waited for
-- any lock another transaction held on run_count_totals (an operator's `lock table`, an open
-- `select ... for update` of a total): the beat hung until it was cut off (after lease/3, at
-- least 2 s) and the next one went on a new connection, so beats came every 2 s or more,
-- and a lease shorter than that lapsed under a live worker, which took its own runs over and
-- ran their steps again (3 times for a 4 s step under a 1.5 s lease). The fold now gives up
-- after a short wait and leaves the counters to a later beat: run_counts adds the counters
-- not yet folded, so what it shows does not change. Lock order as in 0004: the advisory
-- lock, the counters, then the totals, never waiting long for these.

-- fold_run_counts as in 0004, giving up when the totals are held elsewhere.
create or replace function fold_run_counts() returns void
language plpgsql
set search_path from current
set lock_timeout = '50ms'
as $$
begin
    if not pg_try_advisory_xact_lock(7237142851620390002) then
        return;
    end if;
    begin
        with folded as (
            delete from run_count_deltas d returning d.workflow, d.status, d.delta
        )
        insert into run_count_totals as t (workflow, status, runs)
        select f.workflow, f.status, sum(f.delta) from folded f group by f.workflow, f.status
        on conflict (workflow, status) do update set runs = t.runs + excluded.runs;
        delete from run_count_totals t where t.runs = 0;
    exception when lock_not_available then
        -- the counters stay as they were (the subtransaction is undone), for a later fold
        return;
    end;
end
$$;
