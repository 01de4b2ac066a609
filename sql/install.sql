-- Installs or upgrades flowly in one transaction:
--     psql -v ON_ERROR_STOP=1 -f sql/install.sql                  (schema "flowly")
--     psql -v ON_ERROR_STOP=1 -v schema=myapp_flowly -f sql/install.sql
-- Applies the numbered migrations the schema does not have yet and records them in
-- schema_migrations, exactly like `flowly install`; running it twice changes nothing.
-- Append a block here for every new file in migrations/.
\set ON_ERROR_STOP on
\if :{?schema}
\else
    \set schema flowly
\endif

begin;
set local client_min_messages = warning;
-- the checks `flowly install` makes: Postgres would silently truncate a long name
select set_config('flowly.install_schema', :'schema', true) as install_schema \gset
do $$
declare
    v_schema text := current_setting('flowly.install_schema');
begin
    if v_schema = '' then
        raise exception 'schema name must not be empty';
    elsif octet_length(v_schema) > 63 then
        raise exception 'schema name % is longer than 63 bytes', v_schema;
    elsif lower(left(v_schema, 3)) = 'pg_' then
        raise exception 'schema name % is reserved: names starting with pg_ are', v_schema;
    end if;
end $$;
-- the same lock `flowly install` takes, so concurrent installers apply each migration once
select pg_advisory_xact_lock(7237142851620390001) as install_locked \gset
create schema if not exists :"schema";
select set_config('search_path', format('%I, pg_catalog, pg_temp', :'schema'), true) as search_path \gset
\ir versions.sql

select not exists (select from schema_migrations where version = 1) as apply_migration \gset
\if :apply_migration
    \ir migrations/0001_engine.sql
    insert into schema_migrations (version, name) values (1, '0001_engine');
\endif

select not exists (select from schema_migrations where version = 2) as apply_migration \gset
\if :apply_migration
    \ir migrations/0002_dashboard_views.sql
    insert into schema_migrations (version, name) values (2, '0002_dashboard_views');
\endif

select not exists (select from schema_migrations where version = 3) as apply_migration \gset
\if :apply_migration
    \ir migrations/0003_hardening.sql
    insert into schema_migrations (version, name) values (3, '0003_hardening');
\endif

select not exists (select from schema_migrations where version = 4) as apply_migration \gset
\if :apply_migration
    \ir migrations/0004_dashboards_at_scale.sql
    insert into schema_migrations (version, name) values (4, '0004_dashboards_at_scale');
\endif

select not exists (select from schema_migrations where version = 5) as apply_migration \gset
\if :apply_migration
    \ir migrations/0005_retention.sql
    insert into schema_migrations (version, name) values (5, '0005_retention');
\endif

select not exists (select from schema_migrations where version = 6) as apply_migration \gset
\if :apply_migration
    \ir migrations/0006_schedules.sql
    insert into schema_migrations (version, name) values (6, '0006_schedules');
\endif

select not exists (select from schema_migrations where version = 7) as apply_migration \gset
\if :apply_migration
    \ir migrations/0007_start_trigger.sql
    insert into schema_migrations (version, name) values (7, '0007_start_trigger');
\endif

select not exists (select from schema_migrations where version = 8) as apply_migration \gset
\if :apply_migration
    \ir migrations/0008_transactional_steps.sql
    insert into schema_migrations (version, name) values (8, '0008_transactional_steps');
\endif

select not exists (select from schema_migrations where version = 9) as apply_migration \gset
\if :apply_migration
    \ir migrations/0009_waits.sql
    insert into schema_migrations (version, name) values (9, '0009_waits');
\endif

select not exists (select from schema_migrations where version = 10) as apply_migration \gset
\if :apply_migration
    \ir migrations/0010_roles.sql
    insert into schema_migrations (version, name) values (10, '0010_roles');
\endif

select not exists (select from schema_migrations where version = 11) as apply_migration \gset
\if :apply_migration
    \ir migrations/0011_writes_by_key.sql
    insert into schema_migrations (version, name) values (11, '0011_writes_by_key');
\endif

select not exists (select from schema_migrations where version = 12) as apply_migration \gset
\if :apply_migration
    \ir migrations/0012_finishing_in_bulk.sql
    insert into schema_migrations (version, name) values (12, '0012_finishing_in_bulk');
\endif

select not exists (select from schema_migrations where version = 13) as apply_migration \gset
\if :apply_migration
    \ir migrations/0013_claim_history_by_run.sql
    insert into schema_migrations (version, name) values (13, '0013_claim_history_by_run');
\endif

