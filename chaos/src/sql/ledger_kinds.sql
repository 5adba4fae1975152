-- Ledger events of one quota (or of no quota, like registrations) by kind
-- and refusal reason, since an instant.
select kind, coalesce(reason, '') as "reason!", count(*)::bigint as "n!"
from ledger_event
where (tenant = $1 and resource = $2 or tenant is null) and at >= $3
group by kind, reason
