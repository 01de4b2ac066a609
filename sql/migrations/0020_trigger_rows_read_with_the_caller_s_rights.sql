-- 0020_trigger_rows_read_with_the_caller_s_rights: no caller can make flowly turn a value of
-- the caller's own type into JSON with the owner's rights.
--
-- apply_roles made every flowly function SECURITY DEFINER. trigger_run_id and start_trigger
-- call to_jsonb on a value of the caller's (a row of the caller's table), and to_jsonb calls
-- the type's own cast to json when it has one: a worker-role login could create a type in
-- pg_temp with a cast whose function then ran as the schema owner (deleting flowly.runs, or
-- altering its own role into a superuser), by calling trigger_run_id on a value of it or by
-- attaching start_trigger to a temporary table with a column of it. trigger_run_id now runs
-- with the caller's rights, even with roles set up. start_trigger keeps the owner's (an
-- application role with INSERT on a table whose owner attached it still starts runs without
-- any right on flowly), but the worker role may no longer attach it: only the roles that may
-- execute it, the owner's, choose the tables, and so the types, it reads.

-- apply_roles as in 0010, but trigger_run_id stays SECURITY INVOKER and the worker role may not
-- attach start_trigger.
create or replace function apply_roles() returns void
language plpgsql
set search_path from current
as $$
declare
    v_settings settings;
    v_function regprocedure;
begin
    select * into v_settings from settings;
    if v_settings.worker_role is null then
        return;
    end if;
    -- setup_roles and apply_roles stay the caller's: only an administrator manages roles;
    -- trigger_run_id stays the caller's too (see the header)
    for v_function in
        select p.oid::regprocedure from pg_proc p
        where p.pronamespace = current_schema()::regnamespace
          and p.proname not in ('setup_roles', 'apply_roles', 'trigger_run_id')
    loop
        execute format('alter function %s security definer', v_function);
    end loop;
    alter function trigger_run_id(text, text, anyelement) security invoker;
    execute format('revoke all on all functions in schema %I from public', current_schema());
    execute format('revoke all on all tables in schema %I from public', current_schema());
    execute format('grant usage on schema %I to %I, %I', current_schema(),
                   v_settings.worker_role, v_settings.reader_role);
    execute format('grant execute on all functions in schema %I to %I', current_schema(),
                   v_settings.worker_role);
    execute format('grant select on all tables in schema %I to %I, %I', current_schema(),
                   v_settings.worker_role, v_settings.reader_role);
    execute format('revoke execute on function setup_roles(text, text), apply_roles(),'
                   ' start_trigger() from %I', v_settings.worker_role);
end
$$;
