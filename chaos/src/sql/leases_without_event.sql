-- Leases of one quota with no `granted` event: a ledger event was lost.
select count(*)::bigint as "leases!"
from lease l
where l.tenant = $1 and l.resource = $2
  and not exists (select 1 from ledger_event e where e.lease_id = l.lease_id and e.kind = 'granted')
