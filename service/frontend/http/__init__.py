"""A front end's HTTP connections and bodies, below the routes: uvicorn's protocols with deadlines
and head limits (http_protocol.py, http_heads.py), request bodies read with the size limit, the
memory budget and a minimum rate (bodies.py, body_wait.py), and the slow uploads admission may
evict (uploads.py)."""
