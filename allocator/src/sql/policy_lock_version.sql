select version from policy where tenant = $1 and resource = $2 for update
