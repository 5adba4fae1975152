-- A lease's events, found within its quota's rows (ledger_event_by_quota_txid)
-- rather than by a scan of the whole ledger: the caller read the lease first.
select id, at, kind, tenant, resource, region, agent, epoch, seq, lease_id, tokens, reason, detail,
       txid::text as "txid!"
from ledger_event
where tenant = $2 and resource = $3 and lease_id = $1
order by txid, id
limit 1000
