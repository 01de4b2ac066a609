-- 0012_finishing_in_bulk: what a run's finishing sets off is done once per statement, not once
-- per run; checkpoints and the stalled-run sweep no longer run updates of runs that change
-- nothing.
--
-- 0004's counting and 0009's waking were row triggers: a complete_runs of 128 runs called two
-- PL/pgSQL functions and ran three statements per run (a delta row, a look for waiters, a
-- NOTIFY), about a quarter of what completing a run cost the database. One statement trigger
-- now does both for all the runs a statement finished: one aggregated delta row per workflow
-- and status, one look for waiters, one wake_waiters, still one NOTIFY per run (Client.wait
-- reads the run id from it).
--
-- 0004 chose row triggers over a statement trigger that joined the old and new transition
-- tables by id: that join cost every update of runs (a claim of 128 runs: 38 against 29 us a
-- run). This one never joins them: per workflow and status it counts the rows finished after
-- minus those finished before, and the runs that just finished are those finished after
-- except those finished, in the same status, before (a statement updates a row once). A claim
-- pays the capture of its rows and two scans of them that find nothing (about 2 us a run).
--
-- A statement trigger with transition tables fires for every update of runs, and a statement
-- that updates nothing still calls it: 20 to 30 microseconds a statement. Two updates of runs
-- ran at almost every call and almost always changed nothing: checkpoint_steps' takeovers
-- reset (a data-modifying CTE) and the stalled-run sweep of every claim and heartbeat. Both
-- now update only the rows they found first, so a checkpoint, a claim and a heartbeat pay
-- nothing for the trigger beyond their own writes.
--
-- Lock order as in 0009: the rows the statement finishes (it holds them) before the rows of
-- the runs waiting for them.

drop trigger runs_count_finished_updates on runs;
drop trigger runs_wake_on_finish on runs;
drop function count_finished_update();
drop function wake_on_finish();

-- After an update of runs: counts the runs that entered (+1) or left (-1) a finished status,
-- wakes the runs waiting for those that finished and announces each on finished_channel().
-- Without a join of the two transition tables (they can be large, and a statement updates a
-- row once): per workflow and status, the rows finished after minus those finished before.
create function note_finished_runs() returns trigger
language plpgsql
set search_path from current
as $$
declare
    v_finished text[];
begin
    -- each transition table read once; the counts written by the same statement
    with finished_after as (
        select n.id, n.workflow, n.status from new_runs n
        where n.status in ('completed', 'dead_letter', 'cancelled')
    ), finished_before as (
        select o.id, o.workflow, o.status from old_runs o
        where o.status in ('completed', 'dead_letter', 'cancelled')
    ), counted as (
        insert into run_count_deltas (workflow, status, delta)
        select d.workflow, d.status, sum(d.delta)
        from (
            select a.workflow, a.status, 1 as delta from finished_after a
            union all
            select b.workflow, b.status, -1 from finished_before b
        ) d
        group by d.workflow, d.status
        having sum(d.delta) <> 0
    )
    select array_agg(f.id) into v_finished
    from (
        select a.id, a.status from finished_after a
        except all
        select b.id, b.status from finished_before b
    ) f;
    if v_finished is null then
        return null;
    end if;
    if exists (select from waits w where w.target = any(v_finished) and w.kind = 'run') then
        perform wake_waiters(v_finished);
    end if;
    perform pg_notify(finished_channel(), f.id) from unnest(v_finished) f (id);
    return null;
end
$$;

create trigger runs_note_finished after update on runs
    referencing old table as old_runs new table as new_runs
    for each statement execute function note_finished_runs();

-- checkpoint_steps as in 0011; the takeovers of the runs it checkpointed are reset after its
-- statement, by a statement of its own that runs only when one of them was taken over.
create or replace function checkpoint_steps(
    p_run_ids text[], p_epochs bigint[], p_names text[], p_outputs jsonb[],
    p_started_at timestamptz[], p_compensable boolean[], p_positions integer[]
) returns table (
    run_id text, name text, lease_lost boolean, busy boolean, output jsonb, seq bigint
)
language plpgsql
set search_path from current
set plan_cache_mode = force_generic_plan
set jit = off
set enable_seqscan = off
as $$
#variable_conflict use_column
declare
    v_item record;
    v_bad text;
    v_progressed text[];
