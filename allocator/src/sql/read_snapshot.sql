-- The first statement of a read that must see one snapshot in all its
-- statements (explain compares totals read by several of them).
set transaction isolation level repeatable read, read only
