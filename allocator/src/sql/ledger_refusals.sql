-- The latest refusals of one region for one quota up to an instant, newest
-- first: the "why was I throttled" part of an explanation.
select id, at, kind, tenant, resource, region, agent, epoch, seq, lease_id, tokens, reason, detail,
       txid::text as "txid!"
from ledger_event
where kind = 'refused' and tenant = $1 and resource = $2 and region = $3 and at <= $4
order by at desc, id desc
limit $5
