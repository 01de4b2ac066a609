-- 0049_event_timeouts_asked_again: retrying a run that failed because an event did not come
-- in time waits for that event again.
--
-- A timed-out event wait is recorded like a completed step, so retry_dead_letter kept it and
-- the new generation replayed the timeout: a run dead-lettered by EventTimeout failed again at
-- once however often it was retried, and the event an operator sent after the retry was
-- never read. The last timed-out event wait of a run that ended on EventTimeout is the one
-- the body raised (a later wait would have been recorded after it); it is now retired like a
-- failed step, so the retry waits for the event again with a new timeout. Earlier timeouts
-- stay recorded: a body that caught one takes the same branch.

-- retired_by_retry as in 0041, with the event wait whose timeout ended the run.
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
        or (p_step.kind = 'event' and p_step.output ? 'timeout'
            and p_run.error ->> 'type' = 'EventTimeout'
            and p_step.seq = (select max(s.seq) from steps s
                              where s.run_id = p_run.id and s.kind = 'event'
                                and s.output ? 'timeout'))
$$;
