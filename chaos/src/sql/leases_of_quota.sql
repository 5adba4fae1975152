-- Every lease of one quota: id, window start (Unix s), tokens.
select lease_id::text as "lease_id!", window_start, tokens from lease where tenant = $1 and resource = $2