select not exists (select from schema_migrations where version = 14) as apply_migration \gset
\if :apply_migration
    \ir migrations/0014_wakeups_never_lost.sql
    insert into schema_migrations (version, name) values (14, '0014_wakeups_never_lost');
\endif

select not exists (select from schema_migrations where version = 15) as apply_migration \gset
\if :apply_migration
    \ir migrations/0015_runs_that_depend_on_runs.sql
    insert into schema_migrations (version, name) values (15, '0015_runs_that_depend_on_runs');
\endif

select not exists (select from schema_migrations where version = 16) as apply_migration \gset
\if :apply_migration
    \ir migrations/0016_transaction_steps_keep_their_transaction.sql
    insert into schema_migrations (version, name) values (16, '0016_transaction_steps_keep_their_transaction');
\endif

select not exists (select from schema_migrations where version = 17) as apply_migration \gset
\if :apply_migration
    \ir migrations/0017_claim_skips_priorities_not_due.sql
    insert into schema_migrations (version, name) values (17, '0017_claim_skips_priorities_not_due');
\endif

select not exists (select from schema_migrations where version = 18) as apply_migration \gset
\if :apply_migration
    \ir migrations/0018_start_within_readable_time.sql
    insert into schema_migrations (version, name) values (18, '0018_start_within_readable_time');
\endif

select not exists (select from schema_migrations where version = 19) as apply_migration \gset
\if :apply_migration
    \ir migrations/0019_undone_steps.sql
    insert into schema_migrations (version, name) values (19, '0019_undone_steps');
\endif

select not exists (select from schema_migrations where version = 20) as apply_migration \gset
\if :apply_migration
    \ir migrations/0020_trigger_rows_read_with_the_caller_s_rights.sql
    insert into schema_migrations (version, name) values (20, '0020_trigger_rows_read_with_the_caller_s_rights');
\endif

select not exists (select from schema_migrations where version = 21) as apply_migration \gset
\if :apply_migration
    \ir migrations/0021_cron_search_goes_forward.sql
    insert into schema_migrations (version, name) values (21, '0021_cron_search_goes_forward');
\endif

select not exists (select from schema_migrations where version = 22) as apply_migration \gset
\if :apply_migration
    \ir migrations/0022_wakeups_that_stay_true.sql
    insert into schema_migrations (version, name) values (22, '0022_wakeups_that_stay_true');
\endif

select not exists (select from schema_migrations where version = 23) as apply_migration \gset
\if :apply_migration
    \ir migrations/0023_purge_and_dashboards_at_scale.sql
    insert into schema_migrations (version, name) values (23, '0023_purge_and_dashboards_at_scale');
\endif

select not exists (select from schema_migrations where version = 24) as apply_migration \gset
\if :apply_migration
    \ir migrations/0024_waits_wait_only_for_endings.sql
    insert into schema_migrations (version, name) values (24, '0024_waits_wait_only_for_endings');
\endif

select not exists (select from schema_migrations where version = 25) as apply_migration \gset
\if :apply_migration
    \ir migrations/0025_missed_wakeups_kept_apart.sql
    insert into schema_migrations (version, name) values (25, '0025_missed_wakeups_kept_apart');
\endif

select not exists (select from schema_migrations where version = 26) as apply_migration \gset
\if :apply_migration
    \ir migrations/0026_cancelled_families_stay_cancelled.sql
    insert into schema_migrations (version, name) values (26, '0026_cancelled_families_stay_cancelled');
\endif

select not exists (select from schema_migrations where version = 27) as apply_migration \gset
\if :apply_migration
    \ir migrations/0027_events_refused_once_runs_end.sql
    insert into schema_migrations (version, name) values (27, '0027_events_refused_once_runs_end');
\endif

select not exists (select from schema_migrations where version = 28) as apply_migration \gset
\if :apply_migration
    \ir migrations/0028_purge_keeps_families_whole.sql
    insert into schema_migrations (version, name) values (28, '0028_purge_keeps_families_whole');
\endif

select not exists (select from schema_migrations where version = 29) as apply_migration \gset
\if :apply_migration
    \ir migrations/0029_transactional_checkpoints_are_progress.sql
    insert into schema_migrations (version, name) values (29, '0029_transactional_checkpoints_are_progress');
\endif

select not exists (select from schema_migrations where version = 30) as apply_migration \gset
\if :apply_migration
    \ir migrations/0030_hand_off_to_idle_workers.sql
    insert into schema_migrations (version, name) values (30, '0030_hand_off_to_idle_workers');
\endif

select not exists (select from schema_migrations where version = 31) as apply_migration \gset
\if :apply_migration
    \ir migrations/0031_helpers_planned_once.sql
    insert into schema_migrations (version, name) values (31, '0031_helpers_planned_once');
