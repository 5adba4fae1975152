-- Which of these lease ids the database holds.
select lease_id::text from lease where lease_id::text = any($1)
