-- 0040_sleeps_and_waits_end_before_year_10000: a sleep's wake time and an event wait's
-- deadline must be times clients can read back, as a run's scheduled time and timeout must
-- (0018); and a sleep may store its timer without releasing the run.
--
-- ctx.sleep("nap", 1e12) stored a timer, and the run's scheduled_for, in the year 33715, and
-- wait_for_event with such a timeout did the same through park: from then on every client that
-- read that run, or listed runs with it among them (Client.get, list_runs, `flowly runs`,
-- `flowly show`), failed with "timestamp too large (after year 10K)". Both now refuse it with
-- WF003 (flowly.InvalidArgument in the body: the run fails without retries).

-- sleep as in 0003, its wake time before the year 10000, and able to store the timer without
-- releasing the run: the worker stores the wake time when the sleep is reached and releases
-- the run once the steps running beside the sleep (asyncio.gather) landed. Released under
-- them, their checkpoints were stale and they ran again after the sleep.
drop function sleep(text, bigint, text, timestamptz, double precision, integer);
create function sleep(
    p_run_id text, p_epoch bigint, p_name text,
    p_wake_at timestamptz default null, p_seconds double precision default null,
    p_position integer default null, p_release boolean default true
) returns table (wake_at timestamptz, released boolean)
language plpgsql
set search_path from current
as $$
declare
    v_wake_at timestamptz := coalesce(p_wake_at, now() + make_interval(secs => p_seconds));
begin
    perform check_name('sleep name', p_name);
    if v_wake_at is null or not isfinite(v_wake_at) or v_wake_at >= readable_time_end() then
        raise exception 'sleep % needs a wake time before the year 10000, got %', p_name,
            coalesce(v_wake_at::text, 'none') using errcode = 'WF003';
    end if;
    perform lock_held_run(p_run_id, p_epoch, array['running']);
    insert into timers (run_id, name, wake_at, position)
    values (p_run_id, p_name, v_wake_at, p_position)
    on conflict do nothing;
    select t.wake_at into v_wake_at from timers t where t.run_id = p_run_id and t.name = p_name;
    wake_at := v_wake_at;
    -- with p_release false: whether the caller must release the run (the wake time is ahead)
    released := v_wake_at > now();
    if released and p_release then
        perform release_held_run(p_run_id, v_wake_at);
    elsif not released then
        update timers t set fired_at = now()
        where t.run_id = p_run_id and t.name = p_name and t.fired_at is null;
    end if;
    return next;
end
$$;

-- wait_for_event as in 0014, its timeout ending before the year 10000.
create or replace function wait_for_event(
    p_run_id text, p_epoch bigint, p_step text, p_event text,
    p_timeout double precision default null, p_position integer default null
) returns table (outcome text, payload jsonb)
language plpgsql
set search_path from current
as $$
declare
    v_recorded jsonb;
    v_event events;
    v_timeout_at timestamptz;
begin
    perform check_name('wait name', p_step);
    perform check_name('event name', p_event);
    -- NaN and the infinities are not between the bounds either (in PostgreSQL NaN is above
    -- every number), and make_interval would refuse them with an error of its own
    if p_timeout is not null and (p_timeout not between -1e15 and 1e15
                                  or now() + make_interval(secs => p_timeout)
                                     >= readable_time_end()) then
        raise exception 'wait % needs a timeout that ends before the year 10000, got % seconds',
            p_step, p_timeout using errcode = 'WF003';
    end if;
    perform lock_held_run(p_run_id, p_epoch, array['running']);
    select s.output into v_recorded from steps s
    where s.run_id = p_run_id and s.name = p_step;
    if found then
        if v_recorded ? 'payload' then
            outcome := 'received';
            payload := v_recorded -> 'payload';
        else
            outcome := 'timeout';
        end if;
        return next;
        return;
    end if;
    -- the deadline written when the wait was first reached (none yet: no limit)
    select w.timeout_at into v_timeout_at from waits w
    where w.run_id = p_run_id and w.step = p_step;
    select * into v_event from events e
    where e.run_id = p_run_id and e.name = p_event and e.consumed_by is null
      and (v_timeout_at is null or e.sent_at <= v_timeout_at)
    order by e.seq
    limit 1;
    if found then
        update events e set consumed_by = p_step
        where e.run_id = p_run_id and e.seq = v_event.seq;
        perform record_wait(p_run_id, p_step, 'event',
                            jsonb_build_object('payload', v_event.payload), p_position);
        outcome := 'received';
        payload := v_event.payload;
        return next;
        return;
    end if;
    insert into waits (run_id, step, kind, target, timeout_at)
    values (p_run_id, p_step, 'event', p_event, now() + make_interval(secs => p_timeout))
    on conflict do nothing;
    select w.timeout_at into v_timeout_at from waits w
    where w.run_id = p_run_id and w.step = p_step;
    if v_timeout_at <= now() then
        perform record_wait(p_run_id, p_step, 'event', jsonb_build_object('timeout', true),
                            p_position);
        outcome := 'timeout';
    else
        outcome := 'waiting';
    end if;
    return next;
end
$$;