\endif

select not exists (select from schema_migrations where version = 32) as apply_migration \gset
\if :apply_migration
    \ir migrations/0032_hand_offs_leased_from_the_hand_off.sql
    insert into schema_migrations (version, name) values (32, '0032_hand_offs_leased_from_the_hand_off');
\endif

select not exists (select from schema_migrations where version = 33) as apply_migration \gset
\if :apply_migration
    \ir migrations/0033_cancels_that_end.sql
    insert into schema_migrations (version, name) values (33, '0033_cancels_that_end');
\endif

select not exists (select from schema_migrations where version = 34) as apply_migration \gset
\if :apply_migration
    \ir migrations/0034_batch_writes_probe_once.sql
    insert into schema_migrations (version, name) values (34, '0034_batch_writes_probe_once');
\endif

select not exists (select from schema_migrations where version = 35) as apply_migration \gset
\if :apply_migration
    \ir migrations/0035_purge_resumes_where_it_stopped.sql
    insert into schema_migrations (version, name) values (35, '0035_purge_resumes_where_it_stopped');
\endif

select not exists (select from schema_migrations where version = 36) as apply_migration \gset
\if :apply_migration
    \ir migrations/0036_hand_offs_checked_at_commit.sql
    insert into schema_migrations (version, name) values (36, '0036_hand_offs_checked_at_commit');
\endif

select not exists (select from schema_migrations where version = 37) as apply_migration \gset
\if :apply_migration
    \ir migrations/0037_timeouts_fence_writes.sql
    insert into schema_migrations (version, name) values (37, '0037_timeouts_fence_writes');
\endif

select not exists (select from schema_migrations where version = 38) as apply_migration \gset
\if :apply_migration
    \ir migrations/0038_wait_helpers_planned_once.sql
    insert into schema_migrations (version, name) values (38, '0038_wait_helpers_planned_once');
\endif

select not exists (select from schema_migrations where version = 39) as apply_migration \gset
\if :apply_migration
    \ir migrations/0039_schedule_ticks_put_failures_last.sql
    insert into schema_migrations (version, name) values (39, '0039_schedule_ticks_put_failures_last');
\endif

select not exists (select from schema_migrations where version = 40) as apply_migration \gset
\if :apply_migration
    \ir migrations/0040_sleeps_and_waits_end_before_year_10000.sql
    insert into schema_migrations (version, name) values (40, '0040_sleeps_and_waits_end_before_year_10000');
\endif

select not exists (select from schema_migrations where version = 41) as apply_migration \gset
\if :apply_migration
    \ir migrations/0041_fan_in_retries_ask_again.sql
    insert into schema_migrations (version, name) values (41, '0041_fan_in_retries_ask_again');
\endif

select not exists (select from schema_migrations where version = 42) as apply_migration \gset
\if :apply_migration
    \ir migrations/0042_retry_backoffs_drop_waits.sql
    insert into schema_migrations (version, name) values (42, '0042_retry_backoffs_drop_waits');
\endif

select not exists (select from schema_migrations where version = 43) as apply_migration \gset
\if :apply_migration
    \ir migrations/0043_hand_started_children_wait_bounded.sql
    insert into schema_migrations (version, name) values (43, '0043_hand_started_children_wait_bounded');
\endif

select not exists (select from schema_migrations where version = 44) as apply_migration \gset
\if :apply_migration
    \ir migrations/0044_default_names_count_per_branch.sql
    insert into schema_migrations (version, name) values (44, '0044_default_names_count_per_branch');
\endif

select not exists (select from schema_migrations where version = 45) as apply_migration \gset
\if :apply_migration
    \ir migrations/0045_cron_steps_over_one_value_ranges.sql
    insert into schema_migrations (version, name) values (45, '0045_cron_steps_over_one_value_ranges');
\endif

select not exists (select from schema_migrations where version = 46) as apply_migration \gset
\if :apply_migration
    \ir migrations/0046_fences_refuse_null_epochs.sql
    insert into schema_migrations (version, name) values (46, '0046_fences_refuse_null_epochs');
\endif

select not exists (select from schema_migrations where version = 47) as apply_migration \gset
\if :apply_migration
    \ir migrations/0047_leases_bounded.sql
    insert into schema_migrations (version, name) values (47, '0047_leases_bounded');
\endif

select not exists (select from schema_migrations where version = 48) as apply_migration \gset
\if :apply_migration
    \ir migrations/0048_times_readable_from_year_1.sql
    insert into schema_migrations (version, name) values (48, '0048_times_readable_from_year_1');
