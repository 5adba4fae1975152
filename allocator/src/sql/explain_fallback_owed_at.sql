-- Fallback admits of every region reported for one window ($5, RFC 3339 in
-- the event's detail) up to an instant ($3) while that window was still
-- open (before $6): what the pool had repaid from its tokens as of $3 (see
-- reports.rs). The lower bound ($4, one window before it) keeps the scan to
-- a few windows.
select coalesce(sum((detail->>'fallback_admitted')::bigint), 0)::bigint as "owed!"
from ledger_event
where kind = 'reported' and tenant = $1 and resource = $2 and at >= $4 and at <= $3 and at < $6
  and detail->>'window_start' is not null
  and (detail->>'window_start')::timestamptz = $5
