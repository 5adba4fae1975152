-- A region's permit lease as an applied request sets it (under the policy
-- row's lock, after the compare-and-set on seq; the caller never shortens
-- a live lease nor lowers its longest TTL).
insert into permit_lease (tenant, resource, region, held, seq, expires_at, ttl_secs, updated_at)
values ($1, $2, $3, $4, $5, $6, $7, $8)
on conflict (tenant, resource, region) do update set
    held = excluded.held,
    seq = excluded.seq,
    expires_at = excluded.expires_at,
    ttl_secs = excluded.ttl_secs,
    updated_at = excluded.updated_at