\endif

select not exists (select from schema_migrations where version = 49) as apply_migration \gset
\if :apply_migration
    \ir migrations/0049_event_timeouts_asked_again.sql
    insert into schema_migrations (version, name) values (49, '0049_event_timeouts_asked_again');
\endif

select not exists (select from schema_migrations where version = 50) as apply_migration \gset
\if :apply_migration
    \ir migrations/0050_batches_checked.sql
    insert into schema_migrations (version, name) values (50, '0050_batches_checked');
\endif

select not exists (select from schema_migrations where version = 51) as apply_migration \gset
\if :apply_migration
    \ir migrations/0051_bounds_of_hand_calls.sql
    insert into schema_migrations (version, name) values (51, '0051_bounds_of_hand_calls');
\endif

select not exists (select from schema_migrations where version = 52) as apply_migration \gset
\if :apply_migration
    \ir migrations/0052_cron_next_within_readable_times.sql
    insert into schema_migrations (version, name) values (52, '0052_cron_next_within_readable_times');
\endif

select not exists (select from schema_migrations where version = 53) as apply_migration \gset
\if :apply_migration
    \ir migrations/0053_gathered_event_timeouts_asked_again.sql
    insert into schema_migrations (version, name) values (53, '0053_gathered_event_timeouts_asked_again');
\endif

select not exists (select from schema_migrations where version = 54) as apply_migration \gset
\if :apply_migration
    \ir migrations/0054_hand_offs_missed_while_deaf.sql
    insert into schema_migrations (version, name) values (54, '0054_hand_offs_missed_while_deaf');
\endif

select not exists (select from schema_migrations where version = 55) as apply_migration \gset
\if :apply_migration
    \ir migrations/0055_backoffs_not_cut_short_by_events.sql
    insert into schema_migrations (version, name) values (55, '0055_backoffs_not_cut_short_by_events');
\endif

select not exists (select from schema_migrations where version = 56) as apply_migration \gset
\if :apply_migration
    \ir migrations/0056_gathered_waits_of_both_kinds_asked_again.sql
    insert into schema_migrations (version, name) values (56, '0056_gathered_waits_of_both_kinds_asked_again');
\endif

select not exists (select from schema_migrations where version = 57) as apply_migration \gset
\if :apply_migration
    \ir migrations/0057_run_backoffs_not_cut_short_by_events.sql
    insert into schema_migrations (version, name) values (57, '0057_run_backoffs_not_cut_short_by_events');
\endif

select not exists (select from schema_migrations where version = 58) as apply_migration \gset
\if :apply_migration
    \ir migrations/0058_large_families_cancelled_in_linear_time.sql
    insert into schema_migrations (version, name) values (58, '0058_large_families_cancelled_in_linear_time');
\endif

select not exists (select from schema_migrations where version = 59) as apply_migration \gset
\if :apply_migration
    \ir migrations/0059_heartbeats_past_a_held_worker_row.sql
    insert into schema_migrations (version, name) values (59, '0059_heartbeats_past_a_held_worker_row');
\endif

select not exists (select from schema_migrations where version = 60) as apply_migration \gset
\if :apply_migration
    \ir migrations/0060_purge_past_runs_the_application_references.sql
    insert into schema_migrations (version, name) values (60, '0060_purge_past_runs_the_application_references');
\endif

select not exists (select from schema_migrations where version = 61) as apply_migration \gset
\if :apply_migration
    \ir migrations/0061_families_walked_by_index.sql
    insert into schema_migrations (version, name) values (61, '0061_families_walked_by_index');
\endif

select not exists (select from schema_migrations where version = 62) as apply_migration \gset
\if :apply_migration
    \ir migrations/0062_frozen_workers_listeners_ended.sql
    insert into schema_migrations (version, name) values (62, '0062_frozen_workers_listeners_ended');
\endif

select not exists (select from schema_migrations where version = 63) as apply_migration \gset
\if :apply_migration
    \ir migrations/0063_purge_past_deferred_references.sql
    insert into schema_migrations (version, name) values (63, '0063_purge_past_deferred_references');
\endif

select not exists (select from schema_migrations where version = 64) as apply_migration \gset
\if :apply_migration
    \ir migrations/0064_run_counts_folded_past_held_locks.sql
    insert into schema_migrations (version, name) values (64, '0064_run_counts_folded_past_held_locks');
\endif

select not exists (select from schema_migrations where version = 65) as apply_migration \gset
\if :apply_migration
    \ir migrations/0065_starts_handed_off_in_fewer_steps.sql
    insert into schema_migrations (version, name) values (65, '0065_starts_handed_off_in_fewer_steps');
