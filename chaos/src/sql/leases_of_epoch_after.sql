-- Leases issued to an agent incarnation at or below an epoch after an
-- instant (a fenced zombie must get none).
select count(*)::bigint as "leases!"
from lease
where region = $1 and agent = $2 and epoch <= $3 and issued_at > $4
