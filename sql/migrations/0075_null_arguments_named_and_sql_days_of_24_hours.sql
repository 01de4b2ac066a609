-- 0075_null_arguments_named_and_sql_days_of_24_hours: a NULL argument of claim, heartbeat,
-- key_run_id and send_event is refused naming it; an age, lease or input given from SQL is
-- read as flowly reads it from Python.
--
-- - claim read a NULL workflow or queue list as an empty one (it claimed nothing, as if
--   nothing were due) and a NULL worker as a name: the runs it claimed were held by nobody
--   until their lease ran out. heartbeat with a NULL worker extended its runs' leases while
--   no worker row was kept alive. Both now refuse these as WF003 naming the argument, as
--   register_worker and offer_slot do since 0072 (claim_and_offer through claim). A NULL
--   list of runs to heartbeat, release or complete stays an empty batch.
-- - key_run_id (which trigger_run_id calls, and which the worker role may call) failed with
--   a raw 22004 ("FOREACH expression must not be null") for a NULL key column list, returned
--   a NULL run id for a NULL workflow or an empty list, and blamed a column ("the row has no
--   column") for a NULL input or a NULL column name. Each is WF003 naming the argument,
--   prefixed with the caller's name, key_run_id's own when the caller gives NULL.
-- - send_event(NULL, ...) said "run <NULL> not found" (WF002), as for a run that is gone;
--   it is WF003 naming run_id (a NULL event name already was).
-- - PostgreSQL adds an interval's days to a timestamptz as calendar days of the session's
--   TimeZone (0070): under Europe/Berlin, `select flowly.purge('30 days')` across a change of
--   clocks purged runs an hour younger or kept runs an hour older than it said, and a lease
--   of '1 day' handed to claim, claim_and_offer, heartbeat, register_worker or offer_slot by
--   hand held a run, a slot or a worker for 23 or 25 hours. purge's age is now counted as
--   start's timeout is: in UTC, days of 24 hours and UTC's calendar months, and checked where
--   it ends (a cut-off after now is a negative age, WF003; one before the first time
--   PostgreSQL holds purges what is older than any run: nothing). A lease, at most a day as
--   check_lease compares intervals, is turned into that many seconds (checked_lease) before
--   it is added or stored, so every later reader of workers.lease or handoff_slots.lease adds
--   seconds whatever its own TimeZone. Python sends seconds already; nothing changes there.
--   start's timeout was 0070's; no other function users call takes an interval.
-- - start measured a SQL NULL input (`select flowly.start('wf', null)`) for the hand-off's
--   NOTIFY payload with pg_column_size, which is NULL for NULL: the run was not handed to an
--   idle worker and waited for the worker's wake-up or poll to be claimed. start now measures
--   and writes the JSON null it stores, as for 'null'::jsonb.

-- A lease as a worker hands it in, checked by check_lease and turned into hours, minutes
-- and seconds: the length check_lease compared (a month there is 30 days, a day 24 hours),
-- which `timestamptz + interval` then adds as that many seconds in every TimeZone.
create function checked_lease(p_lease interval) returns interval
language plpgsql
set search_path from current
as $$
begin
    perform check_lease(p_lease);
    return make_interval(secs => extract(epoch from p_lease));
end
$$;

-- claim as in 0034, a NULL worker, workflow list or queue list refused (WF003) and its lease
-- counted in seconds (see the header). It moves due runs to running under a new epoch,
-- leased to the worker; lock order as before: the runs, skip locked, in claim order.
create or replace function claim(
    p_worker text, p_workflows text[], p_queues text[], p_limit integer, p_lease interval
) returns table (
    run_id text, workflow text, status text, input jsonb, attempt integer, generation integer,
    lease_epoch bigint, has_history boolean
)
language plpgsql
set search_path from current
-- see 0013 for these settings
set plan_cache_mode = force_generic_plan
set jit = off
set enable_seqscan = off
as $$
declare
    v_queues text[] := array(select distinct q from unnest(p_queues) q where q is not null);
    v_workflows text[] := array(select distinct w from unnest(p_workflows) w where w is not null);
    -- the levels above this one are done; above every integer priority at first
    v_below bigint := 2147483648;
    v_priority integer;
    v_ids text[] := '{}';
    v_tried text[] := '{}';
    v_due text[];
begin
    if p_worker is null or p_workflows is null or p_queues is null then
        raise exception '% must not be null',
            case when p_worker is null then 'worker'
                 when p_workflows is null then 'workflows' else 'queues' end
            using errcode = 'WF003';
    end if;
    if p_limit is null or p_limit < 1 then
        raise exception 'claim limit must be a positive number of runs, got %',
            coalesce(p_limit::text, 'null') using errcode = 'WF003';
    end if;
    p_lease := checked_lease(p_lease);
    perform dead_letter_stalled_runs();
    loop
        -- the next priority level below v_below at which a served queue has runs of a
        -- served workflow
        select max(l.priority) into v_priority
        from unnest(v_queues) q (name)
        cross join unnest(v_workflows) w (name)
        cross join lateral (
            select r.priority from runs r
            where r.queue = q.name and r.workflow = w.name
              and r.status in ('pending', 'running', 'compensating')
              and r.priority < v_below
            order by r.priority desc
            limit 1) l;
        exit when v_priority is null;
        v_below := v_priority;
        loop
            -- the longest due runs of this level, merged from one range per queue and
            -- workflow; those another claim holds were tried and are not read again
            v_due := array(
                select d.id from unnest(v_queues) q (name)
                cross join unnest(v_workflows) w (name)
                cross join lateral (
                    select r.id, r.available_at from runs r
                    where r.queue = q.name and r.workflow = w.name and r.priority = v_priority
                      and r.status in ('pending', 'running', 'compensating')
                      and r.available_at <= now()
                      and (r.timeout_at is null or r.timeout_at >= now()
                           or r.status = 'compensating')
                      and r.id <> all(v_tried)
                    order by r.available_at
                    limit p_limit - cardinality(v_ids)) d
                order by d.available_at
                limit p_limit - cardinality(v_ids));
            exit when cardinality(v_due) = 0;
            v_tried := v_tried || v_due;
            -- locked, and checked again on the version locked (a claim that committed
            -- meanwhile may have taken the run)
            v_ids := v_ids || array(
                select r.id from runs r
                where r.id = any(v_due) and r.status in ('pending', 'running', 'compensating')
                  and r.available_at <= now()
                  and (r.timeout_at is null or r.timeout_at >= now()
                       or r.status = 'compensating')
                order by r.available_at
                for update skip locked);
            exit when cardinality(v_ids) >= p_limit;
        end loop;
        exit when cardinality(v_ids) >= p_limit;
    end loop;
    if cardinality(v_ids) = 0 then
        return;
    end if;
    update timers t set fired_at = now()
    where t.run_id = any(v_ids) and t.fired_at is null and t.wake_at <= now();
    return query
    with claimed as (
        update runs r
        set status = case r.status when 'pending' then 'running' else r.status end,
            lease_epoch = r.lease_epoch + 1,
            takeovers = r.takeovers
                + (r.locked_until is not null and not worker_alive(r.locked_by))::integer,
            locked_by = p_worker,
            locked_until = now() + p_lease,
            started_at = coalesce(r.started_at, now())
        where r.id = any(v_ids)
        returning r.id, r.workflow, r.status, r.input, r.attempt, r.generation, r.lease_epoch
    )
    select r.id, r.workflow, r.status, r.input, r.attempt, r.generation, r.lease_epoch,
           h.present is not null
    from unnest(v_ids) with ordinality as c (id, ord)
    join claimed r on r.id = c.id
    -- one probe of each index per run, stopped at the first row (see 0013); none for a run
    -- claimed for the first time, which has written nothing (epochs only grow)
    left join lateral (
        select true as present from steps s where r.lease_epoch > 1 and s.run_id = r.id
        union all
        select true from timers t where r.lease_epoch > 1 and t.run_id = r.id
        limit 1
    ) h on true
    order by c.ord;
end
$$;

-- register_worker as in 0072, its lease stored in seconds (see the header): every reader
-- of workers.lease (worker_alive, live_workers, the sweep of stale workers) adds it to a
-- time in its own session's TimeZone.
create or replace function register_worker(
    p_worker text, p_workflows text[], p_queues text[], p_lease interval
) returns void
language plpgsql
set search_path from current
as $$
begin
    perform check_name('worker', p_worker);
    p_lease := checked_lease(p_lease);
    if p_workflows is null or p_queues is null then
        raise exception '% must not be null',
            case when p_workflows is null then 'workflows' else 'queues' end
            using errcode = 'WF003';
    end if;
    delete from workers w
    where w.id in (select x.id from workers x
                   where x.last_seen_at + 100 * x.lease < now()
                   for update skip locked);
    insert into workers (id, workflows, queues, lease)
    values (p_worker, p_workflows, p_queues, p_lease)
    on conflict (id) do update
    set workflows = excluded.workflows, queues = excluded.queues, lease = excluded.lease,
        last_seen_at = now();
end
$$;

-- offer_slot as in 0072, the slot's lease stored and its end counted in seconds (see the
-- header): a start in any TimeZone hands a run off under it.
create or replace function offer_slot(
    p_worker text, p_workflows text[], p_queues text[], p_lease interval,
    p_handoff_channel text, p_room integer default 0
) returns void
language plpgsql
set search_path from current
as $$
declare
    v_free_slots bigint[];
    v_room integer := least(greatest(p_room, 0), 7);
