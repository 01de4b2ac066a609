-- 0074_the_settings_row_stays: flowly.settings keeps its one row.
--
-- An operator who deleted it (to reset max_takeovers, say) turned poison-run detection off
-- without a word: max_takeovers() read NULL, and no takeover count ever reached it. The
-- roles setup_roles recorded there were forgotten too, so an upgrade no longer granted them
-- what its migrations added. A delete or a truncate of the table is now refused (WF004,
-- InvalidState); an update changes what it holds.

-- Refuses to remove flowly.settings' row (a row trigger for delete, a statement trigger for
-- truncate): every reader of the table counts on exactly one row.
create function keep_settings_row() returns trigger
language plpgsql
set search_path from current
as $$
begin
    raise exception '%.% keeps its one row: update it to change a setting',
        quote_ident(tg_table_schema), quote_ident(tg_table_name) using errcode = 'WF004';
end
$$;

create trigger settings_row_kept before delete on settings
    for each row execute function keep_settings_row();
create trigger settings_row_kept_on_truncate before truncate on settings
    for each statement execute function keep_settings_row();
