-- The allocator's one clock (I8, DESIGN §6): the database's, read as the
-- statement runs (not the transaction's start, which may be a lock wait ago).
select clock_timestamp() as "now!"