begin
    select n into v_bad from unnest(p_names) n
    where n is null or n = '' or octet_length(n) > max_name_bytes()
    limit 1;
    if found then
        perform check_name('step name', v_bad);
    end if;
    for v_item in
        with items as (
            select i.run_id, i.epoch, i.name, i.output, i.started_at, i.compensable,
                   i.position, i.ord
            from unnest(p_run_ids, p_epochs, p_names, p_outputs, p_started_at, p_compensable,
                        p_positions)
                with ordinality as i (run_id, epoch, name, output, started_at, compensable,
                                      position, ord)
        ), fenced as (
            select r.id, r.lease_epoch, r.generation, r.status, r.takeovers from runs r
            where r.id = any(p_run_ids)
            order by r.id
            for no key update of r skip locked
        ), valid as (
            select i.*, f.generation, f.takeovers from items i
            join fenced f on f.id = i.run_id and f.lease_epoch = i.epoch
            where f.status in ('running', 'compensating')
        ), inserted as (
            insert into steps as s (run_id, name, seq, position, status, output, attempts,
                                    started_at, compensable)
            select v.run_id, v.name, nextval('step_seq'), v.position, 'completed', v.output,
                   1 + (select count(*) from step_attempts a
                        where a.run_id = v.run_id and a.step_name = v.name
                          and a.generation = v.generation),
                   v.started_at, v.compensable
            from valid v
            order by v.ord
            on conflict do nothing
            returning s.run_id, s.name, s.output, s.seq
        )
        select i.run_id, i.name, v.ord is null as unfenced,
               -- not locked, yet its token still current: another transaction holds the row
               coalesce(v.ord is null and f.id is null and now_held.lease_epoch = i.epoch
                        and now_held.status in ('running', 'compensating'), false) as busy,
               case when n.run_id is not null then n.output else stored.output end as output,
               coalesce(n.seq, stored.seq) as seq,
               n.run_id is not null and v.takeovers > 0 as progressed
        from items i
        left join valid v on v.ord = i.ord
        left join fenced f on f.id = i.run_id
        left join inserted n on n.run_id = i.run_id and n.name = i.name
        left join lateral (
            select s.output, s.seq from steps s
            where v.ord is not null and n.run_id is null and s.run_id = i.run_id
              and s.name = i.name
        ) stored on true
        left join lateral (
            select r.lease_epoch, r.status from runs r
            where v.ord is null and f.id is null and r.id = i.run_id
        ) now_held on true
        order by i.ord
    loop
        run_id := v_item.run_id;
        name := v_item.name;
        busy := v_item.busy;
        lease_lost := v_item.unfenced and not v_item.busy;
        output := v_item.output;
        seq := v_item.seq;
        if not v_item.unfenced and seq is null then
            -- a duplicate committed while our insert waited for it, after the statement's
            -- snapshot was taken: this new statement sees it
            select s.output, s.seq into output, seq
            from steps s where s.run_id = v_item.run_id and s.name = v_item.name;
        end if;
        if v_item.progressed then
            v_progressed := v_progressed || v_item.run_id;
        end if;
        return next;
    end loop;
    if v_progressed is not null then
        -- a new checkpoint is progress: only takeovers in a row without one mark a poison run
        -- (the rows are still locked by the statement above)
        update runs r set takeovers = 0 where r.id = any(v_progressed);
    end if;
end
$$;

-- dead_letter_stalled_runs as in 0003; the stalled runs are locked first and updated only if
-- there are any (nearly never), so the sweep of every claim and heartbeat runs no update.
create or replace function dead_letter_stalled_runs() returns void
language plpgsql
set search_path from current
as $$
declare
    v_max_takeovers integer := max_takeovers();
    v_stalled text[];
begin
    v_stalled := array(
        select t.id from runs t
        where t.status in ('pending', 'running', 'compensating')
          and ((t.timeout_at < now() and t.status <> 'compensating')
               or (t.locked_until < now() and t.takeovers >= v_max_takeovers
                   and not worker_alive(t.locked_by)))
        for update skip locked);
    if cardinality(v_stalled) = 0 then
        return;
    end if;
    update runs r
    set status = 'dead_letter',
        error = case
            when r.timeout_at < now() and r.status <> 'compensating' then jsonb_build_object(
                'type', 'Timeout',
                'message', format('run exceeded its timeout of %s', r.timeout))
            else jsonb_build_object(
                'type', 'PoisonRun',
                'message', format('the workers holding this run stopped heartbeating %s times'
                                  ' in a row without a new checkpoint: its workers keep dying'
                                  ' on it', r.takeovers + 1))
        end,
        compensation_ok = case when r.status = 'compensating' then false
                               else r.compensation_ok end,
        finished_at = now(),
        lease_epoch = r.lease_epoch + 1,
        locked_by = null,
        locked_until = null
    where r.id = any(v_stalled);
end
$$;
