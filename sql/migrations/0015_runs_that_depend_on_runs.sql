-- 0015_runs_that_depend_on_runs: purge, cancel and retry_dead_letter where one run depends on
-- another (a child and its parent, a run and the runs waiting for it).
--
-- purge deleted a finished run that an unfinished run still needed: a child whose parent had
-- not read its outcome yet (the parent slept past the retention, or was woken and not yet
-- claimed), so the parent's wait then failed with WF002 and the parent with it. It now keeps
-- a run that a wait of a live (or dead-lettered, retriable) run names, and a child whose
-- unfinished parent has not recorded its outcome; they go in a later purge.
--
-- cancel waited at most 5 s for the run named, but the update of its descendants raised
-- PostgreSQL's lock_not_available (55P03) when one of their rows was held longer: now WF005
-- (RunBusy) as for the run named, and nothing is cancelled.
--
-- retry_dead_letter replayed a wait's recorded failure: a parent that dead-lettered because
-- its child had failed replayed that failure in every generation, even after the child was
-- retried and completed. The recorded failure that ended the run (ChildFailed) is now retired
-- with the failed steps (to step_history), so the new generation asks for the other run's
-- outcome again; a failure the body caught and went on from stays, for an exact replay.

-- purge as in 0005, but for the runs an unfinished run may still read.
create or replace function purge(
    older_than interval,
    statuses text[] default array['completed', 'cancelled', 'dead_letter'],
    batch integer default 1000
) returns integer
language plpgsql
set search_path from current
as $$
declare
    v_deleted integer;
begin
    if purge.older_than is null or purge.older_than < interval '0' then
        raise exception 'older_than must be an interval of zero or more, got %',
            coalesce(purge.older_than::text, 'null') using errcode = 'WF003';
    end if;
    if purge.statuses is null or cardinality(purge.statuses) = 0
       or not purge.statuses <@ array['completed', 'cancelled', 'dead_letter'] then
        raise exception 'statuses must be finished statuses (completed, cancelled,'
            ' dead_letter), got %', coalesce(purge.statuses::text, 'null')
            using errcode = 'WF003';
    end if;
    if purge.batch is null or purge.batch < 1 then
        raise exception 'batch must be a positive number of runs, got %',
            coalesce(purge.batch::text, 'null') using errcode = 'WF003';
    end if;
    with doomed as (
        select r.id from runs r
        where r.finished_at < now() - purge.older_than
          and r.status = any(purge.statuses)
          -- a run some wait names, while its waiter may still read it (a dead-lettered
          -- waiter may be retried: it is kept until that waiter is purged)
          and not exists (select from waits w
                          join runs waiter on waiter.id = w.run_id
                          where w.target = r.id and w.kind = 'run'
                            and waiter.status in ('pending', 'running', 'compensating',
                                                  'dead_letter'))
          -- a child whose unfinished parent has not recorded its outcome yet
          and not exists (select from runs p
                          where p.id = r.parent_run_id
                            and p.status in ('pending', 'running', 'compensating')
                            and not exists (select from steps s
                                            where s.run_id = p.id and s.kind = 'run'
                                              and s.name = 'run:' || r.id))
        order by r.finished_at
        limit purge.batch
        for update skip locked
    )
    delete from runs r using doomed d where r.id = d.id;
    get diagnostics v_deleted = row_count;
    return v_deleted;
end
$$;

-- cancel as in 0003, but a descendant's row held past lock_timeout raises WF005.
create or replace function cancel(run_id text) returns text
language plpgsql
set search_path from current
set lock_timeout = '5s'
as $$
declare
    v_run runs := lock_run_for_operator(cancel.run_id);
