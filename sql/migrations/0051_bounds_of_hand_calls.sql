-- 0051_bounds_of_hand_calls: three calls that took a value past what they can do.
--
-- purge(older_than => '100000 years') failed with the timestamp overflow 22008: the cut-off
-- now() - older_than lies before the first time PostgreSQL holds, and no run finished that
-- long ago, so it deletes nothing. replay(p_limit => 2147483647) overflowed its page size
-- plus one (22003). park(p_steps => '{}') dropped every wait of the run and parked it until
-- 9999-12-31, where nothing would ever wake it; it now refuses a park for no wait (WF003).

-- purge_candidates as in 0035, its cut-off the start of time for an age older than that.
create or replace function purge_candidates(
    p_older_than interval, p_statuses text[], p_limit integer, p_after_positions boolean
) returns text[]
language plpgsql
set search_path from current
set enable_bitmapscan = off
as $$
declare
    v_finished_before timestamptz := case
        when p_older_than >= now() - readable_time_start() then '-infinity'
        else now() - p_older_than end;
begin
    return array(
        select d.id from unnest(p_statuses) st (status)
        left join purge_positions p on p.status = st.status
        cross join lateral (
            select r.id, r.finished_at from runs r
            where r.status = st.status
              and r.finished_at < v_finished_before
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

-- replay as in 0003, its page size plus one counted in bigint.
create or replace function replay(
    p_run_id text, p_after_seq bigint default 0, p_limit integer default 500,
    p_max_bytes bigint default 4194304
) returns table (
    kind text, name text, seq bigint, "position" integer, status text, output jsonb,
    compensable boolean, compensation_status text, wake_at timestamptz, due boolean,
    more boolean
)
language plpgsql stable
set search_path from current
as $$
declare
    v_fetched bigint := p_limit::bigint + 1;
begin
    if p_limit is null or p_limit < 1 then
        raise exception 'replay page size must be positive, got %',
            coalesce(p_limit::text, 'null') using errcode = 'WF003';
    end if;
    return query
    with candidates as (
        (select s.kind, s.name, s.seq, s.position, s.status, s.output, s.compensable,
                s.compensation_status, null::timestamptz as wake_at, null::boolean as due
         from steps s
         where s.run_id = p_run_id and s.seq > coalesce(p_after_seq, 0)
         order by s.seq
         limit v_fetched)
        union all
        (select 'timer', t.name, t.seq, t.position, null, null, false, null, t.wake_at,
                t.wake_at <= now()
         from timers t
         where t.run_id = p_run_id and t.seq > coalesce(p_after_seq, 0)
         order by t.seq
         limit v_fetched)
        order by 3
        limit v_fetched
    ), measured as (
        select c.*, row_number() over (order by c.seq) as n,
               sum(coalesce(pg_column_size(c.output), 0)) over (order by c.seq)
                   - coalesce(pg_column_size(c.output), 0) as bytes_before
        from candidates c
    ), page as (
        select * from measured m where m.n <= p_limit and m.bytes_before <= p_max_bytes
    )
    select p.kind, p.name, p.seq, p.position, p.status, p.output, p.compensable,
           p.compensation_status, p.wake_at, p.due,
           (select count(*) from candidates) > (select count(*) from page)
    from page p
    order by p.seq;
end
$$;

-- park as in 0024, refusing a park for no wait before it drops any.
create or replace function park(p_run_id text, p_epoch bigint, p_steps text[])
returns timestamptz
language plpgsql
set search_path from current
as $$
declare
    v_targets text[];
    v_due timestamptz;
begin
    if coalesce(cardinality(p_steps), 0) = 0 or array_position(p_steps, null) is not null then
        raise exception 'park of run % needs the steps of the waits it parks for, got %',
            p_run_id, coalesce(p_steps::text, 'null') using errcode = 'WF003';
    end if;
    perform lock_held_run_for_update(p_run_id, p_epoch, array['running']);
    delete from waits w where w.run_id = p_run_id and w.step <> all(p_steps);
    v_targets := array(
        select t.id from waits w join runs t on t.id = w.target
        where w.run_id = p_run_id and w.kind = 'run');
    if cardinality(v_targets) > cardinality(array(
            select t.id from runs t where t.id = any(v_targets)
            order by t.id
            for key share skip locked)) then
        raise exception 'run % is busy: a run it waits for is held by another transaction;'
            ' try again', p_run_id using errcode = 'WF005';
    end if;
    if parked_run_is_due(p_run_id) then
        v_due := now();
    else
        -- "never" is the last day clients can read ('infinity' would break every reader)
        select coalesce(min(w.timeout_at), timestamptz '9999-12-31 00:00:00+00') into v_due
        from waits w
        where w.run_id = p_run_id;
    end if;
    perform release_held_run(p_run_id, v_due);
    return nullif(v_due, timestamptz '9999-12-31 00:00:00+00');
end
$$;
