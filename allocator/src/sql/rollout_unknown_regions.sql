-- The canary regions no agent ever registered in (an agent row, or the
-- epoch floor retention keeps for a region whose agents it deleted).
select r as "region!"
from unnest($1::text[]) r
where not exists (select 1 from agent a where a.region = r)
  and not exists (select 1 from agent_epoch_floor f where f.region = r)
