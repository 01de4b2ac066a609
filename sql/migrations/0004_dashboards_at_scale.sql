-- 0004_dashboards_at_scale: dashboard views whose cost does not grow with finished history.
--
-- run_counts counted every run at every refresh (100 ms at 600k runs). Unfinished runs are
-- still counted live (the partial index over them bounds that); finished runs are counted by
-- triggers: a run that moves into or out of a finished status (completion, dead letter,
-- cancel, retry) appends a delta row, a purge one aggregated row per statement, never a
-- contended counter row. Workers fold the deltas into run_count_totals at every heartbeat
-- (one folder at a time, under an advisory lock).
-- throughput and step_latency cover the last 24 hours, read through indexes on time.

create table run_count_totals (
    workflow text not null,
    status text not null,
    runs bigint not null,
    primary key (workflow, status)
);

-- Appended by the triggers below; folded into run_count_totals by fold_run_counts.
create table run_count_deltas (
    workflow text not null,
    status text not null,
    delta bigint not null
);

insert into run_count_totals (workflow, status, runs)
select r.workflow, r.status, count(*) from runs r
where r.status in ('completed', 'dead_letter', 'cancelled')
group by r.workflow, r.status;

-- Counts a run that entered (+1) or left (-1) a finished status. A row trigger, called only
-- for such rows (its when clause): the updates that finish nothing (claims, heartbeats,
-- checkpoints) fire nothing and capture no transition table, which a statement trigger
-- would do for every update of runs.
create function count_finished_update() returns trigger
language plpgsql
set search_path from current
as $$
begin
    if new.status in ('completed', 'dead_letter', 'cancelled') then
        insert into run_count_deltas (workflow, status, delta)
        values (new.workflow, new.status, 1);
    end if;
    if old.status in ('completed', 'dead_letter', 'cancelled') then
        insert into run_count_deltas (workflow, status, delta)
        values (old.workflow, old.status, -1);
    end if;
    return null;
end
$$;

-- Counts finished runs deleted (a purge of history) in one statement.
create function count_finished_deletes() returns trigger
language plpgsql
set search_path from current
as $$
begin
    insert into run_count_deltas (workflow, status, delta)
    select o.workflow, o.status, -count(*)
    from old_runs o
    where o.status in ('completed', 'dead_letter', 'cancelled')
    group by o.workflow, o.status;
    return null;
end
$$;

-- Counts a run inserted already finished (flowly inserts runs pending, so only a restore or a
-- hand-made row does this, and only such a row fires the trigger).
create function count_finished_insert() returns trigger
language plpgsql
set search_path from current
as $$
begin
    insert into run_count_deltas (workflow, status, delta) values (new.workflow, new.status, 1);
    return null;
end
$$;

create trigger runs_count_finished_insert after insert on runs
    for each row when (new.status in ('completed', 'dead_letter', 'cancelled'))
    execute function count_finished_insert();
create trigger runs_count_finished_updates after update of status on runs
    for each row
    when (old.status is distinct from new.status
          and (new.status in ('completed', 'dead_letter', 'cancelled')
               or old.status in ('completed', 'dead_letter', 'cancelled')))
    execute function count_finished_update();
create trigger runs_count_finished_deletes after delete on runs
    referencing old table as old_runs
    for each statement execute function count_finished_deletes();

-- Folds the committed deltas into run_count_totals, unless another session is folding now.
-- Workers call it after each heartbeat, so the deltas stay few without a scheduler.
create function fold_run_counts() returns void
language plpgsql
set search_path from current
as $$
begin
    if not pg_try_advisory_xact_lock(7237142851620390002) then
        return;
    end if;
    with folded as (
        delete from run_count_deltas d returning d.workflow, d.status, d.delta
    )
    insert into run_count_totals as t (workflow, status, runs)
    select f.workflow, f.status, sum(f.delta) from folded f group by f.workflow, f.status
    on conflict (workflow, status) do update set runs = t.runs + excluded.runs;
    delete from run_count_totals t where t.runs = 0;
end
$$;

-- How many runs each workflow has in each status: unfinished ones counted now, finished ones
-- from the counters.
create or replace view run_counts as
select c.workflow, c.status, sum(c.runs)::bigint as runs
from (
    select r.workflow, r.status, count(*) as runs
    from runs r
    where r.status in ('pending', 'running', 'compensating')
    group by r.workflow, r.status
    union all
    select t.workflow, t.status, t.runs from run_count_totals t
    union all
    select d.workflow, d.status, d.delta from run_count_deltas d
) c
group by c.workflow, c.status
having sum(c.runs) <> 0;

-- Runs finished per minute, workflow and final status, over the last 24 hours.
create or replace view throughput as
select date_trunc('minute', r.finished_at) as minute, r.workflow, r.status, count(*) as runs
from runs r
where r.finished_at > now() - interval '24 hours'
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
join steps s on s.run_id = r.id
where r.created_at > now() - interval '24 hours' and s.status = 'completed'
group by r.workflow, s.name;
