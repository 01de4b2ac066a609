-- 0066_steps_follow_their_runs_by_trigger: a checkpoint no longer pays for a foreign key
-- check that its own lock has already made.
--
-- steps.run_id referenced runs(id) with on delete cascade. Its check ran for every inserted
-- step: a query of its own (through SPI) that finds the run's row and locks it for key
-- share, 12 microseconds of the 27 a bare insert of a step takes (batches of 128;
-- bench/RESULTS.md, fifteenth pass), on the path every step of every run goes through. It
-- could never fail: each function that inserts a step (checkpoint_steps,
-- checkpoint_transaction, fail_step, record_wait through wait_for_event and wait_for_run,
-- start for a child's parent) first locks the run's row, through its fence, lock_held_run or
-- lock_run_for_transaction, and writes nothing when the row is not there; every one of those
-- locks (for key share, no key update or update) holds a delete of the row back until the
-- step is committed.
--
-- What the key did besides, delete a run's steps with the run, is done by triggers now: a
-- delete of runs (a purge, or an operator's own) deletes their steps in the same statement,
-- and a truncate of runs truncates steps with it, so a run id used again never finds the
-- checkpoints of a run deleted before it.
--
-- Lock order as before: the run's row, then its steps.

alter table steps drop constraint steps_run_id_fkey;

-- Deletes the steps of the runs a statement deleted.
create function delete_steps_of_deleted_runs() returns trigger
language plpgsql
set search_path from current
as $$
begin
    delete from steps s using old_runs o where s.run_id = o.id;
    return null;
end
$$;

create trigger runs_delete_steps after delete on runs
    referencing old table as old_runs
    for each statement execute function delete_steps_of_deleted_runs();

-- Empties steps when runs is truncated.
create function truncate_steps_with_runs() returns trigger
language plpgsql
set search_path from current
as $$
begin
    truncate steps;
    return null;
end
$$;

create trigger runs_truncate_steps after truncate on runs
    for each statement execute function truncate_steps_with_runs();
