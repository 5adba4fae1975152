-- A quota's kind, read only when the grant statement found no rate policy
-- (it reads a concurrency policy as none): `unknown_quota` or
-- `concurrency_policy`.
select kind from policy where tenant = $1 and resource = $2
