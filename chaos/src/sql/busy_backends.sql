-- Client backends other than this one still running a statement: after the
-- allocator's link is cut, a commit already sent finishes before the
-- backend notices the closed connection.
select count(*) as "busy!"
from pg_stat_activity
where backend_type = 'client backend' and pid <> pg_backend_pid() and state <> 'idle'
  -- A commit waiting for a synchronous standby that is cut off never ends:
  -- it is no acknowledgement (the synchronous scenario checks that).
  and coalesce(wait_event, '') <> 'SyncRep'
