select epoch from agent where region = $1 and agent = $2 for share