begin
    p_lease := checked_lease(p_lease);
    if p_worker is null or p_workflows is null or p_queues is null then
        raise exception '% must not be null',
            case when p_worker is null then 'worker'
                 when p_workflows is null then 'workflows' else 'queues' end
            using errcode = 'WF003';
    end if;
    if p_handoff_channel is not null and exists (
            select from handoff_slots s
            where s.worker_id = p_worker and s.expires_at > now() + p_lease / 2
              and s.channel = p_handoff_channel and s.workflows = p_workflows
              and s.queues = p_queues and s.lease = p_lease
              and s.room = v_room) then
        return;
    end if;
    v_free_slots := array(
        select s.id from handoff_slots s
        where s.worker_id = p_worker
        order by s.id
        for update skip locked);
    if p_handoff_channel is not null then
        if cardinality(v_free_slots) = 0 then
            insert into handoff_slots (worker_id, channel, workflows, queues, lease, expires_at,
                                       room)
            values (p_worker, p_handoff_channel, p_workflows, p_queues, p_lease,
                    now() + p_lease, v_room);
        else
            update handoff_slots s
            set channel = p_handoff_channel, workflows = p_workflows, queues = p_queues,
                lease = p_lease, expires_at = now() + p_lease, room = v_room
            where s.id = v_free_slots[1];
            delete from handoff_slots s where s.id = any(v_free_slots[2:]);
        end if;
    elsif cardinality(v_free_slots) > 0 then
        delete from handoff_slots s where s.id = any(v_free_slots);
    end if;
    delete from handoff_slots s
    where s.id in (select x.id from handoff_slots x
                   where x.expires_at < now() - interval '1 minute'
                   limit 10
                   for update skip locked);
