-- 0072_schemas_by_name_and_narrow_grants: flowly's own schema found by its name whatever the
-- name, the worker role granted only what workers and users call, role setups at once
-- serialised, and NULL lists of a worker named.
--
-- - apply_roles (0020) and deferrable_references (0063) found their schema with
--   current_schema()::regnamespace, which reads the name as SQL would an unquoted
--   identifier: in a schema "my app" (the README's example) that was "invalid name syntax",
--   and in "Upper" the schema upper (an error, or another schema's functions and keys). So
--   `install --roles` failed there, and so did every purge, a worker's --purge-after with it.
--   Both now compare pg_namespace.nspname with current_schema().
-- - apply_roles granted the worker role EXECUTE on every function, internal helpers
--   included, which trust their callers to have checked (insert_run writes a run due at
--   'infinity', release_held_run moves a finished run to '-infinity', and every listing
--   then failed with "timestamp too large"). It now grants the functions flowly's Python
--   side calls, those the README documents, and what trigger_run_id (which runs with its
--   caller's rights) calls; the rest are called only from inside flowly's functions, with
--   the owner's rights, and no role but the owner's may call them.
-- - setup_roles looked for each role, then created it: setups at once all found none, and
--   all but one failed with a duplicate key of pg_authid (and grants at once with "tuple
--   concurrently updated"). It now takes the install lock first, and a role another
--   database's setup created meanwhile (roles belong to the whole server) counts as made.
-- - register_worker and offer_slot (and claim_and_offer through it) wrote a NULL worker,
--   workflow list or queue list into a not-null column: a raw 23502. They refuse it as
--   WF003 naming the argument; offer_slot's check is one expression before its first read.

-- The deferrable foreign keys of any table that reference a table of this schema, as in
-- 0063, the schema found by its name.
create or replace function deferrable_references(out all_keys text, out deferred_keys text)
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
        join pg_namespace tn on tn.oid = t.relnamespace
        where c.contype = 'f' and c.condeferrable
          and tn.nspname = current_schema()
    ) k
$$;

-- apply_roles as in 0020, the schema found by its name, and the worker role granted only the
-- functions it calls (see the header): its rights on every other function are revoked, as
-- PUBLIC's are, so an install that upgrades a schema set up before this takes them back.
create or replace function apply_roles() returns void
language plpgsql
set search_path from current
as $$
declare
    v_settings settings;
    v_function regprocedure;
    -- what workers and clients call (flowly/db.py, flowly/schedules.py), what the README
    -- documents for users, triggers and workers, and what trigger_run_id calls
    v_worker_calls constant text[] := array[
        'begin_compensation_transaction', 'begin_transaction_step', 'cancel', 'checkpoint',
        'checkpoint_steps', 'checkpoint_transaction', 'claim', 'claim_and_offer', 'complete',
        'complete_runs', 'cron_next', 'end_stalled_listeners', 'fail_run', 'fail_step',
        'finish_compensation', 'finished_channel', 'fold_run_counts', 'heartbeat',
        'key_run_id', 'offer_slot', 'park', 'pause_schedule', 'purge', 'record_compensation',
        'record_compensation_transaction', 'record_listener', 'records_predate_branch_names',
        'register_worker', 'release', 'release_missed_handoffs', 'replay',
        'restart_takeovers', 'resume_schedule', 'retry_dead_letter', 'schedule',
        'send_event', 'sleep', 'start', 'tick_schedules', 'trigger_key_columns',
        'trigger_run_id', 'undone_steps', 'unregister_worker', 'unschedule',
        'wait_for_event', 'wait_for_run', 'wake_missed_waiters', 'wakeup_channel'];
begin
    select * into v_settings from settings;
    if v_settings.worker_role is null then
        return;
    end if;
    -- setup_roles and apply_roles stay the caller's: only an administrator manages roles;
    -- trigger_run_id stays the caller's too (see 0020)
    for v_function in
        select p.oid::regprocedure from pg_proc p
        join pg_namespace n on n.oid = p.pronamespace
        where n.nspname = current_schema()
          and p.proname not in ('setup_roles', 'apply_roles', 'trigger_run_id')
    loop
        execute format('alter function %s security definer', v_function);
    end loop;
    alter function trigger_run_id(text, text, anyelement) security invoker;
    execute format('revoke all on all functions in schema %I from public, %I',
                   current_schema(), v_settings.worker_role);
    execute format('revoke all on all tables in schema %I from public', current_schema());
    execute format('grant usage on schema %I to %I, %I', current_schema(),
                   v_settings.worker_role, v_settings.reader_role);
    for v_function in
        select p.oid::regprocedure from pg_proc p
        join pg_namespace n on n.oid = p.pronamespace
        where n.nspname = current_schema() and p.proname = any(v_worker_calls)
    loop
        execute format('grant execute on function %s to %I', v_function,
                       v_settings.worker_role);
    end loop;
    execute format('grant select on all tables in schema %I to %I, %I', current_schema(),
                   v_settings.worker_role, v_settings.reader_role);
end
$$;

-- setup_roles as in 0010, under the install lock, and a role created meanwhile by a setup in
-- another database taken as made (see the header).
create or replace function setup_roles(worker text default 'flowly_worker',
                                       reader text default 'flowly_reader') returns void
language plpgsql
set search_path from current
as $$
declare
    v_role text;
begin
    perform check_name('worker role', setup_roles.worker);
    perform check_name('reader role', setup_roles.reader);
    if setup_roles.worker = setup_roles.reader then
        raise exception 'the worker and reader roles must differ, got % twice',
            setup_roles.worker using errcode = 'WF003';
    end if;
    -- the lock sql/install.sql and `flowly install` take: one setup or install at a time
    -- in this database, and each statement below sees what the one before it committed
    perform pg_advisory_xact_lock(7237142851620390001);
    foreach v_role in array array[setup_roles.worker, setup_roles.reader] loop
        if not exists (select from pg_roles r where r.rolname = v_role) then
            begin
                execute format('create role %I nologin', v_role);
            exception when unique_violation or duplicate_object then
                null;  -- created at the same time by a setup in another database
            end;
        end if;
    end loop;
    update settings set worker_role = setup_roles.worker, reader_role = setup_roles.reader;
    perform apply_roles();
end
$$;

-- register_worker as in 0059, a NULL workflow or queue list refused (WF003).
create or replace function register_worker(
    p_worker text, p_workflows text[], p_queues text[], p_lease interval
) returns void
language plpgsql
set search_path from current
as $$
begin
    perform check_name('worker', p_worker);
    perform check_lease(p_lease);
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

-- offer_slot as in 0067, a NULL worker, workflow list or queue list refused (WF003) before
-- the first read: one expression, evaluated on every call, for a raise on none of them.
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
    perform check_lease(p_lease);
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
