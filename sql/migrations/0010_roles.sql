-- 0010_roles: least-privilege roles for workers and clients, and for dashboards.
--
-- setup_roles(worker, reader) creates (if missing) two roles without login, meant to be
-- granted to login roles: the worker role may do everything a worker and a client do, but only
-- through flowly's functions (they run with their owner's rights and pin their search_path;
-- the role itself gets no INSERT, UPDATE or DELETE on any table), and read the tables; the
-- reader role may only read the tables and views. PUBLIC loses its default right to call
-- flowly's functions. The role names are kept in settings, and every later install applies
-- the same rights to what a migration added (apply_roles).

alter table settings add column worker_role text;
alter table settings add column reader_role text;

-- Applies the rights of the roles recorded in settings to every function, table, view and
-- sequence of the schema as it is now; does nothing when no roles were set up.
create function apply_roles() returns void
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
    -- setup_roles and apply_roles stay the caller's: only an administrator manages roles
    for v_function in
        select p.oid::regprocedure from pg_proc p
        where p.pronamespace = current_schema()::regnamespace
          and p.proname not in ('setup_roles', 'apply_roles')
    loop
        execute format('alter function %s security definer', v_function);
    end loop;
    execute format('revoke all on all functions in schema %I from public', current_schema());
    execute format('revoke all on all tables in schema %I from public', current_schema());
    execute format('grant usage on schema %I to %I, %I', current_schema(),
                   v_settings.worker_role, v_settings.reader_role);
    execute format('grant execute on all functions in schema %I to %I', current_schema(),
                   v_settings.worker_role);
    execute format('grant select on all tables in schema %I to %I, %I', current_schema(),
                   v_settings.worker_role, v_settings.reader_role);
    execute format('revoke execute on function setup_roles(text, text), apply_roles()'
                   ' from %I', v_settings.worker_role);
end
$$;

-- Creates the worker and reader roles when missing, records them, and applies their rights.
-- Needs a caller that may create roles (or roles that already exist).
create function setup_roles(worker text default 'flowly_worker',
                            reader text default 'flowly_reader') returns void
language plpgsql
set search_path from current
as $$
begin
    perform check_name('worker role', setup_roles.worker);
    perform check_name('reader role', setup_roles.reader);
    if setup_roles.worker = setup_roles.reader then
        raise exception 'the worker and reader roles must differ, got % twice',
            setup_roles.worker using errcode = 'WF003';
    end if;
    if not exists (select from pg_roles r where r.rolname = setup_roles.worker) then
        execute format('create role %I nologin', setup_roles.worker);
    end if;
    if not exists (select from pg_roles r where r.rolname = setup_roles.reader) then
        execute format('create role %I nologin', setup_roles.reader);
    end if;
    update settings set worker_role = setup_roles.worker, reader_role = setup_roles.reader;
    perform apply_roles();
end
$$;
