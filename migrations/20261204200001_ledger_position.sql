-- A live ledger cursor (issue #20): a row's place in the cursor order is
-- fixed when the row is inserted, so the horizon a read may serve up to can
-- be taken from this database's ledger writers alone, not from every
-- transaction of the cluster.
--
-- Until now `txid` was the writing transaction's id and a read served only
-- rows below the cluster-wide snapshot xmin. Any transaction holding an xid
-- anywhere on the server (another database, an analytics session with a
-- temporary table, a forgotten `idle in transaction` that wrote something)
-- froze the ledger until it ended.
--
-- From this migration on `txid` is the row's *position* in the xid8 space:
--
--   position = greatest(writer's xid, xmax of a snapshot taken as the row is inserted − 1)
--
-- The snapshot is taken inside the insert, after the insert took its
-- RowExclusiveLock on ledger_event. That gives the two facts the reader
-- (`allocator/src/sql/ledger_horizon.sql`) relies on:
--
-- * a writer that did not hold the ledger lock when a reader looked will
--   only insert rows at positions ≥ that reader's xmax − 1 (xmax never goes
--   back), whatever xid it was given earlier;
-- * a writer that holds the lock only inserts rows at positions ≥ its own
--   xid, which the reader sees in pg_locks.
--
-- The "− 1" keeps a row committed before another writer obtained its xid
-- strictly below that writer's xid, so `as_of` can be derived from the
-- writers' start times. Rows written before this migration keep their xid,
-- which is below every position written after it.
create function ledger_event_position() returns trigger
language plpgsql
as $$
declare
    -- How long a transaction that wrote ledger rows may stay idle, or run
    -- one more statement, before PostgreSQL ends it: such a transaction is
    -- the only thing that can hold the ledger horizon back, so this bounds
    -- how long it can. A session may lower it (tests do); see the README.
    cap interval := coalesce(nullif(current_setting('quota.ledger_writer_timeout', true), ''), '30s')::interval;
begin
    -- Under REPEATABLE READ or SERIALIZABLE the snapshot below would be the
    -- transaction's first one, possibly older than the ledger lock, and the
    -- position could land behind a reader's horizon. Refuse rather than risk
    -- a row the cursor has already passed.
    if current_setting('transaction_isolation') <> 'read committed' then
        raise exception 'ledger_event rows must be written at read committed isolation, not %',
            current_setting('transaction_isolation')
            using errcode = 'feature_not_supported';
    end if;
    -- xid8 has no arithmetic; bigint holds it (2^63 xids is not a concern).
    new.txid := greatest(pg_snapshot_xmax(pg_current_snapshot())::text::bigint - 1,
                         pg_current_xact_id()::text::bigint)::text::xid8;
    if cap > interval '0' then
        -- Only ever lower a timeout the session already has.
        if current_setting('idle_in_transaction_session_timeout')::interval = interval '0'
           or current_setting('idle_in_transaction_session_timeout')::interval > cap then
            perform set_config('idle_in_transaction_session_timeout',
                               (extract(epoch from cap) * 1000)::bigint::text, true);
        end if;
        if current_setting('statement_timeout')::interval = interval '0'
           or current_setting('statement_timeout')::interval > cap then
            perform set_config('statement_timeout', (extract(epoch from cap) * 1000)::bigint::text, true);
        end if;
    end if;
    return new;
end
$$;

-- Before every insert, also COPY; it overrides any `txid` the writer gave.
create trigger ledger_event_position before insert on ledger_event
for each row execute function ledger_event_position();

-- `explain ?at=` adds up a region's reports of one window received up to an
-- instant; this keeps that to the region's reports of a few windows.
create index ledger_event_reported on ledger_event (tenant, resource, region, at) where kind = 'reported';
