select id, at, kind, tenant, resource, region, agent, epoch, seq, lease_id, tokens, reason, detail
from ledger_event
where id > $1
  and ($2::text is null or tenant = $2)
  and ($3::text is null or resource = $3)
  and ($4::text is null or region = $4)
  and ($5::timestamptz is null or at >= $5)
order by id
limit $6