\endif

select not exists (select from schema_migrations where version = 66) as apply_migration \gset
\if :apply_migration
    \ir migrations/0066_steps_follow_their_runs_by_trigger.sql
    insert into schema_migrations (version, name) values (66, '0066_steps_follow_their_runs_by_trigger');
\endif

select not exists (select from schema_migrations where version = 67) as apply_migration \gset
\if :apply_migration
    \ir migrations/0067_idle_slots_offered_without_a_claim.sql
    insert into schema_migrations (version, name) values (67, '0067_idle_slots_offered_without_a_claim');
\endif

select not exists (select from schema_migrations where version = 68) as apply_migration \gset
\if :apply_migration
    \ir migrations/0068_starts_look_for_an_idle_slot_first.sql
    insert into schema_migrations (version, name) values (68, '0068_starts_look_for_an_idle_slot_first');
\endif

select not exists (select from schema_migrations where version = 69) as apply_migration \gset
\if :apply_migration
    \ir migrations/0069_runs_due_later_announced_with_their_time.sql
    insert into schema_migrations (version, name) values (69, '0069_runs_due_later_announced_with_their_time');
\endif

select not exists (select from schema_migrations where version = 70) as apply_migration \gset
\if :apply_migration
    \ir migrations/0070_timeouts_counted_in_utc.sql
    insert into schema_migrations (version, name) values (70, '0070_timeouts_counted_in_utc');
\endif

select not exists (select from schema_migrations where version = 71) as apply_migration \gset
\if :apply_migration
    \ir migrations/0071_cancelled_families_stay_cancelled.sql
    insert into schema_migrations (version, name) values (71, '0071_cancelled_families_stay_cancelled');
\endif

select not exists (select from schema_migrations where version = 72) as apply_migration \gset
\if :apply_migration
    \ir migrations/0072_schemas_by_name_and_narrow_grants.sql
    insert into schema_migrations (version, name) values (72, '0072_schemas_by_name_and_narrow_grants');
\endif

select not exists (select from schema_migrations where version = 73) as apply_migration \gset
\if :apply_migration
    \ir migrations/0073_parked_runs_wake_for_their_sleeps.sql
    insert into schema_migrations (version, name) values (73, '0073_parked_runs_wake_for_their_sleeps');
\endif

select not exists (select from schema_migrations where version = 74) as apply_migration \gset
\if :apply_migration
    \ir migrations/0074_the_settings_row_stays.sql
    insert into schema_migrations (version, name) values (74, '0074_the_settings_row_stays');
\endif

select not exists (select from schema_migrations where version = 75) as apply_migration \gset
\if :apply_migration
    \ir migrations/0075_null_arguments_named_and_sql_days_of_24_hours.sql
    insert into schema_migrations (version, name) values (75, '0075_null_arguments_named_and_sql_days_of_24_hours');
\endif

select not exists (select from schema_migrations where version = 76) as apply_migration \gset
\if :apply_migration
    \ir migrations/0076_purge_keeps_the_runs_a_family_is_walked_through.sql
    insert into schema_migrations (version, name) values (76, '0076_purge_keeps_the_runs_a_family_is_walked_through');
\endif

select not exists (select from schema_migrations where version = 77) as apply_migration \gset
\if :apply_migration
    \ir migrations/0077_idle_workers_keep_their_latency_across_stops_and_lost_listeners.sql
    insert into schema_migrations (version, name) values (77, '0077_idle_workers_keep_their_latency_across_stops_and_lost_listeners');
\endif

select not exists (select from schema_migrations where version = 78) as apply_migration \gset
\if :apply_migration
    \ir migrations/0078_null_arguments_refused_naming_them.sql
    insert into schema_migrations (version, name) values (78, '0078_null_arguments_refused_naming_them');
\endif

select not exists (select from schema_migrations where version = 79) as apply_migration \gset
\if :apply_migration
    \ir migrations/0079_the_worker_protocol_refuses_null_arguments.sql
    insert into schema_migrations (version, name) values (79, '0079_the_worker_protocol_refuses_null_arguments');
\endif

select not exists (select from schema_migrations where version = 80) as apply_migration \gset
\if :apply_migration
    \ir migrations/0080_heartbeat_and_release_check_their_batches.sql
    insert into schema_migrations (version, name) values (80, '0080_heartbeat_and_release_check_their_batches');
\endif

-- roles set up with setup_roles get their rights on whatever the migrations added
select to_regproc('apply_roles') is not null as has_roles \gset
\if :has_roles
    select apply_roles() is null as roles_applied \gset
\endif

commit;
