-- 0063_purge_past_deferred_references: purge keeps the finished runs that a DEFERRABLE foreign
-- key of the application still references, and deletes the others, as 0060 does for keys
-- checked at once.
--
-- A deferrable key (Django makes every foreign key DEFERRABLE INITIALLY DEFERRED) is checked
-- at commit: the delete of a batch holding a referenced run raised nothing purge could catch,
-- and the commit failed the whole transaction. Every purge failed on the same oldest batch,
-- and no history was ever purged again. Purge now has the deferrable keys that reference a
-- table of this schema checked at once for its own deletes (SET CONSTRAINTS ... IMMEDIATE),
-- so their violations reach its handler, and gives the initially deferred ones their mode
-- back for the rest of the transaction. Lock order as in 0035.

-- The deferrable foreign keys of any table that reference a table of this schema, named for
-- SET CONSTRAINTS: all of them, and those deferred unless a transaction says otherwise.
create function deferrable_references(out all_keys text, out deferred_keys text)
language sql stable
set search_path from current
as $$
    select string_agg(distinct k.name, ', '),
           string_agg(distinct k.name, ', ') filter (where k.deferred)
    from (
        select format('%I.%I', n.nspname, c.conname) as name, c.condeferred as deferred
        from pg_constraint c
        join pg_namespace n on n.oid = c.connamespace
        join pg_class t on t.oid = c.confrelid
        where c.contype = 'f' and c.condeferrable
          and t.relnamespace = current_schema()::regnamespace
    ) k
$$;

-- purge as in 0060, the deferrable keys checked at once while it deletes.
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
    v_id text;
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
    -- the rules again, in a new statement: the one above decided on its snapshot, and a
    -- wait that recorded a failure of one of these runs and committed before the lock (its
    -- key-share lock gone with it) is seen only now. By key: joined to the batch, the delete
    -- was planned as a hash of the whole table.
    begin
        delete from runs r where r.id = any(v_doomed) and not purge_keeps(r);
        get diagnostics v_deleted = row_count;
    exception when foreign_key_violation then
        -- a table of the application references some of these runs: the others go one by
        -- one, and those stay for a later purge (which tries them again once a round)
        v_deleted := 0;
        foreach v_id in array v_doomed loop
            begin
                delete from runs r where r.id = v_id and not purge_keeps(r);
                v_deleted := v_deleted + case when found then 1 else 0 end;
            exception when foreign_key_violation then
                v_kept := v_kept || v_id;
            end;
        end loop;
        raise warning 'purge kept % finished run(s) that other tables still reference'
            ' (foreign keys without on delete cascade), such as %',
            cardinality(v_kept), v_kept[1];
    end;
    if v_deferred is not null then
        execute 'set constraints ' || v_deferred || ' deferred';
    end if;
    return v_deleted;
end
$$;
