-- 0057_run_backoffs_not_cut_short_by_events: an event sent to a run waiting out the backoff of
-- a retry of the whole run no longer wakes it before the backoff ends, as 0055 does for a
-- step's backoff.
--
-- A body that fails outside any step while one of its event waits is pending (a wait made in
-- a task the body had not awaited yet) is retried by fail_run, which releases the run until
-- its retry time and keeps the wait, since the wait has a deadline (0042). 0055 told a backoff
-- only by a step's failed attempt, which such a retry does not write: an event sent for the
-- wait made the run due at once, and a 2 s backoff ended after 0.05 s.
--
-- release_for_retry, through which both kinds of retry release a run, now writes the
-- backoff's end into the waits it keeps (waits.backoff_until), and retry_backoff_pending
-- reads it there: one answer for both kinds. The waits of runs in a step's backoff at the
-- upgrade are marked as 0055 found them.

alter table waits add column backoff_until timestamptz;

update waits w set backoff_until = r.scheduled_for
from runs r
where r.id = w.run_id and retry_backoff_pending(w.run_id);

-- release_for_retry as in 0042, the waits it keeps marked with the backoff's end.
-- Lock order: the run's row (held by the caller), then its waits.
create or replace function release_for_retry(p_run_id text, p_due timestamptz) returns void
language plpgsql
set search_path from current
as $$
begin
    -- a wait with a deadline keeps its row: the deadline is written when the wait is first
    -- reached and never moves
    delete from waits w where w.run_id = p_run_id and w.timeout_at is null;
    update waits w set backoff_until = p_due where w.run_id = p_run_id;
    perform release_held_run(p_run_id, p_due);
end
$$;

-- Whether the run waits out a retry's backoff now, a step's or the whole run's (asked only of
-- runs with a wait registered, which is where release_for_retry marks it).
create or replace function retry_backoff_pending(p_run_id text) returns boolean
language plpgsql stable
set search_path from current
as $$
begin
    return exists (select from waits w
                   where w.run_id = p_run_id and w.backoff_until > now());
end
$$;
