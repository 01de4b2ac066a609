-- 0071_cancelled_families_stay_cancelled: nothing anywhere under a cancelled run is retried or
-- started by hand, and cancelling a cancelled run again cancels what its family left
-- unfinished.
--
-- cancel ends a run's whole family: every descendant, found through finished runs too
-- (family_to_cancel). But retry_dead_letter (0026) and a start by hand (lock_parent_by_hand,
-- 0043) looked only at the direct parent. An attack: g started p, p ran c, c and p
-- dead-lettered, g was cancelled; the retry of p was refused (WF004), but the retry of c was
-- accepted, and c ran again and started a child of its own, all under the cancelled g; so
-- was a child started by hand under p. cancel('g') again then answered 'cancelled' and left
-- those runs pending: it returned as soon as it found g finished. Now:
--
-- - retry_dead_letter and a start by hand walk up the family from the run's parent, by
--   primary key, one run a generation, up to the nearest cancelled ancestor or the root; a
--   retry or a start under a cancelled ancestor is refused (WF004), naming that ancestor. The
--   walk costs the depth of the run, whatever the number of its relatives (a run's siblings,
--   its ancestors' other children), and it ends at a loop of parents (a purged run's id used
--   again).
-- - They key-share lock what they walked, so a cancel of any of those runs in flight ends
--   first, and a cancel that comes later waits for them and finds the run retried or
--   started (before, the retry of c held only p, which a cancel of g does not lock: the
--   cancel committed with c dead-lettered in its snapshot, then the retry with c pending).
-- - cancel of a cancelled run cancels its unfinished descendants, as the first cancel did,
--   and returns 'cancelled', as before. A completed or dead-lettered run still answers its
--   status and changes nothing.
--
-- Lock order. cancel (as in 0026): the run and its unfinished descendants, for update, in id
-- order. retry_dead_letter: the run, for update; then its ancestors up to the nearest
-- cancelled one, key share, in id order. A start by hand: the parent (no key update) and
-- its ancestors up to the nearest cancelled one (key share), in one pass in id order; then
-- as in 0065 (an offered slot, skip locked, and the run's row). A run that a cancel and one
-- of the others both lock, each takes in id order, so neither holds one the other took
-- first while it waits (the parent is no exception: taken before its ancestors, it would be
-- held by a start waiting for an ancestor that a cancel holds, which waits for the parent).
-- The retried run, locked first, is a dead letter: a cancel locks it only when it is the run
-- cancelled, and the retry then wants nothing else the cancel holds. Key share conflicts
-- with no write of a worker (no key update) and a claim skips what is locked, so no worker
-- call waits for these locks.

-- The ancestors of run p_run_id (the run that started it, that run's starter, ...), nearest
-- first, up to and with the nearest cancelled one: what a retry of the run, or a start of a
-- child under it, locks and checks. Moves nothing. One primary-key lookup a generation. A
-- loop of parents (a purged run's id used again by a run started under its own descendant)
-- ends the walk where it closes: it meets again a run it marked, marking the run it is at
-- after 1, 2, 4, ... steps (Brent's cycle finding), so a loop costs at most a few rounds.
create function ancestors_to_cancelled(p_run_id text) returns text[]
language plpgsql stable
set search_path from current
as $$
declare
    v_ancestors text[] := '{}';
    v_id text;
    v_parent text;
    v_status text;
    v_marked text;
    v_since_marked integer := 0;
    v_span integer := 1;
begin
    select r.parent_run_id into v_id from runs r where r.id = p_run_id;
    loop
        select r.parent_run_id, r.status into v_parent, v_status from runs r
        where r.id = v_id;
        exit when not found;
        v_ancestors := v_ancestors || v_id;
        exit when v_status = 'cancelled' or v_parent = v_marked;
        v_since_marked := v_since_marked + 1;
        if v_since_marked = v_span then
            v_marked := v_id;
            v_span := v_span * 2;
            v_since_marked := 0;
        end if;
        v_id := v_parent;
    end loop;
    return v_ancestors;
end
$$;

-- The first run of p_runs (ancestors, nearest first) that is cancelled, or null. Moves
-- nothing; read after the runs were locked, it sees a cancel that committed meanwhile.
create function first_cancelled(p_runs text[]) returns text
language sql stable
set search_path from current
as $$
    select a.id from unnest(p_runs) with ordinality a (id, depth)
    join runs r on r.id = a.id
    where r.status = 'cancelled'
    order by a.depth
    limit 1
$$;

-- lock_parent_by_hand as in 0043, but the parent is locked with its ancestors up to the
-- nearest cancelled one, in id order, and a child under a cancelled ancestor is refused
-- (WF004, naming it); the parent's own status is returned, for start to refuse a cancelled
-- parent as before.
create or replace function lock_parent_by_hand(p_run_id text) returns text
language plpgsql
set search_path from current
set lock_timeout = '5s'
as $$
declare
    v_ancestors text[] := ancestors_to_cancelled(p_run_id);
    v_id text;
    v_status text;
    v_cancelled text;
begin
    for v_id in select r.id from runs r where r.id = p_run_id or r.id = any(v_ancestors)
                order by r.id loop
        if v_id = p_run_id then
            select r.status into v_status from runs r where r.id = v_id for no key update;
        else
            perform from runs r where r.id = v_id for key share;
        end if;
    end loop;
    if v_status is null then
        raise exception 'run % not found', p_run_id using errcode = 'WF002';
    end if;
    v_cancelled := first_cancelled(v_ancestors);
    if v_cancelled is not null and v_status <> 'cancelled' then
        raise exception 'run % takes no more children: its ancestor run % was cancelled',
            p_run_id, v_cancelled using errcode = 'WF004';
    end if;
    return v_status;
exception
    when lock_not_available then
        raise exception 'run % is busy: another transaction has held its row, or the row'
            ' of a run above it, for over %; try again', p_run_id,
            current_setting('lock_timeout') using errcode = 'WF005';
end
$$;

-- retry_dead_letter as in 0070 (its timeout counted in UTC, ending before the year 10000),
-- but not under a cancelled ancestor, however far up (above).
create or replace function retry_dead_letter(run_id text) returns text
language plpgsql
set search_path from current
set lock_timeout = '5s'
as $$
declare
    v_run runs := lock_run_for_operator(retry_dead_letter.run_id);
    v_first_rerun integer;
    v_ancestors text[];
    v_cancelled text;
begin
    if v_run.status <> 'dead_letter' then
        raise exception 'run % is %, only a dead_letter run can be retried',
            v_run.id, v_run.status using errcode = 'WF004';
    end if;
    -- key-share locked: a cancel in flight of any of them ends first
    v_ancestors := ancestors_to_cancelled(v_run.id);
    perform from runs r where r.id = any(v_ancestors) order by r.id for key share;
    v_cancelled := first_cancelled(v_ancestors);
    if v_cancelled is not null then
        raise exception 'run % cannot be retried: its % run % was cancelled', v_run.id,
            case when v_cancelled = v_run.parent_run_id then 'parent' else 'ancestor' end,
            v_cancelled using errcode = 'WF004';
    end if;
    insert into step_history (run_id, generation, name, kind, seq, position, status, output,
                              error, attempts, started_at, finished_at, compensable,
                              compensation_status, compensation_error, compensated_at)
    select s.run_id, v_run.generation, s.name, s.kind, s.seq, s.position, s.status, s.output,
           s.error, s.attempts, s.started_at, s.finished_at, s.compensable,
           s.compensation_status, s.compensation_error, s.compensated_at
    from steps s
    where s.run_id = v_run.id and retired_by_retry(s, v_run)
    on conflict do nothing;
    select min(s.position) into v_first_rerun from steps s
    where s.run_id = v_run.id
      and retired_by_retry(s, v_run) and s.compensation_status is distinct from 'failed';
    delete from steps s
    where s.run_id = v_run.id
      and retired_by_retry(s, v_run) and s.compensation_status is distinct from 'failed';
    update steps s set compensation_status = null, compensation_error = null, compensated_at = null
    where s.run_id = v_run.id and s.compensation_status is not null;
    delete from timers t where t.run_id = v_run.id and t.position > v_first_rerun;
    begin
        update runs r
        set status = 'pending', attempt = 1, error = null, output = null, compensation_ok = null,
            finished_at = null, scheduled_for = now(),
            timeout_at = case when r.timeout is not null then
                least((now() at time zone 'UTC' + r.timeout) at time zone 'UTC',
                      readable_time_end() - interval '1 microsecond') end,
            generation = r.generation + 1, lease_epoch = r.lease_epoch + 1, takeovers = 0,
            locked_by = null, locked_until = null
        where r.id = v_run.id;
    exception
        when unique_violation then
            raise exception 'run % cannot be retried while run % of concurrency key % is live',
                v_run.id,
                (select r.id from runs r where r.concurrency_key = v_run.concurrency_key
                    and r.status in ('pending', 'running', 'compensating')),
                v_run.concurrency_key
                using errcode = 'WF004';
    end;
    perform pg_notify(wakeup_channel(), v_run.queue);
    return v_run.id;
exception
    when lock_not_available then
        raise exception 'run % is busy: another transaction has held its row, or the row'
            ' of a run above it, for over %; try again', retry_dead_letter.run_id,
            current_setting('lock_timeout') using errcode = 'WF005';
end
$$;

-- cancel as in 0058, but a cancelled run's unfinished descendants are cancelled too (above):
-- a run cancelled or unfinished returns 'cancelled', a finished one its status, unchanged.
create or replace function cancel(run_id text) returns text
language plpgsql
set search_path from current
set lock_timeout = '5s'
as $$
declare
    v_family text[];
    v_status text;
    v_began timestamptz := clock_timestamp();
begin
    loop
        v_family := family_to_cancel(cancel.run_id);
        begin
            perform from runs r where r.id = any(v_family) order by r.id for update;
            exit when not exists (select unnest(family_to_cancel(cancel.run_id))
                                  except
                                  select unnest(v_family));
            -- the family grew: give these locks back, and take them all again in id order
            raise exception using errcode = 'WF0FG';
        exception
            when sqlstate 'WF0FG' then
                if clock_timestamp() - v_began > current_setting('lock_timeout')::interval then
                    raise exception 'run % is busy: the runs it started kept starting runs'
                        ' for over %; try again', cancel.run_id,
                        current_setting('lock_timeout') using errcode = 'WF005';
                end if;
        end;
    end loop;
    select r.status into v_status from runs r where r.id = cancel.run_id;
    if not found then
        raise exception 'run % not found', cancel.run_id using errcode = 'WF002';
    end if;
    if v_status not in ('pending', 'running', 'compensating', 'cancelled') then
        return v_status;
    end if;
    -- the time of the cancel, not of its transaction's start: it may have waited for a step
    -- of the run, which must not seem to finish after its run
    update runs r
    set status = 'cancelled', finished_at = clock_timestamp(), locked_by = null,
        locked_until = null,
        lease_epoch = r.lease_epoch + 1,
        compensation_ok = case when r.status = 'compensating' then false
                               else r.compensation_ok end
    where r.id = any(v_family) and r.status in ('pending', 'running', 'compensating');
    return 'cancelled';
exception
    when lock_not_available then
        raise exception 'run % is busy: another transaction has held its row, or the row of'
            ' a run it started, for over %; try again', cancel.run_id,
            current_setting('lock_timeout') using errcode = 'WF005';
end
$$;