end
$$;

-- heartbeat as in 0059, a NULL worker refused (WF003: it extended the leases of runs whose
-- worker it could not keep alive) and the lease counted in seconds (see the header). It
-- moves the locked_until of the runs the worker still holds; lock order as before: the
-- worker's row, then the runs, never waiting.
create or replace function heartbeat(
    p_worker text, p_run_ids text[], p_epochs bigint[], p_lease interval
) returns table (run_id text, outcome text)
language plpgsql
set search_path from current
set enable_seqscan = off
set jit = off
as $$
declare
    v_extended text[];
begin
    if p_worker is null then
        raise exception 'worker must not be null' using errcode = 'WF003';
    end if;
    p_lease := checked_lease(p_lease);
    update workers w set last_seen_at = now()
    where w.id = (select x.id from workers x where x.id = p_worker
                  for no key update skip locked);
    with held as (
        select r.id, r.status from runs r
        join unnest(p_run_ids, p_epochs) as h (id, epoch)
            on r.id = h.id and r.lease_epoch = h.epoch
        where r.id = any(p_run_ids)
        order by r.id
        for no key update of r skip locked
    ), extended as (
        update runs r set locked_until = now() + p_lease
        from held h
        where r.id = h.id and h.status in ('running', 'compensating')
        returning r.id
    )
    select coalesce(array_agg(e.id), '{}') into v_extended from extended e;
    perform dead_letter_stalled_runs();
    -- a new statement: it sees what the sweep just did to our runs (a timeout)
    return query
    select h.id,
           case when r.lease_epoch = h.epoch and r.status in ('running', 'compensating')
                then 'busy' else 'lost' end
    from unnest(p_run_ids, p_epochs) as h (id, epoch)
    left join runs r on r.id = h.id
    where not coalesce(h.id = any(v_extended) and r.lease_epoch = h.epoch
                       and r.status in ('running', 'compensating'), false);
