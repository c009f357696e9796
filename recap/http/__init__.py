"""The HTTP toolkit every recap front end is built from: the OpenAI app (recap.server), the P/D proxy
(recap.disagg.proxy) and the Ray ingresses (recap.cluster).

errors (the OpenAI error body, the generic exception mapping, the handlers), json_body and limits (what a
body may hold), auth and guard (--api-key, body size and time, admission, the catch-all), sse and
disconnect (streams, clients that leave), timeouts (the header deadline, uvicorn), offload (work off the
event loop), request_counts (what became of each request), wire (names every side of the wire shares),
response_ids (the ids of stored responses and the replica each names).

Package order (one way; tests/test_package_edges.py checks it): recap.http imports no other serving
package; recap.server (the OpenAI app) and recap.disagg import recap.http; recap.cluster imports recap.http
and recap.disagg; recap.launch (and recap.cli through it) alone imports server, disagg and cluster together.
"""
