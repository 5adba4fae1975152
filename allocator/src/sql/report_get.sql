select body, accepted from report where report_id = $1
