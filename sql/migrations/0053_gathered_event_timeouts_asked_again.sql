-- 0053_gathered_event_timeouts_asked_again: retrying a run that failed on event waits it
-- made at once (asyncio.gather) asks every one of them again, not one per retry.
--
-- 0049 retired only the last timed-out event wait of a run that ended on EventTimeout. A
-- body that gathered two waits which both timed out recorded two timeouts, and raised the
-- one gather met first, which need not be the last recorded: each retry asked one wait
-- again and replayed the other's timeout, so the run failed again at once, and a run with
-- more gathered waits than attempts could not be retried into waiting at all.
--
-- What tells a wait made beside the last one from a wait whose timeout the body caught
-- before it went on: the caught one was recorded before the last wait was first reached. A
-- wait's step now starts when the wait was first reached (waits.reached_at; it started when
-- its outcome was recorded), so the timed-out waits recorded after the last one was reached
-- are retired with it. Steps recorded before 0053 start at their record time, which keeps
-- 0049's answer for them.

alter table waits add column reached_at timestamptz not null default now();

-- record_wait as in 0009, the step starting when the wait was first reached (the wait's row,
-- deleted as before, says when).
create or replace function record_wait(
    p_run_id text, p_step text, p_kind text, p_output jsonb, p_position integer
) returns void
language plpgsql
set search_path from current
as $$
declare
    v_reached_at timestamptz;
begin
    delete from waits w where w.run_id = p_run_id and w.step = p_step
    returning w.reached_at into v_reached_at;
    insert into steps (run_id, name, seq, position, kind, status, output, started_at)
    values (p_run_id, p_step, nextval('step_seq'), p_position, p_kind, 'completed', p_output,
            coalesce(v_reached_at, now()))
    on conflict do nothing;
    update runs r set takeovers = 0 where r.id = p_run_id and r.takeovers > 0;
end
$$;

-- retired_by_retry as in 0049, with every timed-out event wait recorded after the last one
-- was first reached.
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
            and p_step.finished_at >= (select s.started_at from steps s
                                       where s.run_id = p_run.id and s.kind = 'event'
                                         and s.output ? 'timeout'
                                       order by s.seq desc
                                       limit 1))
$$;
