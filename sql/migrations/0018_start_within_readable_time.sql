-- 0018_start_within_readable_time: start refuses times no client can read, and start_trigger
-- renders keys the same in every session.
--
-- start took a timeout that overflowed the timestamp range (22008 instead of WF003), and
-- scheduled_for or a timeout that ended after the year 9999, which PostgreSQL stores but
-- clients cannot read back (Python's datetime stops at 9999-12-31): every read of the run then
-- failed. Both must now end before the year 10000 (WF003). The engine's own "never"
-- (9999-12-31, parked runs) is still below it.
--
-- start_trigger and trigger_run_id render keys and inputs with to_jsonb under fixed settings,
-- but bytea followed the session's bytea_output and money its lc_monetary: the same bytea key
-- gave two run ids (and two runs) in two sessions. Both are now fixed too.

alter function start_trigger() set bytea_output to 'hex';
alter function start_trigger() set lc_monetary to 'C';
alter function trigger_run_id(text, text, anyelement) set bytea_output to 'hex';
alter function trigger_run_id(text, text, anyelement) set lc_monetary to 'C';

-- The first time clients cannot read: run times must come before it.
create function readable_time_end() returns timestamptz
language sql immutable
set search_path from current
as $$
    select timestamptz '10000-01-01 00:00:00+00'
$$;

-- start as in 0003, but for the bounds of scheduled_for and timeout.
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
    v_started text;
begin
    perform check_name('workflow', start.workflow);
    perform check_name('run_id', v_id);
    perform check_name('queue', v_queue);
    if start.concurrency_key is not null then
        perform check_name('concurrency_key', start.concurrency_key);
    end if;
    if not isfinite(v_due) or v_due >= readable_time_end() then
        raise exception 'scheduled_for must be a finite time before the year 10000, got %',
            v_due using errcode = 'WF003';
    end if;
    if start.max_attempts is null or start.max_attempts < 1 then
        raise exception 'max_attempts must be at least 1, got %', start.max_attempts
            using errcode = 'WF003';
    end if;
    if start.timeout is not null and (start.timeout <= interval '0'
                                      or start.timeout >= readable_time_end() - v_due) then
        raise exception 'timeout must be a positive interval that ends before the year 10000,'
            ' got %', start.timeout using errcode = 'WF003';
    end if;
    if start.parent_step is not null and start.parent_lease_epoch is null then
        raise exception 'parent_step needs parent_run_id and parent_lease_epoch'
            using errcode = 'WF003';
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
    v_started := insert_run(v_id, start.workflow, v_queue, coalesce(start.input, 'null'),
                            coalesce(start.priority, 0), v_due, start.concurrency_key,
                            start.max_attempts, start.timeout, start.parent_run_id);
    if start.parent_step is not null then
        insert into steps (run_id, name, seq, position, kind, status, output, started_at)
        values (start.parent_run_id, start.parent_step, nextval('step_seq'),
                start.parent_position, 'start', 'completed', to_jsonb(v_started), now());
        update runs r set takeovers = 0 where r.id = start.parent_run_id and r.takeovers > 0;
    end if;
    return v_started;
end
$$;
