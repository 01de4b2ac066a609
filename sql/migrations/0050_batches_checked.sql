-- 0050_batches_checked: checkpoint_steps and complete_runs refuse arrays of different lengths
-- and missing values (WF003) instead of reading them as NULLs.
--
-- Both take one array per column and unnest them side by side, which pads the shorter ones
-- with NULLs: complete_runs(array['a', 'b'], array[1, 2], array['1']) completed run b with no
-- output at all, and a NULL start time or compensable flag failed with the table's own
-- not-null violation (23502). The worker always sends full arrays; these calls are for SQL
-- callers too, and a mistake there must not complete a run with nothing.

-- Raises WF003 unless the lengths of a batch call's arrays are all the same.
create function check_batch(p_function text, p_lengths integer[]) returns void
language plpgsql immutable
set search_path from current
as $$
begin
    if exists (select from unnest(p_lengths) l where l is distinct from p_lengths[1]) then
        raise exception '% needs its arrays of one length, got %', p_function,
            array_to_string(p_lengths, ', ', 'null') using errcode = 'WF003';
    end if;
end
$$;

-- checkpoint_steps as in 0037, its arrays checked first.
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
-- the items are matched to their inserted rows by hash: a nested loop compares every pair
set enable_nestloop = off
as $$
#variable_conflict use_column
declare
    v_item record;
    v_bad text;
    v_progressed text[];
begin
    perform check_batch('checkpoint_steps', array[
        cardinality(p_run_ids), cardinality(p_epochs), cardinality(p_names),
        cardinality(p_outputs), cardinality(p_started_at), cardinality(p_compensable),
        cardinality(p_positions)]);
    if array_position(p_run_ids, null) is not null or array_position(p_outputs, null) is not null
       or array_position(p_started_at, null) is not null
       or array_position(p_compensable, null) is not null then
        raise exception 'checkpoint_steps needs a run id, an output (JSON null, not SQL NULL),'
            ' a start time and a compensable flag for every step' using errcode = 'WF003';
    end if;
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
            select r.id, r.lease_epoch, r.generation, r.status, r.takeovers, r.timeout_at
            from runs r
            where r.id = any(p_run_ids)
            order by r.id
            for no key update of r skip locked
        ), valid as (
            select i.*, f.generation, f.takeovers from items i
            join fenced f on f.id = i.run_id and f.lease_epoch = i.epoch
            where f.status in ('running', 'compensating')
              and (f.timeout_at is null or f.timeout_at >= now() or f.status = 'compensating')
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
        select i.run_id, i.name, i.epoch, v.ord is null as unfenced, f.id is null as unlocked,
               n.output, n.seq, n.run_id is not null and v.takeovers > 0 as progressed
        from items i
        left join valid v on v.ord = i.ord
        left join fenced f on f.id = i.run_id
        left join inserted n on n.run_id = i.run_id and n.name = i.name
        order by i.ord
    loop
        run_id := v_item.run_id;
        name := v_item.name;
        busy := false;
        output := v_item.output;
        seq := v_item.seq;
        if v_item.unfenced then
            -- not locked, yet its token still current: another transaction holds the row
            busy := v_item.unlocked and exists (
                select from runs r where r.id = v_item.run_id and r.lease_epoch = v_item.epoch
                  and r.status in ('running', 'compensating')
                  and (r.timeout_at is null or r.timeout_at >= now()
                       or r.status = 'compensating'));
        elsif seq is null then
            -- a duplicate: stored before, or committed while our insert waited for it (after
            -- the statement's snapshot was taken: this new statement sees it)
            select s.output, s.seq into output, seq
            from steps s where s.run_id = v_item.run_id and s.name = v_item.name;
        end if;
        lease_lost := v_item.unfenced and not busy;
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

-- complete_runs as in 0037, its arrays checked first.
create or replace function complete_runs(p_run_ids text[], p_epochs bigint[], p_outputs jsonb[])
returns table (run_id text, lease_lost boolean, busy boolean)
language plpgsql
set search_path from current
set plan_cache_mode = force_generic_plan
set jit = off
set enable_seqscan = off
as $$
begin
    perform check_batch('complete_runs', array[
        cardinality(p_run_ids), cardinality(p_epochs), cardinality(p_outputs)]);
    if array_position(p_run_ids, null) is not null
       or array_position(p_outputs, null) is not null then
        raise exception 'complete_runs needs a run id and an output (JSON null, not SQL NULL)'
            ' for every run' using errcode = 'WF003';
    end if;
    return query
    with items as (
        select i.id, i.epoch, i.output, i.ord
        from unnest(p_run_ids, p_epochs, p_outputs) with ordinality as i (id, epoch, output, ord)
    ), locked as (
        select r.id, r.lease_epoch, r.status, r.timeout_at from runs r
        where r.id = any(p_run_ids)
        order by r.id
        for update skip locked
    ), done as (
        update runs r
        set status = 'completed', output = i.output, error = null, finished_at = now(),
            locked_by = null, locked_until = null
        from items i
        join locked l on l.id = i.id
        where r.id = l.id and l.lease_epoch = i.epoch and l.status = 'running'
          and (l.timeout_at is null or l.timeout_at >= now())
        returning r.id
    )
    select i.id, d.id is null and not b.busy, d.id is null and b.busy
    from items i
    left join done d on d.id = i.id
    left join locked l on l.id = i.id
    -- not locked, yet its token still current: another transaction holds the row
    cross join lateral (
        select case when l.id is null then exists (
            select from runs r where r.id = i.id and r.lease_epoch = i.epoch
              and r.status = 'running' and (r.timeout_at is null or r.timeout_at >= now()))
            else false end as busy
    ) b
    order by i.ord;
end
$$;
