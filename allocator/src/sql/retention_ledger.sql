-- One bounded batch, so a large backlog never holds one long transaction
-- or a lock on the whole table.
delete from ledger_event
where id in (select id from ledger_event where at < $1 order by at limit $2)
