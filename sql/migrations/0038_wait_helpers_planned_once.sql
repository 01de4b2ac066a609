-- 0038_wait_helpers_planned_once: the helpers that every park and every transactional step
-- call are PL/pgSQL, whose statements are planned once per session (as 0031 did for claim's).
--
-- parked_run_is_due (called by park and by wait_for_event / wait_for_run when they park) and
-- mark_step_transaction (by begin_transaction_step and begin_compensation_transaction) were SQL
-- functions with a search_path of their own, which PostgreSQL never inlines: called from
-- PL/pgSQL, their query was parsed and planned again in every transaction. Measured with
-- pg_stat_user_functions, 400 calls each in transactions of their own: parked_run_is_due
-- 242 us a call, mark_step_transaction 24.5 (6.3 as PL/pgSQL).

-- parked_run_is_due as in 0022.
create or replace function parked_run_is_due(p_run_id text) returns boolean
language plpgsql stable
set search_path from current
as $$
begin
    return exists (
        select from waits w
        where w.run_id = p_run_id
          and (w.timeout_at <= now()
               or (w.kind = 'event' and exists (
                       select from events e
                       where e.run_id = p_run_id and e.name = w.target
                         and e.consumed_by is null
                         and (w.timeout_at is null or e.sent_at <= w.timeout_at)))
               or (w.kind = 'run' and not exists (
                       select from runs t
                       where t.id = w.target
                         and t.status not in ('completed', 'dead_letter', 'cancelled')))));
end
$$;

-- mark_step_transaction as in 0016.
create or replace function mark_step_transaction(p_run_id text) returns void
language plpgsql
set search_path from current
as $$
begin
    perform set_config('flowly.step_transaction_of', p_run_id, true);
end
$$;
