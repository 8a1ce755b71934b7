-- wrk script: POST the body in the file named by $BODY to the path in $BODY_PATH (default
-- /attention), as application/json. Used by `python -m bench.admission`.
local f = assert(io.open(os.getenv("BODY"), "rb"))
wrk.method = "POST"
wrk.body = f:read("*a")
wrk.path = os.getenv("BODY_PATH") or "/attention"
wrk.headers["Content-Type"] = "application/json"
f:close()
