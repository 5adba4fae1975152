-- Which of these lease ids the database holds.
select lease_id::text as "lease_id!" from lease where lease_id::text = any($1)