begin
    if v_run.status not in ('pending', 'running', 'compensating') then
        return v_run.status;
    end if;
    with recursive family as (
        select v_run.id as id
        union
        select c.id from runs c join family f on c.parent_run_id = f.id
    )
    update runs r
    set status = 'cancelled', finished_at = now(), locked_by = null, locked_until = null,
        lease_epoch = r.lease_epoch + 1,
        compensation_ok = case when r.status = 'compensating' then false
                               else r.compensation_ok end
    from family f
    where r.id = f.id and r.status in ('pending', 'running', 'compensating');
    return 'cancelled';
exception
    when lock_not_available then
        raise exception 'run % is busy: another transaction has held the row of a run it'
            ' started for over %; try again', cancel.run_id, current_setting('lock_timeout')
            using errcode = 'WF005';
end
$$;

-- Whether retry_dead_letter retires a step row of run p_run (moves it to step_history and runs
-- it again): a failed step, a step whose compensation ran, and the wait whose recorded failure
-- of another run ended p_run (ChildFailed; the last such record). A failure the body caught
-- and went on from stays, so the retried body takes the same branch.
create function retired_by_retry(p_step steps, p_run runs) returns boolean
language sql stable
set search_path from current
as $$
    select p_step.status = 'failed' or p_step.compensation_status is not null
        or (p_step.kind = 'run' and p_step.output ->> 'status' is distinct from 'completed'
            and p_run.error ->> 'type' = 'ChildFailed'
            and p_step.seq = (select max(s.seq) from steps s
                              where s.run_id = p_run.id and s.kind = 'run'
                                and s.output ->> 'status' is distinct from 'completed'))
$$;

-- retry_dead_letter as in 0003, but what it retires is retired_by_retry's: a recorded
-- failure of another run is asked for again.
create or replace function retry_dead_letter(run_id text) returns text
language plpgsql
set search_path from current
set lock_timeout = '5s'
as $$
declare
    v_run runs := lock_run_for_operator(retry_dead_letter.run_id);
    v_first_rerun integer;
begin
    if v_run.status <> 'dead_letter' then
        raise exception 'run % is %, only a dead_letter run can be retried',
            v_run.id, v_run.status using errcode = 'WF004';
    end if;
    insert into step_history (run_id, generation, name, kind, seq, position, status, output,
                              error, attempts, started_at, finished_at, compensable,
                              compensation_status, compensation_error, compensated_at)
    select s.run_id, v_run.generation, s.name, s.kind, s.seq, s.position, s.status, s.output,
           s.error, s.attempts, s.started_at, s.finished_at, s.compensable,
           s.compensation_status, s.compensation_error, s.compensated_at
    from steps s
    where s.run_id = v_run.id and retired_by_retry(s, v_run)
    on conflict do nothing;
    select min(s.position) into v_first_rerun from steps s
    where s.run_id = v_run.id
      and retired_by_retry(s, v_run) and s.compensation_status is distinct from 'failed';
    delete from steps s
    where s.run_id = v_run.id
      and retired_by_retry(s, v_run) and s.compensation_status is distinct from 'failed';
    update steps s set compensation_status = null, compensation_error = null, compensated_at = null
    where s.run_id = v_run.id and s.compensation_status is not null;
    delete from timers t where t.run_id = v_run.id and t.position > v_first_rerun;
    begin
        update runs r
        set status = 'pending', attempt = 1, error = null, output = null, compensation_ok = null,
            finished_at = null, scheduled_for = now(), timeout_at = now() + r.timeout,
            generation = r.generation + 1, lease_epoch = r.lease_epoch + 1, takeovers = 0,
            locked_by = null, locked_until = null
        where r.id = v_run.id;
    exception
        when unique_violation then
            raise exception 'run % cannot be retried while run % of concurrency key % is live',
                v_run.id,
                (select r.id from runs r where r.concurrency_key = v_run.concurrency_key
                    and r.status in ('pending', 'running', 'compensating')),
                v_run.concurrency_key
                using errcode = 'WF004';
    end;
    perform pg_notify(wakeup_channel(), v_run.queue);
    return v_run.id;
end
$$;
