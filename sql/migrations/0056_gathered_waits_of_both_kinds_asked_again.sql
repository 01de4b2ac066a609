-- 0056_gathered_waits_of_both_kinds_asked_again: retrying a run that failed on an event
-- wait and a wait for another run made at once asks both again.
--
-- 0041 and 0053 retire the failed waits of the kind the run's error names: failed runs
-- waited for when it ended on ChildFailed, timed-out event waits when it ended on
-- EventTimeout. A body that gathered an event wait and a wait for another run, both failed
-- by its replay, records both outcomes and raises the one gather met first: the retry asked
-- that kind again and replayed the other failure, so the run failed again at once, however
-- the operator had mended the other run or sent the event.
--
-- The wait that ended the run is the last failed one of the kind its error names (a later
-- one would have been recorded after it). Every failed wait of either kind recorded after
-- that one was first reached was pending beside it and is retired with it, as 0053 does for
-- event waits alone; a failure the body caught before it reached that wait stays recorded,
-- so the body takes the same branch. 0041's rule for runs waited for that were retried since
-- is kept as it was.
--
-- The wait that ended the run is found through a partial index of the failed waits, not by
-- reading the run's history: retry_dead_letter asks retired_by_retry of every step, and
-- 0053's look-up read the whole history for each timed-out wait. Without table statistics
-- (a history that grew since the last analyze) a retry of a run with 5,000 steps, 500 of
-- them caught timeouts, took 1.5 s under 0053, and 0.12 s with the index; 20,000 steps take
-- 0.47 s, stats or not.

create index steps_failed_waits on steps (run_id, seq)
where kind = 'event' and output ? 'timeout'
   or kind = 'run' and output ->> 'status' is distinct from 'completed';

-- retired_by_retry as in 0053, the failed waits beside the one that ended the run retired
-- whatever their kind. A failed wait is an event wait that timed out (it raises
-- EventTimeout in the body) or a wait for a run that did not complete (ChildFailed).
create or replace function retired_by_retry(p_step steps, p_run runs) returns boolean
language sql stable
set search_path from current
as $$
    select p_step.status = 'failed' or p_step.compensation_status is not null
        or (p_step.kind = 'run' and p_step.output ->> 'status' is distinct from 'completed'
            and p_run.error ->> 'type' = 'ChildFailed'
            and exists (select from runs t
                        where t.id = p_step.output ->> 'run_id'
                          and t.status not in ('dead_letter', 'cancelled')))
        or ((p_step.kind = 'event' and p_step.output ? 'timeout'
             or p_step.kind = 'run' and p_step.output ->> 'status' is distinct from 'completed')
            and p_step.finished_at >= (
                -- the wait that ended the run (steps_failed_waits)
                select s.started_at from steps s
                where s.run_id = p_run.id
                  and (s.kind = 'event' and s.output ? 'timeout'
                       and p_run.error ->> 'type' = 'EventTimeout'
                       or s.kind = 'run' and s.output ->> 'status' is distinct from 'completed'
                       and p_run.error ->> 'type' = 'ChildFailed')
                order by s.seq desc
                limit 1))
$$;
