-- The table that records which numbered migrations a schema has; created before any of them.
create table if not exists schema_migrations (
    version integer primary key,
    name text not null,
    applied_at timestamptz not null default now()
);
