select id, at, kind, tenant, resource, region, agent, epoch, seq, lease_id, tokens, reason, detail,
       txid::text as "txid!"
from ledger_event
where lease_id = $1
order by txid, id
limit 1000
