select id, at, kind, tenant, resource, region, agent, epoch, seq, lease_id, tokens, reason, detail
from ledger_event
where lease_id = $1
order by id
limit 1000