end
$$;

-- key_run_id as in 0007, a NULL or empty key column list, a NULL column name, a NULL
-- workflow and a NULL input refused (WF003) naming the argument, and a NULL caller's name
-- replaced by its own (see the header). It reads nothing and writes nothing: a run id.
create or replace function key_run_id(
    p_workflow text, p_columns text[], p_input jsonb, p_source text
) returns text
language plpgsql immutable
set search_path from current
as $$
declare
    v_column text;
    v_value text;
    v_key text;
    v_id text;
    v_source text := coalesce(p_source, 'key_run_id');
begin
    if coalesce(cardinality(p_columns), 0) = 0 or array_position(p_columns, null) is not null
    then
        raise exception '%: key columns must be a non-empty list of column names, got %',
            v_source, coalesce(p_columns::text, 'null') using errcode = 'WF003';
    end if;
    if p_workflow is null or p_input is null then
        raise exception '%: % must not be null', v_source,
            case when p_workflow is null then 'workflow' else 'input' end
            using errcode = 'WF003';
    end if;
    foreach v_column in array p_columns loop
        v_value := p_input ->> v_column;
        if v_value is null then
            if coalesce(p_input ? v_column, false) then
                raise exception '%: key column "%" is null; every key column needs a value'
                    ' to make the run id', v_source, replace(v_column, '"', '""')
                    using errcode = 'WF003';
            end if;
            raise exception '%: the row has no column "%" (key columns %)', v_source,
                replace(v_column, '"', '""'), array_to_string(p_columns, ',')
                using errcode = 'WF003';
        end if;
        v_value := replace(replace(v_value, '\', '\\'), ',', '\,');
        v_key := case when v_key is null then v_value else v_key || ',' || v_value end;
    end loop;
    v_id := p_workflow || ':' || v_key;
    if octet_length(v_id) > max_name_bytes() then
        v_id := p_workflow || ':sha256:' || encode(sha256(convert_to(v_key, 'UTF8')), 'hex');
        if octet_length(v_id) > max_name_bytes() then
            raise exception '%: the workflow name (% bytes) is too long to make run ids from'
                ' keys: with the key''s digest the id is % bytes; the limit is % bytes',
                v_source, octet_length(p_workflow), octet_length(v_id), max_name_bytes()
                using errcode = 'WF003';
        end if;
    end if;
    return v_id;
end
$$;

-- send_event as in 0037, a NULL run id refused (WF003) rather than looked up as a run not
-- found (WF002). It adds an event to an unfinished run and wakes the run's wait for it.
create or replace function send_event(run_id text, name text, payload jsonb default 'null')
returns bigint
language plpgsql
set search_path from current
set lock_timeout = '5s'
as $$
declare
    v_status text;
    v_seq bigint;
begin
    if send_event.run_id is null then
        raise exception 'run_id must not be null' using errcode = 'WF003';
    end if;
    perform check_name('event name', send_event.name);
    select r.status into v_status from runs r where r.id = send_event.run_id for key share;
    if not found then
        raise exception 'run % not found', send_event.run_id using errcode = 'WF002';
    end if;
    if v_status in ('completed', 'dead_letter', 'cancelled') then
        raise exception 'run % is %: it takes no more events', send_event.run_id, v_status
            using errcode = 'WF004';
    end if;
    insert into events (run_id, name, payload, sent_at)
    values (send_event.run_id, send_event.name, coalesce(send_event.payload, 'null'),
            clock_timestamp())
    returning seq into v_seq;
    perform wake_waiters(array[send_event.run_id], send_event.name);
    return v_seq;
exception
    when lock_not_available then
        raise exception 'run % is busy: another transaction has held its row for over %;'
            ' try again', send_event.run_id, current_setting('lock_timeout')
            using errcode = 'WF005';
end
$$;

-- The time before which a run finished over p_older_than ago: now() less the age counted
-- in UTC, as start counts a timeout (0070): its days are 24 hours, its months UTC's calendar
-- months. An age that passes the first or last time PostgreSQL holds (22008) ends past
-- every run's finish: -infinity for one older than that (no run is), infinity for one
-- younger (purge refuses it as negative).
create function finished_before(p_older_than interval) returns timestamptz
language plpgsql stable
set search_path from current
as $$
begin
    return (now() at time zone 'UTC' - p_older_than) at time zone 'UTC';
exception when datetime_field_overflow then
    return case when p_older_than > interval '0' then '-infinity' else 'infinity' end;
end
$$;

-- purge_candidates as in 0051, its cut-off counted in UTC by finished_before (see the
-- header). It locks, skip locked, the oldest finished runs of the statuses that no rule keeps.
create or replace function purge_candidates(
    p_older_than interval, p_statuses text[], p_limit integer, p_after_positions boolean
) returns text[]
language plpgsql
set search_path from current
set enable_bitmapscan = off
as $$
declare
    v_finished_before timestamptz := finished_before(p_older_than);
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

-- purge as in 0063, its age counted in UTC and checked where it ends, as start's timeout is
-- (see the header). It deletes one batch of finished runs, their history with them; lock
-- order as before: the runs (skip locked), then purge_positions.
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
    if purge.older_than is null or finished_before(purge.older_than) > now() then
        raise exception 'older_than must be an interval of zero or more (counted in UTC),'
            ' got %',
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

-- start as in 0070, a SQL NULL input handed off as the JSON null it is stored as (see the
-- header). It writes a pending run, or one claimed by an idle worker in this transaction.
create or replace function start(
    workflow text,
    input jsonb default 'null',
    run_id text default null,
    queue text default 'default',
    priority integer default 0,
    scheduled_for timestamptz default null,
    concurrency_key text default null,
    max_attempts integer default 3,
    timeout interval default null,
    parent_run_id text default null,
    parent_lease_epoch bigint default null,
    parent_step text default null,
    parent_position integer default null
) returns text
language plpgsql
set search_path from current
as $$
declare
    v_id text := coalesce(start.run_id, gen_random_uuid()::text);
    v_queue text := coalesce(start.queue, 'default');
    v_due timestamptz := coalesce(start.scheduled_for, now());
    v_input jsonb := coalesce(start.input, 'null');
    v_timeout_end timestamptz;
    v_started text;
    v_parent_status text;
begin
    if start.timeout is not null then
        -- months under 2000 years, days under 700,000 and a length under 10000 years keep
        -- every step of the addition within the years PostgreSQL holds, from a due time
        -- start accepts; any other timeout or due time is added where an overflow is caught
        if start.timeout > interval '0' and start.timeout < interval '10000 years'
           and abs(date_part('year', start.timeout)) < 2000
           and abs(date_part('day', start.timeout)) < 700000
           and v_due >= readable_time_start() and v_due < readable_time_end() then
            v_timeout_end := (v_due at time zone 'UTC' + start.timeout) at time zone 'UTC';
        else
            begin
                v_timeout_end := (v_due at time zone 'UTC' + start.timeout) at time zone 'UTC';
            exception when datetime_field_overflow then
                v_timeout_end := null;
            end;
        end if;
    end if;
    -- a start without a parent whose arguments are all plainly in bounds passes every check
    -- below: most starts are told so by this one expression; any other start goes through
    -- the checks one by one, which name what is wrong
    if (start.parent_run_id is null and start.parent_lease_epoch is null
        and start.parent_step is null
        and octet_length(start.workflow) between 1 and max_name_bytes()
        and octet_length(v_id) between 1 and max_name_bytes()
        and octet_length(v_queue) between 1 and max_name_bytes()
        and (start.concurrency_key is null
             or octet_length(start.concurrency_key) between 1 and max_name_bytes())
        and v_due >= readable_time_start() and v_due < readable_time_end()
        and start.max_attempts >= 1
        and (start.timeout is null
             or (v_timeout_end > v_due and v_timeout_end < readable_time_end()))
       ) is not true then
        perform check_name('workflow', start.workflow);
        perform check_name('run_id', v_id);
        perform check_name('queue', v_queue);
        if start.concurrency_key is not null then
            perform check_name('concurrency_key', start.concurrency_key);
        end if;
        if not isfinite(v_due) or v_due >= readable_time_end() or v_due < readable_time_start()
        then
            raise exception 'scheduled_for must be a finite time between the years 1 and 10000, got %',
                v_due using errcode = 'WF003';
        end if;
        if start.max_attempts is null or start.max_attempts < 1 then
            raise exception 'max_attempts must be at least 1, got %', start.max_attempts
                using errcode = 'WF003';
        end if;
        if start.timeout is not null and (v_timeout_end is null or v_timeout_end <= v_due
                                          or v_timeout_end >= readable_time_end()) then
            raise exception 'timeout must end after scheduled_for and before the year 10000'
                ' (counted in UTC), got % from %, which ends %', start.timeout, v_due,
                coalesce(v_timeout_end::text, 'past the times PostgreSQL holds')
                using errcode = 'WF003';
        end if;
        if start.parent_step is not null and start.parent_lease_epoch is null then
            raise exception 'parent_step needs parent_run_id and parent_lease_epoch'
                using errcode = 'WF003';
        end if;
        if start.parent_run_id is not null and start.parent_lease_epoch is null then
            -- a child started by hand: not under a cancelled run (a cancel in flight ends first)
            v_parent_status := lock_parent_by_hand(start.parent_run_id);
            if v_parent_status = 'cancelled' then
                raise exception 'run % was cancelled: it takes no more children',
                    start.parent_run_id using errcode = 'WF004';
            end if;
        end if;
        if start.parent_lease_epoch is not null then
            perform lock_held_run(start.parent_run_id, start.parent_lease_epoch, array['running']);
            if start.parent_step is not null then
                perform check_name('parent_step', start.parent_step);
                select s.output #>> '{}' into v_started from steps s
                where s.run_id = start.parent_run_id and s.name = start.parent_step;
                if found then
                    return v_started;
                end if;
            end if;
        end if;
    end if;
    -- nested, not one condition: hand_off writes, and only a due run fitting a payload is
    -- handed off
    if v_due <= now() and pg_column_size(v_input) < 7900 then
        if hand_off(v_id, start.workflow, v_queue, v_input,
                    coalesce(start.priority, 0), v_due, start.concurrency_key,
                    start.max_attempts, start.timeout, start.parent_run_id) then
            v_started := v_id;
        end if;
    end if;
    if v_started is null then
        v_started := insert_run(v_id, start.workflow, v_queue, v_input,
                                coalesce(start.priority, 0), v_due, start.concurrency_key,
                                start.max_attempts, start.timeout, start.parent_run_id);
    end if;
    if start.parent_step is not null then
        insert into steps (run_id, name, seq, position, kind, status, output, started_at)
        values (start.parent_run_id, start.parent_step, nextval('step_seq'),
                start.parent_position, 'start', 'completed', to_jsonb(v_started), now());
    end if;
    if start.parent_run_id is not null then
        -- a new version of the parent's row, even where nothing in it changes: a cancel
        -- under REPEATABLE READ whose snapshot misses this child then fails to lock the
        -- parent (40001, retry the transaction) instead of leaving the child unfinished
        update runs r
        set takeovers = case when start.parent_step is not null then 0 else r.takeovers end
        where r.id = start.parent_run_id;
    end if;
    return v_started;
end
$$;
