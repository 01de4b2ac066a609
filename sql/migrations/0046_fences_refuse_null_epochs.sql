-- 0046_fences_refuse_null_epochs: a fenced write with no fencing token (a NULL epoch) is
-- refused as a stale lease.
--
-- check_fence compared the run's epoch with `<>`, which is NULL, not true, for a NULL token:
-- sleep, fail_run, fail_step, park, wait_for_event and begin_transaction_step called by hand
-- with a NULL epoch went through and released or ended a run a worker held.

-- check_fence as in 0037, a NULL token (or a run without an epoch) fenced out.
create or replace function check_fence(
    p_run_id text, p_epoch bigint, p_statuses text[], p_run runs, p_locked boolean
) returns runs
language plpgsql
set search_path from current
as $$
begin
    if not p_locked then
        if exists (select from runs r where r.id = p_run_id) then
            raise exception 'run % is busy: another transaction holds its row; try again',
                p_run_id using errcode = 'WF005';
        end if;
        raise exception 'run % not found', p_run_id using errcode = 'WF002';
    end if;
    if p_epoch is null or p_run.lease_epoch is distinct from p_epoch
       or p_run.status <> all(p_statuses) then
        raise exception 'lease lost on run %: fencing token % is stale (run is % at epoch %)',
            p_run_id, coalesce(p_epoch::text, 'null'), p_run.status, p_run.lease_epoch
            using errcode = 'WF001';
    end if;
    if p_run.timeout_at < now() and p_run.status <> 'compensating' then
        raise exception 'lease lost on run %: its timeout ended at %', p_run_id,
            p_run.timeout_at using errcode = 'WF001';
    end if;
    return p_run;
end
$$;
