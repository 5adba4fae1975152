-- One page after the cursor, below the horizon ledger_horizon.sql computed
-- in an earlier statement ($8): every row below it is committed and visible
-- to this statement's later snapshot, and every row still to commit sorts at
-- or above it, so the cursor can neither skip a late commit nor repeat one.
select id, at, kind, tenant, resource, region, agent, epoch, seq, lease_id, tokens, reason, detail,
       txid::text as "txid!"
from ledger_event
where txid < $8::text::xid8
  and (txid, id) > ($1::text::xid8, $2)
  and ($3::text is null or tenant = $3)
  and ($4::text is null or resource = $4)
  and ($5::text is null or region = $5)
  and ($6::timestamptz is null or at >= $6)
order by txid, id
limit $7
