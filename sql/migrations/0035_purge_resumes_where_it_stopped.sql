-- 0035_purge_resumes_where_it_stopped: a purge call goes on from where the last one stopped,
-- instead of reading again, at every call, the old runs it keeps.
--
-- purge (0023, 0028) takes each batch from the oldest finished runs, checking its keep rules
-- on each: the runs it keeps (children whose running parent has not read them yet, the
-- targets of waits, ...) stay at the head of that order, and every batch read and checked them
-- all again before reaching one it may delete. 20,000 kept runs made each batch of 1,000 cost
-- 0.65-0.86 s instead of 0.17-0.33, and a purge of a large backlog behind them took that
-- long per batch: a cost that grew with what it keeps. Now each status remembers up to which
-- finish time its runs have been looked at, and the next call begins there (a status whose
-- old runs are all kept too: it would otherwise be read through again at each call while the
-- others fill the batches); the runs finished at that very time are looked at again, so a
-- position needs no tie-breaker and the index on (status, finished_at) gives the order.
-- A call that reaches the end of its runs before its batch is full goes round again from the
-- oldest, for the rest of the batch, up to where it began (runs kept then may be deletable
-- now), and forgets the positions once a round is complete: a call still returns fewer than
-- its batch only when no run it may delete is left, so a loop until then deletes everything
-- it may, as before, and the first call of a round takes the oldest runs first.
--
-- Two purges at once: each locks its batch skip locked, so they take different runs, then
-- the positions table, so that they write positions one after the other; a position written
-- by the one that read less only makes the next call read some runs again.
-- Lock order: the batch's runs, then purge_positions (only purge writes it).

-- Where each status's round of purge stands: its runs finished before finished_at were
-- deleted, kept or held by another transaction. Only purge reads and writes it.
create table purge_positions (
    status text primary key,
    finished_at timestamptz not null
);

-- The next runs purge may delete, oldest first: those of each status from its position on
-- (p_after_positions), or before it (not p_after_positions; none for a status without one),
-- locked skip locked. Moves nothing. Read in the index's order, so that a batch stops at
-- its limit: a bitmap scan would check the keep rules on every old run first, to sort them.
create function purge_candidates(
    p_older_than interval, p_statuses text[], p_limit integer, p_after_positions boolean
) returns text[]
language plpgsql
set search_path from current
set enable_bitmapscan = off
as $$
begin
    return array(
        select d.id from unnest(p_statuses) st (status)
        left join purge_positions p on p.status = st.status
        cross join lateral (
            select r.id, r.finished_at from runs r
            where r.status = st.status
              and r.finished_at < now() - p_older_than
              and r.finished_at >= case when p_after_positions
                                        then coalesce(p.finished_at, '-infinity')
                                        else '-infinity' end
              and r.finished_at < case when p_after_positions then 'infinity'
                                       else coalesce(p.finished_at, '-infinity') end
              and not purge_keeps(r)
            order by r.finished_at
            limit p_limit
            for update of r skip locked
        ) d
        order by d.finished_at
        limit p_limit);
end
$$;

-- purge as in 0028, each batch taken from where the last call stopped.
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
    v_doomed text[];
    v_round_end text[];
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
    v_statuses := array(select distinct s from unnest(purge.statuses) s);
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
    -- the rules again, in a new statement: the one above decided on its snapshot, and a
    -- wait that recorded a failure of one of these runs and committed before the lock (its
    -- key-share lock gone with it) is seen only now. By key: joined to the batch, the delete
    -- was planned as a hash of the whole table.
    delete from runs r where r.id = any(v_doomed) and not purge_keeps(r);
    get diagnostics v_deleted = row_count;
    return v_deleted;
end
$$;
