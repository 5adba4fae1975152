-- Operator surface: a ledger cursor that cannot skip a late commit, and the
-- indexes the retention job deletes by.

-- `id` comes from a sequence drawn before commit, so a transaction holding
-- id 10 can commit after one holding id 11 was already served past; an id
-- cursor would skip 10 for ever. The writing transaction's id is the sound
-- order: every event whose txid is below the reader's snapshot xmin belongs
-- to a finished transaction, and no later event can sort below it. Rows
-- written before this migration all get the migration's own txid, which
-- keeps their id order.
alter table ledger_event add column txid xid8 not null default pg_current_xact_id();

-- The cursor walks (txid, id); the filtered variant serves one quota.
create index ledger_event_by_txid on ledger_event (txid, id);
create index ledger_event_by_quota_txid on ledger_event (tenant, resource, txid, id);
-- Retention deletes the oldest events first.
create index ledger_event_by_at on ledger_event (at);
-- Retention deletes leases whose life ended before the horizon; windows keep
-- their pool and pool_region rows, which are the per-window summaries.
create index lease_by_expiry on lease (expires_at);
