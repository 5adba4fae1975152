select 1 as ok
