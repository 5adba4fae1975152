-- Ends one transaction that was given an xid, so that every ledger row
-- inserted before this statement sorts below the horizon the next statement
-- computes (see ledger_horizon.sql). Without it the last rows written on a
-- quiet server would wait for some other transaction to finish. The commit
-- need not wait for its WAL flush: it records nothing.
select set_config('synchronous_commit', 'off', true), pg_current_xact_id()::text
