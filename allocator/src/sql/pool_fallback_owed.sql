-- Charges fallback admits reported while the window is open to its pool.
update pool set fallback_owed = fallback_owed + $5
where tenant = $1 and resource = $2 and window_start = $3 and window_secs = $4
