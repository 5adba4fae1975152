-- One region's reports of one window ($6, RFC 3339 in the event's detail):
-- consumption and fallback admits received up to an instant ($4), and in
-- all (to tell whether retention removed some). Reports of a window arrive
-- after it opens; the lower bound ($5, one window before it, for an agent
-- whose clock runs early) keeps the scan to a few windows of the region.
select coalesce(sum((detail->>'consumed')::bigint) filter (where at <= $4), 0)::bigint as "consumed!",
       coalesce(sum((detail->>'fallback_admitted')::bigint) filter (where at <= $4), 0)::bigint as "fallback_admitted!",
       coalesce(sum((detail->>'consumed')::bigint), 0)::bigint as "all_consumed!",
       coalesce(sum((detail->>'fallback_admitted')::bigint), 0)::bigint as "all_fallback_admitted!"
from ledger_event
where kind = 'reported' and tenant = $1 and resource = $2 and region = $3 and at >= $5
  and detail->>'window_start' is not null
  and (detail->>'window_start')::timestamptz = $6
