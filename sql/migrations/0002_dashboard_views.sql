-- 0002_dashboard_views: read-only views for SQL dashboards (Grafana, Metabase, psql).

-- How many runs each workflow has in each status.
create view run_counts as
select r.workflow, r.status, count(*) as runs
from runs r
group by r.workflow, r.status;

-- Runs in dead_letter with what failed and whether their compensations all succeeded.
create view dead_letters as
select r.id as run_id, r.workflow, r.queue, r.attempt, r.error,
       r.error ->> 'step' as failed_step,
       r.error ->> 'message' as last_error,
       r.compensation_ok, r.created_at, r.finished_at
from runs r
where r.status = 'dead_letter';

-- Step duration percentiles, in milliseconds, per workflow and step (completed steps only).
create view step_latency as
select r.workflow, s.name as step, count(*) as completed,
       percentile_cont(0.5) within group (order by extract(epoch from s.finished_at - s.started_at))
           * 1000 as p50_ms,
       percentile_cont(0.95) within group (order by extract(epoch from s.finished_at - s.started_at))
           * 1000 as p95_ms,
       percentile_cont(0.99) within group (order by extract(epoch from s.finished_at - s.started_at))
           * 1000 as p99_ms,
       max(extract(epoch from s.finished_at - s.started_at))::float8 * 1000 as max_ms
from steps s
join runs r on r.id = s.run_id
where s.status = 'completed'
group by r.workflow, s.name;

-- Runs that finished, per minute, workflow and final status.
create view throughput as
select date_trunc('minute', r.finished_at) as minute, r.workflow, r.status, count(*) as runs
from runs r
where r.finished_at is not null
group by 1, 2, 3;

-- Work that is not moving: runs held under an expired lease (their worker died or hangs), and
-- due pending runs whose workflow and queue no live worker serves.
create view stuck_runs as
select r.id as run_id, r.workflow, r.queue, r.status, 'expired_lease' as reason,
       r.locked_by, now() - r.locked_until as stuck_for
from runs r
where r.status in ('running', 'compensating') and r.locked_until < now()
union all
select r.id, r.workflow, r.queue, r.status, 'no_live_worker', null, now() - r.scheduled_for
from runs r
where r.status = 'pending' and r.scheduled_for <= now()
  and not exists (select 1 from workers w
                  where w.last_seen_at + w.lease > now()
                    and r.workflow = any(w.workflows) and r.queue = any(w.queues));

-- Backlog per queue: due pending runs and the age of the oldest one, plus runs in flight.
create view queue_backlog as
select r.queue,
       count(*) filter (where r.status = 'pending' and r.scheduled_for <= now()) as due,
       count(*) filter (where r.status = 'pending' and r.scheduled_for > now()) as scheduled,
       count(*) filter (where r.status in ('running', 'compensating')) as in_flight,
       now() - min(r.scheduled_for) filter (where r.status = 'pending' and r.scheduled_for <= now())
           as oldest_due_age
from runs r
where r.status in ('pending', 'running', 'compensating')
group by r.queue;

-- Workers seen recently, with how many runs each holds.
create view live_workers as
select w.id as worker, w.workflows, w.queues, w.started_at, w.last_seen_at,
       (select count(*) from runs r
        where r.locked_by = w.id and r.status in ('running', 'compensating')) as runs_held
from workers w
where w.last_seen_at + w.lease > now();
