-- What each accepted report counted for one quota, per window: report id,
-- window start (Unix s), consumed + fallback admitted.
select r.report_id,
       extract(epoch from (i ->> 'window_start')::timestamptz)::bigint as "window_start!",
       sum((i ->> 'consumed')::bigint + (i ->> 'fallback_admitted')::bigint)::bigint as "counted!"
from report r, jsonb_array_elements(r.body -> 'items') i
where i ->> 'tenant' = $1 and i ->> 'resource' = $2
group by 1, 2
