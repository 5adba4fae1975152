-- Serves only events of transactions that ended before this statement's
-- snapshot was taken: everything that commits later has a txid at or above
-- that snapshot's xmin and so sorts after the cursor, which therefore can
-- neither skip a late commit nor repeat an event.
select id, at, kind, tenant, resource, region, agent, epoch, seq, lease_id, tokens, reason, detail,
       txid::text as txid
from ledger_event
where txid < pg_snapshot_xmin(pg_current_snapshot())
  and (txid, id) > ($1::text::xid8, $2)
  and ($3::text is null or tenant = $3)
  and ($4::text is null or resource = $4)
  and ($5::text is null or region = $5)
  and ($6::timestamptz is null or at >= $6)
order by txid, id
limit $7
