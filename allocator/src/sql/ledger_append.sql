insert into ledger_event (at, kind, tenant, resource, region, agent, epoch, seq, lease_id, tokens, reason, detail)
values ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
