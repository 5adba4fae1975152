-- One window's pool and one region's part of it as of an instant ($5),
-- rebuilt from the leases: tokens of leases issued up to it and returns of
-- releases up to it (both on the allocator's clock, as the ledger's `at`).
-- `lease_granted` and `lease_returned` cover every lease of the window: they
-- equal the stored totals unless retention deleted some of its leases, and
-- then the instant cannot be rebuilt. The region's demand is that of its
-- latest grant request up to the instant (each request stores a lease, also
-- one of 0 tokens).
select p.created_at, p.granted as stored_granted, p.returned as stored_returned,
       coalesce(sum(l.tokens), 0)::bigint as "lease_granted!",
       coalesce(sum(l.returned), 0)::bigint as "lease_returned!",
       coalesce(sum(l.tokens) filter (where l.issued_at <= $5), 0)::bigint as "granted!",
       coalesce(sum(l.returned) filter (where l.released_at <= $5), 0)::bigint as "returned!",
       coalesce(sum(l.tokens) filter (where l.region = $6), 0)::bigint as "r_lease_granted!",
       coalesce(sum(l.returned) filter (where l.region = $6), 0)::bigint as "r_lease_returned!",
       coalesce(sum(l.tokens) filter (where l.region = $6 and l.issued_at <= $5), 0)::bigint as "r_granted!",
       coalesce(sum(l.returned) filter (where l.region = $6 and l.released_at <= $5), 0)::bigint as "r_returned!",
       (select d.demand_per_sec from lease d
         where d.tenant = $1 and d.resource = $2 and d.window_start = $3 and d.window_secs = $4
           and d.region = $6 and d.issued_at <= $5
         order by d.issued_at desc, d.seq desc limit 1) as r_demand,
       (select d.want from lease d
         where d.tenant = $1 and d.resource = $2 and d.window_start = $3 and d.window_secs = $4
           and d.region = $6 and d.issued_at <= $5
         order by d.issued_at desc, d.seq desc limit 1) as r_last_want,
       max(l.issued_at) filter (where l.region = $6 and l.issued_at <= $5) as r_demand_at
from pool p
left join lease l
  on l.tenant = p.tenant and l.resource = p.resource
 and l.window_start = p.window_start and l.window_secs = p.window_secs
where p.tenant = $1 and p.resource = $2 and p.window_start = $3 and p.window_secs = $4
group by p.created_at, p.granted, p.returned
