-- 0041_fan_in_retries_ask_again: retrying a run that failed because runs it waited for failed
-- asks again for every such failure whose run has been retried since, not only for the last.
--
-- retired_by_retry retired, of the recorded failures of other runs (ChildFailed), only the one
-- with the highest seq. A fan-in (asyncio.gather of waits) records each failure; the one the
-- body raised need not be the last, and the others were replayed: with both runs it waited for
-- retried and completed, the retried parent failed again with the same ChildFailed, although
-- the README says retrying the children first and then the parent lets the parent complete.
-- A recorded failure of a run that has been retried since (it is no longer dead_letter or
-- cancelled) is now asked for again too. A failure of a run that was not retried stays
-- recorded, so a body that caught it takes the same branch. Records made before 0022 do not
-- name their run and keep the old rule.

-- retired_by_retry as in 0015, with the failures of runs retried since.
create or replace function retired_by_retry(p_step steps, p_run runs) returns boolean
language sql stable
set search_path from current
as $$
    select p_step.status = 'failed' or p_step.compensation_status is not null
        or (p_step.kind = 'run' and p_step.output ->> 'status' is distinct from 'completed'
            and p_run.error ->> 'type' = 'ChildFailed'
            and (p_step.seq = (select max(s.seq) from steps s
                               where s.run_id = p_run.id and s.kind = 'run'
                                 and s.output ->> 'status' is distinct from 'completed')
                 or exists (select from runs t
                            where t.id = p_step.output ->> 'run_id'
                              and t.status not in ('dead_letter', 'cancelled'))))
$$;
