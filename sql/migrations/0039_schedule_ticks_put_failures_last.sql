-- 0039_schedule_ticks_put_failures_last: a tick takes the due schedules whose last tick failed
-- after the others.
--
-- tick_schedules takes at most a batch of due schedules, soonest due first, and leaves a
-- schedule it could not handle (its time zone gone from the server's tzdata, say) due at the
-- same fire time, to try again at the next tick. A batch's worth of such schedules due before
-- the others thus filled every batch: the healthy ones behind them never fired, although a
-- schedule that fails "does not hold up the others". They now come last; and the worker ticks
-- again at once while a tick came back with a full batch that started something
-- (flowly/worker/__init__.py), so more schedules due together than a batch all fire within
-- the minute of grace.

-- tick_schedules as in 0006, the schedules that failed at their last tick taken last.
create or replace function tick_schedules(batch integer default 100)
returns table (schedule text, fire_at timestamptz, run_id text, outcome text)
language plpgsql
set search_path from current
as $$
declare
    v_row schedules;
    v_slot timestamptz;
    v_late boolean;
    v_id text;
    v_outcome text;
    v_fires integer;
    v_message text;
    v_slots timestamptz[];
    v_ids text[];
    v_outcomes text[];
begin
    for v_row in
        select * from schedules s
        where not s.paused and s.next_fire_at <= now()
        -- those whose last tick failed after the others: they may fail again
        order by s.last_error is not null, s.next_fire_at
        limit greatest(tick_schedules.batch, 0)
        for update skip locked
    loop
        v_slots := '{}';
        v_ids := '{}';
        v_outcomes := '{}';
        begin
            v_slot := v_row.next_fire_at;
            v_fires := 0;
            while v_slot <= now() and v_fires < 10 loop
                v_fires := v_fires + 1;
                v_late := v_slot < now() - schedule_grace();
                v_id := null;
                if v_late and v_row.missed = 'skip' then
                    v_outcome := 'missed';
                elsif v_row.overlap = 'skip' and exists (
                        select from runs r where r.id = v_row.last_run_id
                          and r.status in ('pending', 'running', 'compensating')) then
                    v_outcome := 'overlap';
                else
                    v_id := schedule_run_id(v_row.name, v_slot);
                    v_outcome := case when exists (select from runs r where r.id = v_id)
                                      then 'already_started'
                                      when v_late then 'caught_up' else 'started' end;
                    perform start(workflow => v_row.workflow, input => v_row.input,
                                  run_id => v_id, queue => v_row.queue,
                                  priority => v_row.priority, scheduled_for => v_slot,
                                  max_attempts => v_row.max_attempts);
                    v_row.last_fire_at := v_slot;
                    v_row.last_run_id := v_id;
                end if;
                v_slots := v_slots || v_slot;
                v_ids := v_ids || v_id;
                v_outcomes := v_outcomes || v_outcome;
                v_slot := cron_next(v_row.cron,
                                    case when v_late then now() - schedule_grace() else v_slot end,
                                    v_row.timezone);
            end loop;
            update schedules s
            set next_fire_at = v_slot, last_fire_at = v_row.last_fire_at,
                last_run_id = v_row.last_run_id, last_error = null
            where s.name = v_row.name;
        exception when others then
            get stacked diagnostics v_message = message_text;
            update schedules s set last_error = v_message where s.name = v_row.name;
            v_slots := array[v_row.next_fire_at];
            v_ids := array[null];
            v_outcomes := array['error'];
        end;
        return query select v_row.name, u.slot, u.id, u.outcome
                     from unnest(v_slots, v_ids, v_outcomes) as u (slot, id, outcome);
    end loop;
end
$$;
