-- 0061_families_walked_by_index: cancel walks a run's family through the parent index
-- whatever the table's statistics say.
--
-- family_to_cancel (0026) finds a family one generation at a time, joining each generation
-- to runs by parent_run_id. With no statistics for a table that grew since its last analyze
-- (a fan-out just started, autovacuum not yet round), the planner hashed each generation
-- against a sequential scan of the whole table: a cancel of a parent with 20,000 children
-- and a chain 2,000 deep under one of them took 7 s, reading the table once per generation;
-- with statistics it takes 50 ms through runs_parent. Hash and merge joins are off for the
-- walk, so each generation looks its children up in runs_parent: 0.13 s without statistics.

alter function family_to_cancel(text) set enable_hashjoin = off set enable_mergejoin = off;
