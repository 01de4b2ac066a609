-- 0076_purge_keeps_the_runs_a_family_is_walked_through: purge deletes no run that a walk of
-- its family may still need: a run that started a run still there is kept while it is
-- cancelled or the run that started it is there. A family goes whole in one call when the
-- batch holds it.
--
-- A family is found through parent_run_id: cancel walks it down (family_to_cancel), and
-- retry_dead_letter and a start by hand walk it up to the nearest cancelled ancestor (0071).
-- purge (0028) kept a finished run only while a run it started was unfinished, or, for a
-- cancelled run, dead-lettered; it deleted a finished middle run of a family, and the walks
-- ended at the gap. g cancelled over a completed p and a dead-lettered c (purging completed
-- and cancelled runs, dead letters kept for inspection): purge deleted p (its child
-- finished) and g (its child not a dead letter), and the retry of c was accepted, c running
-- again under the cancelled g; so it was with a completed q under a p cancelled with g, with
-- a dead-lettered p purged before its child was old enough, and with a child started by hand
-- under p once g alone was purged. Purged before g's cancel, p took c out of g's family: the
-- cancel never reached c, and c's retry was accepted after it; so was a running run two
-- completed generations below a running g left running by g's cancel.
--
-- Ways weighed. Treating a missing parent as cancelled refuses runs no cancel ever covered
-- (those of a completed family whose top was purged), and cancel would still not find what
-- lies below the gap. Marking the descendants of a cancelled run at the cancel rewrites a
-- whole family's finished rows, and does not help a cancel that comes after the purge.
-- Keeping a run while any descendant is unfinished or a dead letter looks at all of them
-- for each run purge reads, a cost that grows with the family, still lets a start by hand
-- under a completed run of a cancelled family through, and keeps for ever a chain of runs
-- that each start the next and complete. What the walks need is that, wherever a walk up
-- ends at a gap, it has missed no run that is cancelled or may yet be (a run gone can be
-- neither), and that a cancel of a run that is there reaches every run below it. So
-- purge_keeps now keeps a run that started a run still there while the run is cancelled,
-- or while the run that started it is there; it may go, with its children left, once it is
-- completed or a dead letter and nothing above it is left. By induction every run a walk
-- would have met above a gap was deleted, not cancelled, with nothing above it: the walk up
-- answers as it would have with them there, and a run that is there has no gap between
-- itself and any run below it. The check is two look-ups by index, and covers both rules of
-- 0028 it replaces. A family is still purged whole: from its top down (a run whose parent
-- is gone) and from its newest runs up (a run whose children are gone). A completed or
-- dead-lettered run at the top of what is left now goes even while a run it started is
-- unfinished (0028 kept it): cancelling it changes nothing, and retrying a dead letter
-- that is gone is not possible, so no walk needs it; and a chain of runs each starting the
-- next and completing is purged up to its live end.
--
-- Such a rule purges a family one generation a statement. So purge, once it deleted its
-- batch (purge_candidates leaves out what the rule keeps on its snapshot), goes on through
-- the families of what it deleted: the parents of the runs it deleted, and their children
-- (at most the batch of these read in a call), those it may delete now (their status and age
-- within the call's, nothing keeping them), locked skip locked, deleted in a new statement
-- that sees the others gone, and so on until the call has deleted its batch. A chain deeper
-- than a batch goes in batch-sized calls, and a call deletes at most its batch.
--
-- purge_keeps is now PL/pgSQL: those statements each planned the SQL function's query again
-- (some 1.5 ms), and a PL/pgSQL function keeps its plan. Its look-ups go by index
-- (enable_seqscan off, and jit off with it, as 0011's functions): a kept plan is made for
-- any run id, and with one run's children most of the table (a large fan-out), the planner
-- took a scan of the table to find a child.
--
-- Lock order: the batch's runs, then purge_positions (as in 0035), then runs of the families
-- of what it deleted; every run is taken skip locked, so purge waits for none.

-- Whether purge must keep finished run p_run for what may still read it or walk its family
-- through it: 0028's rules, the two about the runs it started replaced by one (see the
-- header). Moves nothing.
create or replace function purge_keeps(p_run runs) returns boolean
language plpgsql stable
set search_path from current
set enable_seqscan = off
set jit = off
as $$
begin
    return
        -- a run some wait names, while its waiter may still read it (a dead-lettered
        -- waiter may be retried: it is kept until that waiter is purged)
        exists (select from waits w
                join runs waiter on waiter.id = w.run_id
                where w.target = p_run.id and w.kind = 'run'
                  and waiter.status in ('pending', 'running', 'compensating', 'dead_letter'))
        -- a run whose failure an unfinished run recorded (it may yet end that run), or the
        -- failure that ended a dead-lettered run: a retry asks for it again
        or exists (select from steps s
                   join runs waiter on waiter.id = s.run_id
                   where (s.output ->> 'run_id') = p_run.id and s.kind = 'run'
                     and s.output ->> 'status' <> 'completed'
                     and (waiter.status in ('pending', 'running', 'compensating')
                          or waiter.status = 'dead_letter' and retired_by_retry(s, waiter)))
        -- a run whose failure a retry retired, until the retried run asks again
        or exists (select from step_history h
                   join runs waiter on waiter.id = h.run_id
                   where (h.output ->> 'run_id') = p_run.id and h.kind = 'run'
                     and h.output ->> 'status' <> 'completed'
                     and waiter.status in ('pending', 'running', 'compensating', 'dead_letter')
                     and not exists (select from steps s
                                     where s.run_id = h.run_id and s.name = h.name))
        -- a child whose parent, unfinished or dead-lettered, has not recorded its outcome
        -- yet (a retried parent may wait for it)
        or exists (select from runs p
                   where p.id = p_run.parent_run_id
                     and p.status in ('pending', 'running', 'compensating', 'dead_letter')
                     and not exists (select from steps s
                                     where s.run_id = p.id and s.kind = 'run'
                                       and s.name = 'run:' || p_run.id))
        -- a run that started a run still there, while it is cancelled or the run that
        -- started it is there: a cancel walks down through it, a retry or a start by hand
        -- walks up to the nearest cancelled run, and above a gap there must be none, nor a
        -- run that may yet be cancelled (see the header)
        or (exists (select from runs c where c.parent_run_id = p_run.id)
            and (p_run.status = 'cancelled'
                 or exists (select from runs p where p.id = p_run.parent_run_id)));
end
$$;

-- Deletes those of runs p_runs (locked by the caller) that purge may still delete, its rules
-- checked again in this statement; a run that a table of the application references (a
-- foreign key without on delete cascade) is kept and named in referenced, the others then
-- deleted one by one (0060). ids names the runs deleted, parents the runs that started them:
-- purge may delete those next. Moves the runs deleted out, with their history.
create function delete_purged_runs(
    p_runs text[], out ids text[], out parents text[], out referenced text[]
)
language plpgsql
set search_path from current
as $$
declare
    v_id text;
    v_parent text;
begin
    referenced := '{}';
    -- by key: joined to the runs, the delete was planned as a hash of the whole table
    with gone as (
        delete from runs r where r.id = any(p_runs) and not purge_keeps(r)
        returning r.id, r.parent_run_id
    )
    select coalesce(array_agg(g.id), '{}'),
           coalesce(array_agg(distinct g.parent_run_id)
                        filter (where g.parent_run_id is not null), '{}')
    into ids, parents
    from gone g;
exception when foreign_key_violation then
    ids := '{}';
    parents := '{}';
    foreach v_id in array p_runs loop
        begin
            delete from runs r where r.id = v_id and not purge_keeps(r)
            returning r.parent_run_id into v_parent;
            if found then
                ids := ids || v_id;
                if v_parent is not null and not v_parent = any(parents) then
                    parents := parents || v_parent;
                end if;
            end if;
        exception when foreign_key_violation then
            referenced := referenced || v_id;
        end;
    end loop;
end
$$;

-- purge as in 0063, with purge_keeps' new rule, and going on through the families of the
-- runs it deleted, within its batch (see the header).
create or replace function purge(
    older_than interval,
    statuses text[] default array['completed', 'cancelled', 'dead_letter'],
    batch integer default 1000
) returns integer
language plpgsql
set search_path from current
as $$
declare
    v_statuses text[];
    v_finished_before timestamptz;
    v_doomed text[];
    v_round_end text[];
    v_deleted integer := 0;
    v_ids text[];
    v_parents text[];
    v_referenced text[];
    v_children text[];
    v_children_read integer;
    v_children_left integer := purge.batch;
    v_kept text[] := '{}';
    v_deferrable text;
    v_deferred text;
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
    v_statuses := array(select distinct s from unnest(purge.statuses) s);
    -- the cut-off as purge_candidates counts it (the start of time for an age older than it)
    v_finished_before := case when purge.older_than >= now() - readable_time_start()
                              then '-infinity' else now() - purge.older_than end;
    v_doomed := purge_candidates(purge.older_than, v_statuses, purge.batch, true);
    -- one writer of the positions at a time: two purges at once would lock their rows in
    -- different orders (deletes in the table's, inserts in the statuses'); reads go on
    lock table purge_positions in share row exclusive mode;
    if cardinality(v_doomed) < purge.batch
       and exists (select from purge_positions p where p.status = any(v_statuses)) then
        -- past every position there was too little: round again from the oldest
        v_round_end := purge_candidates(purge.older_than, v_statuses,
                                        purge.batch - cardinality(v_doomed), false);
        v_doomed := v_doomed || v_round_end;
        delete from purge_positions p where p.status = any(v_statuses);
    else
        v_round_end := v_doomed;
    end if;
    if cardinality(v_doomed) = purge.batch then
        -- the batch is full: every status goes on from the latest finish time in it, the
        -- runs of each status finished before it having all been looked at (a status's runs
        -- are read in order, and the batch holds the oldest any status offered), those of a
        -- status it took none of too
        insert into purge_positions as p (status, finished_at)
        select st.status, (select max(r.finished_at) from runs r where r.id = any(v_round_end))
        from unnest(v_statuses) st (status)
        on conflict (status) do update set finished_at = excluded.finished_at;
    else
        -- a round is complete: the next call begins one from the oldest
        delete from purge_positions p where p.status = any(v_statuses);
    end if;
    select k.all_keys, k.deferred_keys into v_deferrable, v_deferred
    from deferrable_references() k;
    if v_deferrable is not null then
        execute 'set constraints ' || v_deferrable || ' immediate';
    end if;
    loop
        -- the rules again, in a new statement: the one that chose these runs decided on its
        -- snapshot, and a wait that recorded a failure of one of them and committed before
        -- the lock (its key-share lock gone with it) is seen only now
        select d.ids, d.parents, d.referenced into v_ids, v_parents, v_referenced
        from delete_purged_runs(v_doomed) d;
        v_deleted := v_deleted + cardinality(v_ids);
        v_kept := v_kept || v_referenced;
        exit when v_deleted >= purge.batch or cardinality(v_ids) = 0;
        -- their families: the runs that started them, and the runs they started (a
        -- bounded number of these a call: a run may have started very many)
        select coalesce(array_agg(k.id) filter (where k.status = any(v_statuses)), '{}'),
               count(*)
        into v_children, v_children_read
        from (select c.id, c.status from runs c
              where c.parent_run_id = any(v_ids)
              limit v_children_left) k;
        v_children_left := v_children_left - v_children_read;
        v_doomed := array(
            select r.id from runs r
            where r.id = any(v_parents || v_children) and r.status = any(v_statuses)
              and r.finished_at < v_finished_before and not purge_keeps(r)
            limit purge.batch - v_deleted
            for update of r skip locked);
    end loop;
    if cardinality(v_kept) > 0 then
        raise warning 'purge kept % finished run(s) that other tables still reference'
            ' (foreign keys without on delete cascade), such as %',
            cardinality(v_kept), v_kept[1];
    end if;
    if v_deferred is not null then
        execute 'set constraints ' || v_deferred || ' deferred';
    end if;
    return v_deleted;
end
$$;
