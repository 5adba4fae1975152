-- Leases of one quota issued after an instant (grants resumed).
select count(*)::bigint as "leases!" from lease where tenant = $1 and resource = $2 and issued_at > $3
