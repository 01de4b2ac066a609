-- 0028_purge_keeps_families_whole: purge decides again once it holds the runs it deletes,
-- and keeps the runs through which a family is found.
--
-- purge chose the runs to delete by its keep rules on its statement's snapshot and locked
-- them skip locked. A wait that recorded the failure of such a run and committed during the
-- scan held no lock on it any more, so purge deleted a failure a dead-lettered run's retry
-- asks for again (RunNotFound). purge now locks the batch, then checks the rules again in a
-- new statement, which sees every record committed before the lock.
--
-- purge deleted a finished run whose child was still running; cancel walks a family through
-- parent_run_id, so a later cancel of the grandparent left the grandchild running. And it
-- deleted a cancelled run whose dead-lettered child it had kept for another reason; 0026's
-- retry_dead_letter then found no parent to refuse it for, and the child ran again. purge now
-- keeps a run while a run it started is unfinished, and a cancelled run while a run it started
-- is dead-lettered.

-- Whether purge must keep finished run p_run for what may still read it: 0023's rules, and
-- the two above. Moves nothing.
create function purge_keeps(p_run runs) returns boolean
language sql stable
set search_path from current
as $$
    select
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
        -- a run that started a run still unfinished: cancel finds its descendants through it
        or exists (select from runs c
                   where c.parent_run_id = p_run.id
                     and c.status in ('pending', 'running', 'compensating'))
        -- a cancelled run that started a dead-lettered one: retry_dead_letter refuses that
        -- one only while it finds the cancelled parent
        or (p_run.status = 'cancelled'
            and exists (select from runs c
                        where c.parent_run_id = p_run.id and c.status = 'dead_letter'))
$$;

-- purge as in 0023, with its rules in purge_keeps, checked again once the batch is locked.
create or replace function purge(
    older_than interval,
    statuses text[] default array['completed', 'cancelled', 'dead_letter'],
    batch integer default 1000
) returns integer
language plpgsql
set search_path from current
as $$
declare
    v_doomed text[];
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
    v_doomed := array(
        select d.id from (select distinct s from unnest(purge.statuses) s) st (status)
        cross join lateral (
            select r.id, r.finished_at from runs r
            where r.status = st.status
              and r.finished_at < now() - purge.older_than
              and not purge_keeps(r)
            order by r.finished_at
            limit purge.batch
            for update of r skip locked
        ) d
        order by d.finished_at
        limit purge.batch);
    -- the rules again, in a new statement: the one above decided on its snapshot, and a
    -- wait that recorded a failure of one of these runs and committed before the lock (its
    -- key-share lock gone with it) is seen only now. By key: joined to the batch, the delete
    -- was planned as a hash of the whole table.
    delete from runs r where r.id = any(v_doomed) and not purge_keeps(r);
    get diagnostics v_deleted = row_count;
    return v_deleted;
end
$$;
