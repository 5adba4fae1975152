-- The ledger's horizon: a read serves only rows whose position (`txid`, see
-- migration 20261204200001) is below it. Run after ledger_tick.sql and
-- before the page query, each as its own statement.
--
-- Positions of rows still to be inserted are ≥ xmax − 1 of this statement's
-- snapshot, unless their writer already holds RowExclusiveLock on
-- ledger_event, and then they are ≥ that writer's xid. So the horizon is
-- the least of xmax − 1 and the xids of this database's ledger writers:
-- transactions of other databases, read-only ones and ones that write other
-- tables do not hold it back. Every row below it belongs to a transaction
-- that had ended when pg_locks was read, so the page query, which takes its
-- snapshot later, sees all of them: the cursor neither skips nor repeats.
--
-- pg_locks shows 32-bit xids; each is widened against xmax, which is within
-- 2^31 of every running xid. `held_secs` is how long the oldest writer's
-- transaction has run (null without writers), from which `as_of` follows.
with snap as (
    select pg_snapshot_xmax(pg_current_snapshot())::text::bigint as xmax
),
locks as materialized (
    select locktype, mode, virtualtransaction, transactionid, pid
    from pg_locks
    where granted
      and ((locktype = 'relation' and mode = 'RowExclusiveLock'
            and relation = 'ledger_event'::regclass
            and database = (select oid from pg_database where datname = current_database()))
           or (locktype = 'transactionid' and mode = 'ExclusiveLock'))
),
writers as (
    select w.virtualtransaction,
           min(s.xmax + (x.transactionid::text::bigint - s.xmax % 4294967296 + 6442450944) % 4294967296
               - 2147483648) as xid,
           min(coalesce(a.xact_start, p.prepared)) as since,
           bool_or(a.xact_start is null and p.prepared is null) as since_unknown
    from locks w
    join locks x on x.locktype = 'transactionid' and x.virtualtransaction = w.virtualtransaction
    cross join snap s
    left join pg_stat_activity a on a.pid = w.pid
    left join pg_prepared_xacts p on p.transaction = x.transactionid
    where w.locktype = 'relation'
    group by w.virtualtransaction
)
select least((select xmax from snap) - 1, (select min(xid) from writers))::text as "horizon!",
       extract(epoch from statement_timestamp() - (select min(since) from writers))::float8 as held_secs,
       coalesce((select bool_or(since_unknown) from writers), false) as "since_unknown!"
