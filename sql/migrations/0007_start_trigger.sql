-- 0007_start_trigger: a ready-made trigger function that starts one run per inserted (or
-- updated) row, in the transaction that wrote the row.
--
--     create trigger orders_enqueue after insert on orders
--         for each row execute function flowly.start_trigger('process-order', 'id');
--     create trigger orders_enqueue after insert on orders
--         referencing new table as new_rows
--         for each statement execute function flowly.start_trigger('process-order', 'id');
--
-- Arguments: workflow, key columns ('id', 'tenant_id,id', '"Order No",id': SQL identifiers,
-- unquoted ones fold to lower case), then optionally the queue and the priority. The row
-- (to_jsonb) is the run's input. The run id is <workflow>:<key values joined by ','>, a
-- backslash escaping ',' and '\' inside a value, so a replayed or re-fired trigger finds the
-- run the key started and never starts a second one; an id over max_name_bytes() becomes
-- <workflow>:sha256:<hex of the UTF-8 key part> instead of failing the row. A null key, a
-- missing key column or a row that cannot become JSON fails the statement (WF003 for the
-- first two; the JSON error keeps its own SQLSTATE), naming the table, the column or the key.
--
-- The statement-level form inserts all the statement's runs with one insert ... select and
-- sends one NOTIFY per statement; the row form calls insert_run (start's insert) per row,
-- whose identical NOTIFYs PostgreSQL folds into one per transaction. A bulk INSERT wants the
-- statement form (bench/trigger_insert.py measures both). Key values are rendered by to_jsonb
-- under pinned settings (UTC, shortest float digits, postgres interval style), so a session's
-- TimeZone or IntervalStyle never changes a run id.
--
-- SQLSTATEs: WF003 invalid argument (bad trigger arguments, a null or missing key column, a
-- trigger that is not AFTER INSERT or UPDATE).

-- Reads a key column list ('id', ' Tenant_ID , id', '"Line, No",id') into column names the
-- way SQL reads identifiers, or refuses it with WF003; pure, so both trigger forms share it.
create function trigger_key_columns(p_list text) returns text[]
language plpgsql immutable
set search_path from current
as $$
declare
    v_columns text[] := '{}';
    v_item text;
    v_column text;
begin
    if p_list ~ '^[a-z_][a-z0-9_$]*$' then  -- the common case, one plain name
        return array[p_list];
    end if;
    if p_list is null or btrim(p_list) = '' then
        raise exception 'the key column list must name at least one column'
            using errcode = 'WF003';
    end if;
    if (p_list || ',') !~ '^((?:[^,"]|"(?:[^"]|"")*")*,)+$' then
        raise exception 'the key column list % has unbalanced double quotes', p_list
            using errcode = 'WF003';
    end if;
    for v_item in
        select btrim(m[1]) from regexp_matches(p_list || ',', '((?:[^,"]|"(?:[^"]|"")*")*),',
                                               'g') m
    loop
        if v_item = '' then
            raise exception 'the key column list % has an empty entry', p_list
                using errcode = 'WF003';
        elsif v_item !~ '^("([^"]|"")+"|[[:alpha:]_][[:alnum:]_$]*)$' then
            raise exception 'the key column list % holds %, which is not a column name:'
                ' quote a name with spaces, commas or capitals ("Order No")', p_list, v_item
                using errcode = 'WF003';
        end if;
        v_column := (parse_ident(v_item))[1];
        if v_column = any(v_columns) then
            raise exception 'the key column list % names column % more than once', p_list,
                v_column using errcode = 'WF003';
        end if;
        v_columns := v_columns || v_column;
    end loop;
    return v_columns;
end
$$;

-- The run id a key gives (see the header): p_columns' values in the row p_input, each
-- escaped, joined by ','; a digest when the id would exceed max_name_bytes(). Refuses a null
-- or missing key column with WF003, naming p_source (the table) and the column.
create function key_run_id(p_workflow text, p_columns text[], p_input jsonb, p_source text)
returns text
language plpgsql immutable
set search_path from current
as $$
declare
    v_column text;
    v_value text;
    v_key text;
    v_id text;
begin
    foreach v_column in array p_columns loop
        v_value := p_input ->> v_column;
        if v_value is null then
            if coalesce(p_input ? v_column, false) then
                raise exception '%: key column "%" is null; every key column needs a value'
                    ' to make the run id', p_source, replace(v_column, '"', '""')
                    using errcode = 'WF003';
            end if;
            raise exception '%: the row has no column "%" (key columns %)', p_source,
                replace(v_column, '"', '""'), array_to_string(p_columns, ',')
                using errcode = 'WF003';
        end if;
        v_value := replace(replace(v_value, '\', '\\'), ',', '\,');
        v_key := case when v_key is null then v_value else v_key || ',' || v_value end;
    end loop;
    v_id := p_workflow || ':' || v_key;
    if octet_length(v_id) > max_name_bytes() then
        v_id := p_workflow || ':sha256:' || encode(sha256(convert_to(v_key, 'UTF8')), 'hex');
        if octet_length(v_id) > max_name_bytes() then
            raise exception '%: the workflow name (% bytes) is too long to make run ids from'
                ' keys: with the key''s digest the id is % bytes; the limit is % bytes',
                p_source, octet_length(p_workflow), octet_length(v_id), max_name_bytes()
                using errcode = 'WF003';
        end if;
    end if;
    return v_id;
end
$$;

-- The run id start_trigger gives a row: trigger_run_id('process-order', 'id', o) for a row o
-- of the table (or its to_jsonb), rendered under the trigger's settings. For finding a row's
-- run from SQL; moves nothing.
create function trigger_run_id(workflow text, key_columns text, input anyelement)
returns text
language sql stable
set search_path from current
set timezone to 'UTC'
set intervalstyle to 'postgres'
set extra_float_digits to 1
as $$
    select key_run_id(trigger_run_id.workflow, trigger_key_columns(trigger_run_id.key_columns),
                      to_jsonb(trigger_run_id.input), 'trigger_run_id')
$$;

-- A SQL expression over a row aliased t that names its key ('tenant_id=acme, id=42'), for
-- error messages only: it uses the values' text, never their JSON (which may be what failed).
create function row_key_expression(p_columns text[]) returns text
language sql immutable
set search_path from current
as $$
    select format('concat_ws(%L%s)', ', ',
                  string_agg(format(', %L || coalesce((t.%I)::text, %L)',
                                    quote_ident(u.c) || '=', u.c, 'null'), '' order by u.o))
    from unnest(p_columns) with ordinality u (c, o)
$$;

-- Fails the statement because the row whose key is p_key cannot become the run's input:
-- re-raises the to_jsonb error (p_state, p_message, p_detail) with the table (p_source) and
-- the key in front, keeping its SQLSTATE.
create function raise_row_json_error(
    p_source text, p_key text, p_state text, p_message text, p_detail text
) returns void
language plpgsql
set search_path from current
as $$
begin
    raise exception '%: the row with %: cannot build the run''s input with to_jsonb: %',
        p_source, p_key, p_message || coalesce(' (' || nullif(p_detail, '') || ')', '')
        using errcode = p_state, detail = coalesce(p_detail, ''),
              hint = 'fix the row''s data, or start the run from your own trigger with an'
                     ' input you build';
end
$$;

-- Starts one run per new row of the INSERT or UPDATE that fired it (see the header for the
-- arguments), in that statement's transaction: for each row through insert_run, for each
-- statement with one insert ... select over the transition table and one NOTIFY. An existing
-- run id (a replay, a re-inserted key, a key shared by rows) starts nothing.
create function start_trigger() returns trigger
language plpgsql
set search_path from current
set timezone to 'UTC'
set intervalstyle to 'postgres'
set extra_float_digits to 1
as $$
declare
    v_source text := format('start_trigger on table %I.%I', tg_table_schema, tg_table_name);
    v_workflow text := tg_argv[0];
    v_columns text[];
    v_queue text := coalesce(tg_argv[2], 'default');
    v_priority integer := 0;
    v_input jsonb;
    v_key text;
    v_started text;
    v_table name;
    v_count bigint;
    v_row record;
    v_state text;
    v_message text;
    v_detail text;
begin
    if tg_nargs not between 2 and 4 then
        raise exception '% takes 2 to 4 arguments (workflow, key columns, queue, priority),'
            ' got %', v_source, tg_nargs using errcode = 'WF003';
    end if;
    if tg_when <> 'AFTER' then
        raise exception '% must be an AFTER trigger (a BEFORE trigger would start runs for'
            ' rows that never get written)', v_source using errcode = 'WF003';
    end if;
    if tg_op not in ('INSERT', 'UPDATE') then
        raise exception '% starts runs for new rows: fire it on INSERT or UPDATE, not %',
            v_source, tg_op using errcode = 'WF003';
    end if;
    -- per row, so check_name and trigger_key_columns only run when there is more to say
    if v_workflow is null or v_workflow = '' or octet_length(v_workflow) > max_name_bytes() then
        perform check_name('workflow', v_workflow);
    end if;
    if v_queue = '' or octet_length(v_queue) > max_name_bytes() then
        perform check_name('queue', v_queue);
    end if;
    if tg_argv[1] ~ '^[a-z_][a-z0-9_$]*$' then
        v_columns := array[tg_argv[1]];
    else
        v_columns := trigger_key_columns(tg_argv[1]);
    end if;
    if tg_nargs = 4 then
        v_priority := null;
        if tg_argv[3] ~ '^\s*[-+]?\d{1,10}\s*$' then
            if tg_argv[3]::bigint between -2147483648 and 2147483647 then
                v_priority := tg_argv[3]::integer;
            end if;
        end if;
        if v_priority is null then
            raise exception '%: priority must be an integer, got %', v_source, tg_argv[3]
                using errcode = 'WF003';
        end if;
    end if;

    if tg_level = 'ROW' then
        begin
            v_input := to_jsonb(new);
        exception when others then
            get stacked diagnostics v_state = returned_sqlstate, v_message = message_text,
                                    v_detail = pg_exception_detail;
            execute format('select %s from (select ($1).*) t', row_key_expression(v_columns))
                into v_key using new;
            perform raise_row_json_error(v_source, v_key, v_state, v_message, v_detail);
        end;
        -- what start would do, minus the checks made above
        v_started := insert_run(key_run_id(v_workflow, v_columns, v_input, v_source),
                                v_workflow, v_queue, v_input, v_priority, now(), null, 3, null,
                                null);
        return null;
    end if;

    -- qualified here and below: the transition table's name may shadow any unqualified one
    select t.tgnewtable into v_table from pg_catalog.pg_trigger t
    where t.tgrelid = tg_relid and t.tgname = tg_name;
    if v_table is null then
        raise exception '% for each statement needs the new rows: add'
            ' "referencing new table as new_rows" to create trigger', v_source
            using errcode = 'WF003';
    end if;
    begin
        execute format(
            'insert into %I.runs (id, workflow, queue, input, priority)
             select key_run_id($1, $2, n.input, $3), $1, $4, n.input, $5
             from (select to_jsonb(t) as input from %I t) n
             on conflict (id) do nothing', current_schema(), v_table)
            using v_workflow, v_columns, v_source, v_queue, v_priority;
        get diagnostics v_count = row_count;
    exception
        when sqlstate 'WF003' then  -- a null or missing key column: already says which
            raise;
        when others then
            -- a row that cannot become JSON gets its own message; other errors stand as they are
            for v_row in execute format('select t as r, %s as key from %I t',
                                        row_key_expression(v_columns), v_table) loop
                begin
                    v_input := to_jsonb(v_row.r);
                exception when others then
                    get stacked diagnostics v_state = returned_sqlstate,
                                            v_message = message_text,
                                            v_detail = pg_exception_detail;
                    perform raise_row_json_error(v_source, v_row.key, v_state, v_message,
                                                 v_detail);
                end;
            end loop;
            raise;
    end;
    if v_count > 0 then
        perform pg_notify(wakeup_channel(), v_queue);
    end if;
    return null;
end
$$;
