-- 0069_runs_due_later_announced_with_their_time: a run started to be due later tells the
-- workers when, so that they claim it then instead of at their next poll.
--
-- A start woke idle workers with its queue's name, due or not. A run started with a delay or
-- a scheduled_for ahead was then claimed at the first poll after its time, up to
-- poll_interval late. Workers now time their claims for the runs they released themselves
-- (flowly/worker/due_timer.py); this gives them the due times of new runs too:
--
-- - a run due at once is announced as before: the queue's name, one notification a
--   transaction and queue (NOTIFY folds equal payloads);
-- - a run due within the hour is announced as {"queue": ..., "due": <epoch seconds>}, only
--   when it is due earlier than every run this transaction announced for its queue so far
--   (a transaction-local setting keeps that time), so a transaction that starts many runs
--   due later sends a few notifications, not one each: increasing times one, times in random
--   order about ln(n);
-- - a run due later than that is announced to nobody: no worker times it, and a wake-up
--   would only make each worker claim nothing.
--
-- A worker tells the two apart by the payload: a JSON object with a queue and a due time is
-- an announcement. A queue whose own name reads as one (it would have to be such an object,
-- with a due time ahead) has its runs claimed at that time or at the poll, not at once.

-- Announces to idle workers, at commit, a new run of p_queue due later, at p_due (see the
-- header); insert_run announces a run due at once itself, as before, which is most starts.
create function announce_run_due_later(p_queue text, p_due timestamptz) returns void
language plpgsql
set search_path from current
as $$
declare
    v_due numeric := extract(epoch from p_due);
    v_channel text;
    v_setting text;
    v_earliest text;
begin
    if p_due > now() + interval '1 hour' then
        return;
    end if;
    v_channel := wakeup_channel();
    -- a setting's name is letters, digits and dots: the channel and queue go in by digest
    v_setting := 'flowly.due_' || md5(v_channel || '/' || p_queue);
    v_earliest := current_setting(v_setting, true);
    if v_earliest is null or v_earliest = '' or v_due < v_earliest::numeric then
        perform set_config(v_setting, v_due::text, true);
        perform pg_notify(v_channel, json_build_object('queue', p_queue, 'due', v_due)::text);
    end if;
end
$$;

-- insert_run as in 0003, a run due later announced by announce_run_due_later.
create or replace function insert_run(
    p_id text, p_workflow text, p_queue text, p_input jsonb, p_priority integer,
    p_scheduled_for timestamptz, p_concurrency_key text, p_max_attempts integer,
    p_timeout interval, p_parent_run_id text
) returns text
language plpgsql
set search_path from current
as $$
declare
    v_existing text;
begin
    if current_setting('transaction_isolation') <> 'read committed' then
        select r.id into v_existing from runs r
        where r.id = p_id
           or (r.concurrency_key = p_concurrency_key
               and r.status in ('pending', 'running', 'compensating'))
        order by r.id = p_id desc
        limit 1;
        if found then
            return v_existing;
        end if;
        begin
            insert into runs (id, workflow, queue, input, priority, scheduled_for,
                              concurrency_key, max_attempts, timeout, timeout_at, parent_run_id)
            values (p_id, p_workflow, p_queue, p_input, p_priority, p_scheduled_for,
                    p_concurrency_key, p_max_attempts, p_timeout, p_scheduled_for + p_timeout,
                    p_parent_run_id);
        exception when unique_violation or serialization_failure then
            raise exception 'flowly.start: run % or the live run of concurrency key % was'
                ' committed after this % transaction took its snapshot, so it cannot see it;'
                ' retry the transaction', p_id, coalesce(p_concurrency_key, '(none)'),
                upper(current_setting('transaction_isolation'))
                using errcode = '40001';
        end;
        if p_scheduled_for <= now() then
            perform pg_notify(wakeup_channel(), p_queue);
        else
            perform announce_run_due_later(p_queue, p_scheduled_for);
        end if;
        return p_id;
    end if;
    -- a concurrency-key winner may finish between our insert and our look-up: then try again
    for v_try in 1..3 loop
        insert into runs (id, workflow, queue, input, priority, scheduled_for, concurrency_key,
                          max_attempts, timeout, timeout_at, parent_run_id)
        values (p_id, p_workflow, p_queue, p_input, p_priority, p_scheduled_for,
                p_concurrency_key, p_max_attempts, p_timeout, p_scheduled_for + p_timeout,
                p_parent_run_id)
        on conflict do nothing;
        if found then
            if p_scheduled_for <= now() then
                perform pg_notify(wakeup_channel(), p_queue);
            else
                perform announce_run_due_later(p_queue, p_scheduled_for);
            end if;
            return p_id;
        end if;
        select r.id into v_existing from runs r where r.id = p_id;
        if found then
            return v_existing;
        end if;
        select r.id into v_existing from runs r
        where r.concurrency_key = p_concurrency_key
          and r.status in ('pending', 'running', 'compensating');
        if found then
            return v_existing;
        end if;
    end loop;
    raise exception 'could not start run %: concurrency key % keeps changing hands',
        p_id, p_concurrency_key using errcode = 'WF004';
end
$$;
