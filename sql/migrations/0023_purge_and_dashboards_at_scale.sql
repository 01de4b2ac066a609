-- 0023_purge_and_dashboards_at_scale: purge keeps every run a retry may ask for again and
-- reads only the statuses it deletes; step_latency reads only recent runs' steps.
--
-- purge kept a finished run while an unfinished or dead-lettered run's wait named it, and a
-- child while its unfinished parent had not recorded its outcome. But a recorded failure of
-- another run that ended the waiter is asked for again by retry_dead_letter (0015), and the
-- wait row is gone once the outcome is recorded: a dead-lettered parent lost its failed child
-- to purge, and its retry failed with RunNotFound. purge now also keeps a run whose failure an
-- unfinished run recorded or whose failure ended a dead-lettered run (retired_by_retry; 0022
-- records the run's id with the outcome, and this migration adds it to the outcomes recorded
-- before), a run whose failure a retry retired until the retried run asks for it again, and a
-- child until its parent, unfinished or dead-lettered, recorded its outcome.
--
-- purge took the oldest finished runs through the index on finished_at and checked their
-- status on the heap: `flowly purge --status cancelled` read every older completed run at
-- every batch. The index on finished_at becomes one on (status, finished_at), and purge takes
-- the oldest of each status it deletes from it; the throughput view and `flowly top` name the
-- finished statuses to use it.
--
-- step_latency joined recent runs to all steps, and the planner hashed the whole steps table;
-- it now looks up each recent run's steps.

drop index runs_finished_at;
create index runs_finished on runs (status, finished_at) where finished_at is not null;

-- Outcomes recorded before 0022 name their run only in the step's name ('run:' and the id,
-- '#2' for the second wait of a run); a name too long became a digest and stays unnamed.
update steps s
set output = s.output || jsonb_build_object('run_id', case
        when exists (select from runs r where r.id = substr(s.name, 5)) then substr(s.name, 5)
        else regexp_replace(substr(s.name, 5), '#[0-9]+$', '') end)
where s.kind = 'run' and not s.output ? 'run_id'
  and s.name like 'run:%' and s.name not like 'run:sha256:%';
update step_history h
set output = h.output || jsonb_build_object('run_id', case
        when exists (select from runs r where r.id = substr(h.name, 5)) then substr(h.name, 5)
        else regexp_replace(substr(h.name, 5), '#[0-9]+$', '') end)
where h.kind = 'run' and not h.output ? 'run_id'
  and h.name like 'run:%' and h.name not like 'run:sha256:%';

-- The recorded failures of runs (ctx.wait_for_run's outcome, not completed), by the run they
-- are about, in the current generation and in those a retry retired: what purge must keep
-- while the run that recorded them may ask again. Small: only failed outcomes.
create index steps_failed_run_outcomes on steps ((output ->> 'run_id'))
    where kind = 'run' and output ->> 'status' <> 'completed';
create index step_history_failed_run_outcomes on step_history ((output ->> 'run_id'))
    where kind = 'run' and output ->> 'status' <> 'completed';

-- purge as in 0015, but it reads each status through runs_finished and also keeps the runs
-- whose failure a retry may ask for again (see the header).
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
        select d.id from (select distinct s from unnest(purge.statuses) s) st (status)
        cross join lateral (
            select r.id, r.finished_at from runs r
            where r.status = st.status
              and r.finished_at < now() - purge.older_than
              -- a run some wait names, while its waiter may still read it (a dead-lettered
              -- waiter may be retried: it is kept until that waiter is purged)
              and not exists (select from waits w
                              join runs waiter on waiter.id = w.run_id
                              where w.target = r.id and w.kind = 'run'
                                and waiter.status in ('pending', 'running', 'compensating',
                                                      'dead_letter'))
              -- a run whose failure an unfinished run recorded (it may yet end that run),
              -- or the failure that ended a dead-lettered run: a retry asks for it again
              and not exists (select from steps s
                              join runs waiter on waiter.id = s.run_id
                              where (s.output ->> 'run_id') = r.id and s.kind = 'run'
                                and s.output ->> 'status' <> 'completed'
                                and (waiter.status in ('pending', 'running', 'compensating')
                                     or waiter.status = 'dead_letter'
                                        and retired_by_retry(s, waiter)))
              -- a run whose failure a retry retired, until the retried run asks again
              and not exists (select from step_history h
                              join runs waiter on waiter.id = h.run_id
                              where (h.output ->> 'run_id') = r.id and h.kind = 'run'
                                and h.output ->> 'status' <> 'completed'
                                and waiter.status in ('pending', 'running', 'compensating',
                                                      'dead_letter')
                                and not exists (select from steps s
                                                where s.run_id = h.run_id
                                                  and s.name = h.name))
              -- a child whose parent, unfinished or dead-lettered, has not recorded its
              -- outcome yet (a retried parent may wait for it)
              and not exists (select from runs p
                              where p.id = r.parent_run_id
                                and p.status in ('pending', 'running', 'compensating',
                                                 'dead_letter')
                                and not exists (select from steps s
                                                where s.run_id = p.id and s.kind = 'run'
                                                  and s.name = 'run:' || r.id))
            order by r.finished_at
            limit purge.batch
            for update of r skip locked
        ) d
        order by d.finished_at
        limit purge.batch
    )
    -- by key: joined to the batch, the delete was planned as a hash of the whole table
    delete from runs r where r.id = any(array(select d.id from doomed d));
    get diagnostics v_deleted = row_count;
    return v_deleted;
end
$$;

-- Runs finished per minute, workflow and final status, over the last 24 hours.
create or replace view throughput as
select date_trunc('minute', r.finished_at) as minute, r.workflow, r.status, count(*) as runs
from runs r
where r.status in ('completed', 'dead_letter', 'cancelled')
  and r.finished_at > now() - interval '24 hours'
group by 1, 2, 3;

-- Step duration percentiles, in milliseconds, per workflow and step, over the completed steps
-- of runs created in the last 24 hours.
create or replace view step_latency as
select r.workflow, s.name as step, count(*) as completed,
       percentile_cont(0.5) within group (order by extract(epoch from s.finished_at - s.started_at))
           * 1000 as p50_ms,
       percentile_cont(0.95) within group (order by extract(epoch from s.finished_at - s.started_at))
           * 1000 as p95_ms,
       percentile_cont(0.99) within group (order by extract(epoch from s.finished_at - s.started_at))
           * 1000 as p99_ms,
       max(extract(epoch from s.finished_at - s.started_at))::float8 * 1000 as max_ms
from runs r
cross join lateral (
    -- offset 0 keeps this a lookup by run: flattened into a join, it was planned as a hash
    -- of all steps
    select s.name, s.started_at, s.finished_at from steps s
    where s.run_id = r.id and s.status = 'completed'
    offset 0
) s
where r.created_at > now() - interval '24 hours'
group by r.workflow, s.name;
