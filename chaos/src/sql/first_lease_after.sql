-- When the first lease of one quota with tokens was issued after an instant.
select min(issued_at) as first_issued_at from lease where tenant = $1 and resource = $2 and issued_at > $3 and tokens > 0
