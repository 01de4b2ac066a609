-- 0031_helpers_planned_once: the helpers that claim, heartbeat and the stalled-run sweep call
-- on every call are PL/pgSQL, whose statements are planned once per session.
--
-- max_takeovers() and worker_alive() were SQL functions with a search_path of their own, which
-- PostgreSQL never inlines: each call parsed and planned its query again. On an idle server
-- that cost about 0.1 ms a call (pg_stat_user_functions): a tenth of a claim, since every claim
-- and every heartbeat sweeps for stalled runs and the sweep reads max_takeovers().

-- max_takeovers as in 0003.
create or replace function max_takeovers() returns integer
language plpgsql stable
set search_path from current
as $$
begin
    return (select s.max_takeovers from settings s);
end
$$;

-- worker_alive as in 0003.
create or replace function worker_alive(p_worker text) returns boolean
language plpgsql stable
set search_path from current
as $$
begin
    return exists (select from workers w
                   where w.id = p_worker and w.last_seen_at + w.lease >= now());
end
$$;
