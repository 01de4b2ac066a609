-- 0005_retention: purging finished history in bounded batches.

-- Deletes up to `batch` finished runs (oldest first) whose status is one of `statuses` and
-- that finished more than `older_than` ago, with their steps, attempts, timers and step
-- history (on delete cascade). Unfinished runs are never touched, and a row another
-- transaction holds is skipped, so a purge never waits for live work; each call is one
-- bounded transaction: call it until it returns 0. Returns how many runs it deleted.
create function purge(
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
        order by r.finished_at
        limit purge.batch
        for update skip locked
    )
    delete from runs r using doomed d where r.id = d.id;
    get diagnostics v_deleted = row_count;
    return v_deleted;
end
$$;
